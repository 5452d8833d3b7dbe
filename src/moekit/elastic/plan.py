"""Transition plans of elastic expert parallelism: which worker copies, sends or loads which expert.

Pure index math (no processes, no torch.distributed). The controller computes one plan and
ships each worker its part, so every member of a transition acts on the same plan.

Letters: L layers, E logical experts, R physical slots, P ranks of the target world,
S = R / P slots per rank, U workers taking part in a transition (the union).

Capacity rule. In a world of P ranks every rank holds S = R / P expert slots, with
R = ceil((E + num_redundant) / P) * P: the E experts plus the redundant replicas, rounded up
to a multiple of P (the rounding slots become more replicas). A target world is valid only if
S <= max_slots_per_rank (the expert memory of one rank) and P <= E (every rank of FusedMoE's
expert-parallel placement holds at least one expert). Shrinking is therefore bounded below
by the smallest P with ceil((E + num_redundant) / P) <= max_slots_per_rank; requests below
it are refused before anything changes. (During a transition a worker holds its staged
slots beside its live ones: the rule bounds what serves, not that transient copy.)

Placement of the new world: the EPLB policy (moekit.eplb.rebalance_experts) on the recorded
load over P ranks. Its per-rank packs are then handed, layer by layer, to the ranks that
already hold most of their experts (`assign_packs`): permuting whole packs leaves every
rank's load unchanged, and fewer experts travel (a scale-down keeps the survivors' experts
in place; EPLB's own preserve_slots needs the same R and P before and after, which a
transition does not have).

Holdings: per worker and layer, the expert of each of its live slots (empty for a joiner).

The plan, per layer, for target rank r and each of its new slots s holding expert e:
  1. r's worker already holds e: a local copy (no communication);
  2. else some worker of the union holds e: it is received from one holder, one message
     per (expert, receiver) however many slots it fills; the holder with the fewest sends
     so far in this layer is chosen (ties: the lowest union index), as in EPLB's plan;
  3. else (every holder died): it is read from the checkpoint.
Workers that leave are in the union and only send. The union lists the target members
first, in rank order (union index = new rank), then the helpers (leavers).
The `RankPlan`s are moekit.eplb's, so moekit.eplb.exchange_layer moves the bytes: its
destination slots index the worker's new slots, its source slots its live ones.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from ..eplb.policy import rebalance_experts
from ..eplb.rearrange import RankPlan

__all__ = [
    "Holdings",
    "WorkerPlan",
    "TransitionPlan",
    "num_slots",
    "world_problem",
    "smallest_world",
    "check_world",
    "validate_request",
    "assign_packs",
    "place",
    "plan_transition",
    "apply_plan",
]

Holdings = Tuple[Tuple[int, ...], ...]  # per layer, the expert of each slot


@dataclass(frozen=True)
class WorkerPlan:
    """One worker's part of a transition.

    rank: its index in the union (its rank in the transition group).
    num_slots: S slots it holds afterwards (0 for a worker that leaves).
    layers: per layer, the moekit.eplb RankPlan run by exchange_layer.
    loads: per layer, (expert, new slots) read from the checkpoint.
    holdings: per layer, the expert of each new slot.
    """

    rank: int
    num_slots: int
    layers: Tuple[RankPlan, ...]
    loads: Tuple[Tuple[Tuple[int, Tuple[int, ...]], ...], ...]
    holdings: Holdings


@dataclass(frozen=True)
class TransitionPlan:
    """A whole transition: who takes part, the new placement and every worker's part.

    union: worker ids in union order (members first).  members: the target world in rank order.
    phy2log: [L][R] logical expert of each physical slot of the target world.
    workers: worker id -> WorkerPlan, for every worker of the union.
    """

    union: Tuple[str, ...]
    members: Tuple[str, ...]
    phy2log: Tuple[Tuple[int, ...], ...]
    workers: Dict[str, WorkerPlan]

    def counts(self) -> Dict[str, int]:
        """How many expert rows are copied locally, received and loaded from the checkpoint."""
        c = Counter()
        for wp in self.workers.values():
            for rp, loads in zip(wp.layers, wp.loads):
                c["copied"] += len(rp.local)
                c["received"] += sum(len(d) for _, _, d in rp.recvs)
                c["messages"] += len(rp.recvs)
                c["loaded"] += sum(len(d) for _, d in loads)
        return {k: c[k] for k in ("copied", "received", "messages", "loaded")}


def _int(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def num_slots(num_experts: int, num_redundant: int, num_ranks: int) -> int:
    """R = ceil((E + num_redundant) / P) * P: the physical slots of a world of P ranks."""
    E, extra, P = _int("num_experts", num_experts, 1), _int("num_redundant", num_redundant, 0), \
        _int("num_ranks", num_ranks, 1)
    return -(-(E + extra) // P) * P


def world_problem(num_experts: int, num_redundant: int, num_ranks: int, max_slots_per_rank: int) -> Optional[str]:
    """Why a world of P = num_ranks ranks cannot hold the experts (the capacity rule), or None."""
    E, P, cap = num_experts, num_ranks, _int("max_slots_per_rank", max_slots_per_rank, 1)
    if P > E:
        return f"a world of {P} ranks is larger than the E={E} experts (every rank must hold at least one expert)"
    R = num_slots(E, num_redundant, P)
    if R // P > cap:
        smallest = smallest_world(E, num_redundant, cap)
        hint = (f"the smallest world that fits has {smallest} ranks" if smallest is not None
                else "no world of at most E ranks fits")
        return (f"a world of {P} ranks cannot hold the experts: R={R} slots (E={E} + {num_redundant} redundant, "
                f"rounded up to a multiple of {P}) need {R // P} slots per rank, more than "
                f"max_slots_per_rank={cap}; {hint}")
    return None


def smallest_world(num_experts: int, num_redundant: int, max_slots_per_rank: int) -> Optional[int]:
    """The fewest ranks that can hold the experts under the capacity rule (None if none up to E)."""
    for P in range(1, num_experts + 1):
        if num_slots(num_experts, num_redundant, P) // P <= max_slots_per_rank:
            return P
    return None


def check_world(num_experts: int, num_redundant: int, num_ranks: int, max_slots_per_rank: int) -> int:
    """Raise ValueError unless a world of num_ranks ranks can hold the experts; return its R."""
    _int("num_ranks", num_ranks, 1)
    problem = world_problem(num_experts, num_redundant, num_ranks, max_slots_per_rank)
    if problem is not None:
        raise ValueError(problem)
    return num_slots(num_experts, num_redundant, num_ranks)


def validate_request(members: Sequence[str], keep: Sequence[str], add: int, *, num_experts: int,
                     num_redundant: int, max_slots_per_rank: int) -> Tuple[str, ...]:
    """Check a transition request against the serving world; return `keep` as a tuple.

    Args:
        members: the serving world's worker ids.  keep: the members that stay, in their new
            rank order.  add: how many new workers join (after them).
    Raises:
        TypeError / ValueError naming the request: unknown or repeated ids, a negative add,
        an empty target, a target the capacity rule refuses.
    """
    if isinstance(keep, str) or not isinstance(keep, Sequence):
        raise TypeError(f"keep must be a sequence of worker ids, got {keep!r}")
    keep = tuple(keep)
    unknown = [w for w in keep if w not in members]
    if unknown:
        raise ValueError(f"keep names unknown worker ids {unknown}; the serving members are {list(members)}")
    repeated = sorted({w for w in keep if keep.count(w) > 1})
    if repeated:
        raise ValueError(f"keep names worker ids more than once: {repeated}")
    _int("add", add, 0)
    P = len(keep) + add
    if P == 0:
        raise ValueError("the target world is empty (keep=[] and add=0): at least one worker must serve")
    problem = world_problem(num_experts, num_redundant, P, max_slots_per_rank)
    if problem is not None:
        raise ValueError(f"refused: keep {len(keep)} + add {add} workers: {problem}")
    return keep


def assign_packs(phy2log: torch.Tensor, num_ranks: int, holdings: Sequence[Holdings]) -> torch.Tensor:
    """Hand each layer's per-rank packs to the ranks that already hold most of their experts.

    Greedy per layer: the (pack, rank) pair with the largest overlap (multiset intersection
    of experts) first; ties: lower rank, then lower pack. Each rank's load is unchanged.

    Args:
        phy2log: [L, R] int64, rank p's pack = slots p*S .. (p+1)*S - 1.
        num_ranks: P.  holdings: per rank (new order), its current Holdings (L empty tuples for a joiner).
    Returns:
        [L, R] int64, whole packs permuted.
    """
    L, R = phy2log.shape
    P = num_ranks
    if R % P or len(holdings) != P:
        raise ValueError(f"need R={R} divisible by num_ranks={P} and one holdings per rank, got {len(holdings)}")
    S = R // P
    out = phy2log.clone()
    for layer in range(L):
        packs = [phy2log[layer, p * S:(p + 1) * S].tolist() for p in range(P)]
        held = [Counter(h[layer]) if len(h) else Counter() for h in holdings]
        pairs = sorted(((-sum((Counter(pack) & held[m]).values()), m, p) for p, pack in enumerate(packs)
                        for m in range(P)))
        taken_m, taken_p = set(), set()
        for _, m, p in pairs:
            if m in taken_m or p in taken_p:
                continue
            taken_m.add(m)
            taken_p.add(p)
            out[layer, m * S:(m + 1) * S] = torch.tensor(packs[p], dtype=out.dtype)
    return out


def place(load: torch.Tensor, num_ranks: int, *, num_redundant: int, num_groups: int,
          holdings: Sequence[Holdings]) -> Tuple[Tuple[int, ...], ...]:
    """The target world's placement: EPLB policy on `load`, packs given to their best holders.

    Args:
        load: [L, E] tokens per logical expert (zeros when nothing was recorded).
        num_ranks: P.  num_redundant: replicas beyond E (R = num_slots(E, num_redundant, P)).
        num_groups: G expert groups of the hierarchical policy (one node).
        holdings: per target rank, its current Holdings.
    Returns:
        phy2log [L][R] as nested tuples of ints.
    """
    R = num_slots(load.shape[1], num_redundant, num_ranks)
    phy2log, _, _ = rebalance_experts(load, R, num_groups, 1, num_ranks)
    phy2log = assign_packs(phy2log, num_ranks, holdings)
    return tuple(tuple(row) for row in phy2log.tolist())


def plan_transition(holdings: Mapping[str, Holdings], members: Sequence[str],
                    phy2log: Sequence[Sequence[int]], helpers: Sequence[str] = ()) -> TransitionPlan:
    """Plan the moves from the workers' holdings to the placement `phy2log` over `members`.

    Args:
        holdings: worker id -> Holdings, for every member and helper (L empty tuples for a joiner).
        members: the target world, in rank order.  phy2log: [L][R] with R divisible by P.
        helpers: workers that hold experts but leave (they may send).
    Returns:
        the TransitionPlan (see the module docstring for the rules).
    """
    members, helpers = tuple(members), tuple(helpers)
    union = members + helpers
    if not members:
        raise ValueError("members must name at least one worker, got none")
    if len(set(union)) != len(union):
        raise ValueError(f"members and helpers must be distinct worker ids, got {list(members)} and {list(helpers)}")
    L, P = len(phy2log), len(members)
    R = len(phy2log[0]) if L else 0
    if L == 0 or R % P:
        raise ValueError(f"phy2log must be [L >= 1][R] with R divisible by {P} members, got L={L}, R={R}")
    for w in union:
        if w not in holdings or len(holdings[w]) != L:
            raise ValueError(f"holdings must give worker {w!r} one tuple per layer ({L})")
    S = R // P
    first = {w: [{} for _ in range(L)] for w in union}  # w -> layer -> expert -> first live slot
    for w in union:
        for layer, row in enumerate(holdings[w]):
            for slot, e in enumerate(row):
                first[w][layer].setdefault(e, slot)
    local = {w: [[] for _ in range(L)] for w in union}
    recvs = {w: [[] for _ in range(L)] for w in union}
    sends = {w: [[] for _ in range(L)] for w in union}
    loads = {w: [[] for _ in range(L)] for w in union}
    for layer in range(L):
        missing: Dict[int, Dict[int, List[int]]] = {}  # expert -> new rank -> new slots
        for r, w in enumerate(members):
            for s in range(S):
                e = int(phy2log[layer][r * S + s])
                if e in first[w][layer]:
                    local[w][layer].append((s, first[w][layer][e]))
                else:
                    missing.setdefault(e, {}).setdefault(r, []).append(s)
        sends_done = [0] * len(union)
        for e in sorted(missing):
            holders = [u for u, w in enumerate(union) if e in first[w][layer]]
            for r in sorted(missing[e]):
                dst = tuple(missing[e][r])
                if not holders:
                    loads[members[r]][layer].append((e, dst))
                    continue
                src = min(holders, key=lambda h: (sends_done[h], h))
                sends_done[src] += 1
                recvs[members[r]][layer].append((e, src, dst))
                sends[union[src]][layer].append((e, r, first[union[src]][layer][e]))
    workers = {}
    for u, w in enumerate(union):
        n = S if u < P else 0
        workers[w] = WorkerPlan(
            rank=u, num_slots=n,
            layers=tuple(RankPlan(tuple(local[w][i]), tuple(recvs[w][i]), tuple(sends[w][i])) for i in range(L)),
            loads=tuple(tuple(loads[w][i]) for i in range(L)),
            holdings=tuple(tuple(int(e) for e in phy2log[i][u * S:(u + 1) * S]) if u < P else () for i in range(L)))
    return TransitionPlan(union, members, tuple(tuple(int(e) for e in row) for row in phy2log), workers)


def apply_plan(holdings: Mapping[str, Holdings], plan: TransitionPlan) -> Dict[str, Holdings]:
    """Run a plan on expert ids instead of weights: each member's holdings afterwards.

    The readable check of plan_transition: every new slot written exactly once, every
    receive matched by the sender's send of the same expert from a slot that holds it.
    Raises ValueError on any inconsistency.
    """
    out = {}
    for w in plan.members:
        wp = plan.workers[w]
        rows = []
        for layer, (rp, loads) in enumerate(zip(wp.layers, wp.loads)):
            new: List[Optional[int]] = [None] * wp.num_slots
            writes = [(d, holdings[w][layer][s]) for d, s in rp.local]
            for e, src, dst in rp.recvs:
                sender = plan.union[src]
                match = [s for x, r, s in plan.workers[sender].layers[layer].sends if x == e and r == wp.rank]
                if len(match) != 1 or holdings[sender][layer][match[0]] != e:
                    raise ValueError(f"layer {layer}: {w} receives expert {e} from {sender}, which does not send it")
                writes += [(d, e) for d in dst]
            writes += [(d, e) for e, dst in loads for d in dst]
            for d, e in writes:
                if new[d] is not None:
                    raise ValueError(f"layer {layer}: slot {d} of {w} is written twice")
                new[d] = e
            if None in new:
                raise ValueError(f"layer {layer}: slot {new.index(None)} of {w} is never written")
            rows.append(tuple(new))
        out[w] = tuple(rows)
    sent = sum(len(rp.sends) for wp in plan.workers.values() for rp in wp.layers)
    received = sum(len(rp.recvs) for wp in plan.workers.values() for rp in wp.layers)
    if sent != received:
        raise ValueError(f"the plan sends {sent} messages but receives {received}")
    return out

"""Moving expert weights between ranks after a new placement (torch.distributed P2P).

Letters: R physical slots, P ranks, S = R / P slots per rank (rank r owns slots r*S ..
(r+1)*S - 1). For one layer and one rank, every local slot whose expert changes is filled:

1. from a local slot that already holds the expert (a local copy; no communication);
2. otherwise received from a rank that holds it, once per rank however many local slots
   need it; among the holders the one with the fewest sends so far is chosen (ties: the
   lowest rank), so one hot expert does not make one rank send to everybody.

Every per-expert tensor (weights, biases, quantization scales: `ExpertWeights.
per_expert_tensors()`) travels together as one byte message per (expert, receiver), so any
dtype moves bit-exactly. Nothing is sent when a layer's placement did not change.

The exchange (`exchange_layer`) only reads the current weights and returns the new rows of
the changed slots (at most one layer of extra memory); `commit_layer` writes them in
place, so parameter addresses never change. The plan is pure index math computed
identically on every rank from the global old and new placements.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

__all__ = ["RankPlan", "StagedLayer", "plan_layer", "exchange_layer", "commit_layer", "rearrange_layer"]


@dataclass(frozen=True)
class RankPlan:
    """What one rank does for one layer (slots are local indices in [0, S)).

    local: (dst_slot, src_slot) copies of experts the rank already holds.
    recvs: (expert, src_rank, dst_slots) one message per expert, written to every dst slot.
    sends: (expert, dst_rank, src_slot) one message per (expert, receiver).
    """

    local: Tuple[Tuple[int, int], ...]
    recvs: Tuple[Tuple[int, int, Tuple[int, ...]], ...]
    sends: Tuple[Tuple[int, int, int], ...]

    @property
    def changed_slots(self) -> Tuple[int, ...]:
        """Every local slot this plan writes, in increasing order."""
        slots = [d for d, _ in self.local] + [s for _, _, dst in self.recvs for s in dst]
        return tuple(sorted(slots))


@dataclass(frozen=True)
class StagedLayer:
    """New contents of the changed local slots of one layer, not yet written.

    slots: [n] int64 local slot ids.  rows: one [n, ...] tensor per per-expert tensor.
    """

    slots: torch.Tensor
    rows: Tuple[torch.Tensor, ...]


def plan_layer(old_phy2log: Sequence[int], new_phy2log: Sequence[int], num_ranks: int) -> List[RankPlan]:
    """Plan the moves of one layer for every rank.

    Args:
        old_phy2log, new_phy2log: [R] logical expert of each slot before and after.
        num_ranks: P, a divisor of R.
    Returns:
        P RankPlans, index = rank.
    """
    old, new = [int(e) for e in old_phy2log], [int(e) for e in new_phy2log]
    if len(old) != len(new):
        raise ValueError(f"old_phy2log and new_phy2log must have one length, got {len(old)} and {len(new)}")
    R, P = len(new), num_ranks
    if P < 1 or R % P:
        raise ValueError(f"num_ranks={P} must be >= 1 and divide the number of slots R={R}")
    S = R // P
    first_slot: Dict[Tuple[int, int], int] = {}  # (rank, expert) -> first local slot holding it
    for g, e in enumerate(old):
        first_slot.setdefault((g // S, e), g % S)
    local: List[List[Tuple[int, int]]] = [[] for _ in range(P)]
    missing: Dict[int, Dict[int, List[int]]] = {}  # expert -> rank -> local slots to fill
    for g, e in enumerate(new):
        if old[g] == e:
            continue
        r, s = divmod(g, S)
        if (r, e) in first_slot:
            local[r].append((s, first_slot[(r, e)]))
        else:
            missing.setdefault(e, {}).setdefault(r, []).append(s)
    holders: Dict[int, List[int]] = {}
    for (r, e) in sorted(first_slot):
        holders.setdefault(e, []).append(r)
    unheld = sorted(set(missing) - set(holders))
    if unheld:  # nobody can send it: a new placement may only use experts the old one holds
        raise ValueError(f"new_phy2log places expert(s) {unheld} that no slot of old_phy2log holds")
    sends_done = [0] * P
    recvs: List[list] = [[] for _ in range(P)]
    sends: List[list] = [[] for _ in range(P)]
    for e in sorted(missing):
        for r in sorted(missing[e]):
            src = min(holders[e], key=lambda h: (sends_done[h], h))
            sends_done[src] += 1
            recvs[r].append((e, src, tuple(missing[e][r])))
            sends[src].append((e, r, first_slot[(src, e)]))
    return [RankPlan(tuple(local[r]), tuple(recvs[r]), tuple(sends[r])) for r in range(P)]


def _pack(tensors: Sequence[torch.Tensor], slot: int) -> torch.Tensor:
    """One slot's rows of every tensor as one uint8 buffer."""
    return torch.cat([t[slot].detach().contiguous().reshape(-1).view(torch.uint8) for t in tensors])


def _unpack(buf: torch.Tensor, tensors: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    """Inverse of _pack: one row per tensor (shape t.shape[1:], dtype t.dtype)."""
    rows, at = [], 0
    for t in tensors:
        n = t[0].numel() * t.element_size()
        rows.append(buf[at:at + n].clone().view(t.dtype).view(t.shape[1:]))
        at += n
    return rows


def _peer(group, rank: int) -> int:
    return rank if group is None or group == dist.group.WORLD else dist.get_global_rank(group, rank)


def exchange_layer(tensors: Sequence[torch.Tensor], plan: RankPlan, *, group=None) -> StagedLayer:
    """Run one rank's sends and receives of one layer; return the changed slots' new rows.

    Reads `tensors` only (their current contents are the old placement). Every rank of the
    group must call this for the same layer, each with its own plan.

    Args:
        tensors: per-expert tensors of this rank, each [S, ...] (ExpertWeights.per_expert_tensors()).
        plan: this rank's RankPlan.
        group: the process group of the P ranks; None for a single process (local copies only).
    """
    _check_tensors(tensors)
    if group is None and (plan.recvs or plan.sends):
        raise ValueError("the plan sends or receives experts but no process group was given (group=None)")
    device = tensors[0].device
    nbytes = sum(t[0].numel() * t.element_size() for t in tensors)
    ops, inbox = [], []
    for e, dst, src_slot in plan.sends:
        ops.append(dist.P2POp(dist.isend, _pack(tensors, src_slot), _peer(group, dst), group, tag=e))
    for e, src, dst_slots in plan.recvs:
        buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
        inbox.append((buf, dst_slots))
        ops.append(dist.P2POp(dist.irecv, buf, _peer(group, src), group, tag=e))
    if ops:
        for req in dist.batch_isend_irecv(ops):
            req.wait()
    slots = [d for d, _ in plan.local]
    rows: List[List[torch.Tensor]] = [[] for _ in tensors]
    if plan.local:
        src = torch.tensor([s for _, s in plan.local], dtype=torch.int64, device=device)
        for i, t in enumerate(tensors):
            rows[i].append(t.detach().index_select(0, src))
    for buf, dst_slots in inbox:
        unpacked = _unpack(buf, tensors)
        slots.extend(dst_slots)
        for i, row in enumerate(unpacked):
            rows[i].append(row.unsqueeze(0).expand(len(dst_slots), *row.shape))
    if not slots:
        return StagedLayer(torch.zeros(0, dtype=torch.int64, device=device),
                           tuple(t.detach()[:0].clone() for t in tensors))
    return StagedLayer(torch.tensor(slots, dtype=torch.int64, device=device),
                       tuple(torch.cat(r) for r in rows))


@torch.no_grad()
def commit_layer(tensors: Sequence[torch.Tensor], staged: StagedLayer) -> None:
    """Write staged rows into their slots, in place (tensor addresses stay the same)."""
    if staged.slots.numel() == 0:
        return
    for t, rows in zip(tensors, staged.rows):
        # As bytes: bit-exact for every dtype, fp8 included (no index_copy_ kernel for fp8 in torch).
        _as_bytes(t).index_copy_(0, staged.slots, _as_bytes(rows.contiguous()))


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """t [S, ...] viewed as uint8 [S, ..., element_size] over the same memory."""
    return t.unsqueeze(-1).view(torch.uint8)


def rearrange_layer(tensors: Sequence[torch.Tensor], old_phy2log: torch.Tensor, new_phy2log: torch.Tensor, *,
                    rank: int, num_ranks: int, group=None) -> int:
    """Move one layer's weights from the old placement to the new one; return slots written here.

    Args:
        tensors: this rank's per-expert tensors, each [S, ...] with S = R / P.
        old_phy2log, new_phy2log: [R] int64 global placements (identical on every rank).
        rank, num_ranks: this rank's index in `group` and P.
        group: process group of the P ranks (None: one process, P must be 1).
    """
    if group is None and num_ranks != 1:
        raise ValueError(f"num_ranks={num_ranks} needs a process group, got group=None")
    if old_phy2log.shape != new_phy2log.shape or old_phy2log.dim() != 1:
        raise ValueError(f"old_phy2log and new_phy2log must be [R] of one length, got {tuple(old_phy2log.shape)} "
                         f"and {tuple(new_phy2log.shape)}")
    if old_phy2log.is_floating_point() or new_phy2log.is_floating_point():
        raise TypeError(f"old_phy2log and new_phy2log must be integer tensors, got {old_phy2log.dtype} "
                        f"and {new_phy2log.dtype}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < num_ranks:
        raise ValueError(f"rank must be an int in [0, num_ranks={num_ranks}), got {rank!r}")
    _check_tensors(tensors, new_phy2log.shape[0] // num_ranks)
    if torch.equal(old_phy2log.cpu(), new_phy2log.cpu()):
        return 0
    plan = plan_layer(old_phy2log.tolist(), new_phy2log.tolist(), num_ranks)[rank]
    staged = exchange_layer(tensors, plan, group=group)
    commit_layer(tensors, staged)
    return int(staged.slots.numel())


def _check_tensors(tensors: Sequence[torch.Tensor], num_slots: Optional[int] = None) -> None:
    """Raise ValueError unless every tensor has the same number of slots first (num_slots if given)."""
    if not tensors:
        raise ValueError("tensors must hold at least one per-expert tensor, got none")
    S = tensors[0].shape[0] if num_slots is None else num_slots
    for t in tensors:
        if t.dim() < 1 or t.shape[0] != S:
            raise ValueError(f"every per-expert tensor must have S={S} rows first, got shape {tuple(t.shape)}")

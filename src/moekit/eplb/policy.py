"""EPLB policy: where each logical expert and its replicas go (EPLB.md, DeepSeek's algorithm).

Letters: L layers, E logical experts, R physical slots, G expert groups, N nodes, P GPUs.
Pipeline (hierarchical; the "global" policy is the same routine with G = N = 1):
groups -> nodes by balanced packing -> replicas inside each node -> slots -> GPUs by
balanced packing. Every step is a pure tensor function vectorised over layers (and nodes):
the Python loops run over items, never over layers.

Ties are broken by a stable rule everywhere: items of equal weight are visited lower index
first, packs of equal total take the lowest pack index, and replication picks the first
expert of largest load per replica. Loads are handled in float64 so integer token counts
stay exact far beyond float32's 2^24. `rebalance_experts_loop` is the readable per-layer
version the tests compare against.
"""

from __future__ import annotations

from typing import Dict, List, Tuple

import numpy as np
import torch

__all__ = [
    "check_policy_args",
    "check_sizes",
    "balanced_packing",
    "replicate_experts",
    "rebalance_experts",
    "rebalance_experts_loop",
    "preserve_slots",
    "gpu_loads",
    "static_gpu_loads",
    "balancedness",
    "improves",
]


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return value


def check_sizes(E: int, R: int, G: int, N: int, P: int, names: Dict[str, str]) -> None:
    """The policy's size rules: G groups divide the E experts, N nodes divide the P GPUs, and the P
    GPUs divide the R slots. names words each letter for the errors (the caller's argument names)."""
    for part, whole, fits in (("G", "E", E % G == 0), ("N", "P", P % N == 0), ("P", "R", R % P == 0)):
        if not fits:
            raise ValueError(f"{names[part]} must divide {names[whole]}")


def check_policy_args(load: torch.Tensor, num_replicas: int, num_groups: int, num_nodes: int,
                      num_gpus: int) -> torch.Tensor:
    """Validate the policy's inputs; return the load as a float64 CPU tensor [L, E].

    Args:
        load: [L, E] non-negative finite token counts (any real dtype, any device).
        num_replicas: R physical slots.  num_groups: G.  num_nodes: N.  num_gpus: P.
    """
    if not isinstance(load, torch.Tensor):
        raise TypeError(f"load must be a torch.Tensor [L, E], got {type(load).__name__}")
    if load.dim() != 2:
        raise ValueError(f"load must be 2-D [L, E], got shape {tuple(load.shape)}")
    if load.dtype == torch.bool or load.is_complex():
        raise TypeError(f"load must hold real numbers, got {load.dtype}")
    L, E = load.shape
    if E < 1:
        raise ValueError(f"load must have at least one expert (E >= 1), got shape {tuple(load.shape)}")
    R = _positive_int("num_replicas", num_replicas)
    G = _positive_int("num_groups", num_groups)
    N = _positive_int("num_nodes", num_nodes)
    P = _positive_int("num_gpus", num_gpus)
    check_sizes(E, R, G, N, P, {"E": f"the number of experts E={E}", "R": f"num_replicas={R}",
                                "G": f"num_groups={G}", "N": f"num_nodes={N}", "P": f"num_gpus={P}"})
    if R < E:
        raise ValueError(f"num_replicas={R} must be >= the number of experts E={E}")
    w = load.detach().to("cpu", torch.float64)
    if not bool(torch.isfinite(w).all()):
        raise ValueError("load must be finite, got inf or NaN entries")
    if bool((w < 0).any()):
        raise ValueError(f"load must be non-negative, got a minimum of {w.min().item()}")
    return w


def _inverse(perm: torch.Tensor) -> torch.Tensor:
    """Inverse of each row's permutation. perm: [X, n] int64."""
    inv = torch.empty_like(perm)
    return inv.scatter_(-1, perm, torch.arange(perm.shape[-1]).expand_as(perm))


def balanced_packing(weight: torch.Tensor, num_packs: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Pack each row's n weighted items into m packs of exactly n/m items.

    Items are visited by decreasing weight (stable: lower index first on equal weight); each
    goes to the non-full pack with the smallest total (ties: lowest pack index).

    Args:
        weight: [X, n] float64, X independent rows (layers, or layers x nodes).
        num_packs: m, a divisor of n.
    Returns:
        pack_index: [X, n] int64, the pack of each item.
        rank_in_pack: [X, n] int64, the item's position in its pack (order of arrival).
    """
    X, n = weight.shape
    per_pack = n // num_packs
    if per_pack == 1:  # n == m: the identity
        return torch.arange(n).expand(X, n).clone(), torch.zeros(X, n, dtype=torch.int64)
    order = torch.sort(weight, dim=-1, descending=True, stable=True).indices  # [X, n]
    w_sorted = weight.gather(-1, order)
    key = weight.new_zeros(X, num_packs)  # pack totals; +inf once a pack is full
    filled = torch.zeros(X, num_packs, dtype=torch.int64)
    one = torch.ones(X, 1, dtype=torch.int64)
    picks: List[torch.Tensor] = []
    for i in range(n):
        p = key.argmin(-1, keepdim=True)  # [X, 1]; argmin returns the first minimum
        picks.append(p)
        filled.scatter_add_(-1, p, one)
        key.scatter_add_(-1, p, w_sorted[:, i:i + 1])
        key.masked_fill_(filled == per_pack, float("inf"))
    pack_sorted = torch.cat(picks, dim=-1)  # [X, n] pack of the i-th heaviest item
    # Every pack ends with exactly n/m items, so after a stable sort by pack, pack p fills
    # positions p*n/m .. (p+1)*n/m - 1 in arrival order: the rank is the offset from p*n/m.
    by_pack = torch.sort(pack_sorted, dim=-1, stable=True).indices
    rank_by_pack = torch.arange(n) - pack_sorted.gather(-1, by_pack) * per_pack
    rank_sorted = torch.empty_like(rank_by_pack).scatter_(-1, by_pack, rank_by_pack)
    pack_index = torch.empty_like(pack_sorted).scatter_(-1, order, pack_sorted)
    rank_in_pack = torch.empty_like(rank_sorted).scatter_(-1, order, rank_sorted)
    return pack_index, rank_in_pack


def replicate_experts(weight: torch.Tensor, num_phy: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Give each of n experts one slot, then each extra slot to the largest load / replica count.

    Args:
        weight: [X, n] float64 loads.
        num_phy: slots per row (>= n).
    Returns:
        phy2log: [X, num_phy] int64, the expert of each slot (slot i < n holds expert i).
        rank: [X, num_phy] int64, the replica number of each slot within its expert.
        count: [X, n] int64, replicas per expert.
    """
    X, n = weight.shape
    count = torch.ones(X, n, dtype=torch.int64)
    one = torch.ones(X, 1, dtype=torch.int64)
    extra: List[torch.Tensor] = []
    ranks: List[torch.Tensor] = []
    for _ in range(num_phy - n):
        e = (weight / count).argmax(-1, keepdim=True)  # [X, 1]; argmax returns the first maximum
        extra.append(e)
        ranks.append(count.gather(-1, e))
        count.scatter_add_(-1, e, one)
    phy2log = torch.cat([torch.arange(n).expand(X, n)] + extra, dim=-1)
    rank = torch.cat([torch.zeros(X, n, dtype=torch.int64)] + ranks, dim=-1)
    return phy2log, rank, count


def _rebalance_hierarchical(weight: torch.Tensor, R: int, G: int, N: int, P: int):
    """EPLB.md steps 1-4. weight [L, E] float64 -> phy2log [L, R], rank [L, R], count [L, E]."""
    L, E = weight.shape
    group_size, groups_per_node = E // G, G // N
    E_node, R_node, slots_per_gpu = E // N, R // N, R // P
    # Step 1: groups -> nodes; renumber experts node-major ("mlog": node-local numbering).
    group_load = weight.view(L, G, group_size).sum(-1)  # [L, G]
    group_pack, group_rank = balanced_packing(group_load, N)
    log2mlog = (((group_pack * groups_per_node + group_rank) * group_size).unsqueeze(-1)
                + torch.arange(group_size)).flatten(-2)  # [L, E]
    mlog2log = _inverse(log2mlog)
    # Step 2: replicas inside each node.
    mload = weight.gather(-1, mlog2log).view(L * N, E_node)
    phy2mlog, phy_rank, mcount = replicate_experts(mload, R_node)  # [L*N, R_node] x2, [L*N, E_node]
    # Step 3: the node's slots -> its GPUs, each slot weighing load / replica count.
    slot_load = (mload / mcount).gather(-1, phy2mlog)  # [L*N, R_node]
    gpu, rank_on_gpu = balanced_packing(slot_load, P // N)
    pphy2phy = _inverse(gpu * slots_per_gpu + rank_on_gpu)  # final slot -> node-local slot
    # Step 4: back to logical expert ids.
    pphy2mlog = phy2mlog.gather(-1, pphy2phy).view(L, N, R_node) + (torch.arange(N) * E_node).view(1, N, 1)
    phy2log = mlog2log.gather(-1, pphy2mlog.flatten(-2))  # [L, R]
    rank = phy_rank.gather(-1, pphy2phy).view(L, R)
    count = mcount.view(L, E).gather(-1, log2mlog)
    return phy2log, rank, count


def _log2phy(phy2log: torch.Tensor, rank: torch.Tensor, num_logical: int) -> torch.Tensor:
    """[L, E, R - E + 1] physical slots of each expert, replica `rank` at position rank, -1 padded."""
    L, R = phy2log.shape
    width = R - num_logical + 1
    # numpy fills single-threaded: a torch fill this size (L*E*M, ~0.5M for DeepSeek-V3) is
    # an OpenMP region whose idle threads then spin and take the core the sequential
    # policy runs on (measured: 12 ms instead of 0.04 ms on a busy 2-core machine).
    out = torch.from_numpy(np.full((L, num_logical * width), -1, dtype=np.int64))
    out.scatter_(-1, phy2log * width + rank, torch.arange(R).expand(L, R))
    return out.view(L, num_logical, width)


def rebalance_experts(load: torch.Tensor, num_replicas: int, num_groups: int, num_nodes: int,
                      num_gpus: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Place E logical experts on R physical slots over P GPUs so per-GPU load is balanced.

    Hierarchical when G % N == 0, else global (G = N = 1). Slot i lives on GPU i // (R/P).

    Args:
        load: [L, E] non-negative token counts per logical expert (any real dtype/device).
        num_replicas: R, with R >= E and R % P == 0.
        num_groups: G, with E % G == 0 (1 when the model has no expert groups).
        num_nodes: N, with P % N == 0.
        num_gpus: P.
    Returns:
        phy2log: [L, R] int64 CPU, the logical expert of each physical slot.
        log2phy: [L, E, R - E + 1] int64 CPU, each expert's slots in replica order, -1 padded.
        replica_count: [L, E] int64 CPU, replicas per expert (>= 1, each row sums to R).
    """
    weight = check_policy_args(load, num_replicas, num_groups, num_nodes, num_gpus)
    if num_groups % num_nodes == 0:
        phy2log, rank, count = _rebalance_hierarchical(weight, num_replicas, num_groups, num_nodes, num_gpus)
    else:
        phy2log, rank, count = _rebalance_hierarchical(weight, num_replicas, 1, 1, num_gpus)
    return phy2log, _log2phy(phy2log, rank, weight.shape[1]), count


def _pack_loop(weights: List[float], num_packs: int) -> List[Tuple[int, int]]:
    """Readable balanced packing of one row: [(pack, rank_in_pack)] per item."""
    n = len(weights)
    per_pack = n // num_packs
    if per_pack == 1:  # n == m: the identity
        return [(i, 0) for i in range(n)]
    totals, sizes = [0.0] * num_packs, [0] * num_packs
    result = [(0, 0)] * n
    for item in sorted(range(n), key=lambda i: -weights[i]):  # sorted() is stable
        pack = min((p for p in range(num_packs) if sizes[p] < per_pack), key=lambda p: totals[p])
        result[item] = (pack, sizes[pack])
        totals[pack] += weights[item]
        sizes[pack] += 1
    return result


def rebalance_experts_loop(load: torch.Tensor, num_replicas: int, num_groups: int, num_nodes: int,
                           num_gpus: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """The same policy as `rebalance_experts`, one layer at a time in plain Python (for tests).

    Returns (phy2log [L, R], replica_count [L, E]) as int64 tensors.
    """
    weight = check_policy_args(load, num_replicas, num_groups, num_nodes, num_gpus)
    L, E = weight.shape
    R, G, N, P = num_replicas, num_groups, num_nodes, num_gpus
    if G % N:
        G, N = 1, 1
    gsize, E_node, R_node, per_gpu = E // G, E // N, R // N, R // P
    out_phy, out_cnt = [], []
    for row in weight.tolist():
        group_load = [sum(row[g * gsize:(g + 1) * gsize]) for g in range(G)]
        node_of = _pack_loop(group_load, N)
        # Node n owns the experts of its groups, in order of the groups' arrival.
        node_experts = [[] for _ in range(N)]
        for g in sorted(range(G), key=lambda g: node_of[g]):
            node_experts[node_of[g][0]].extend(range(g * gsize, (g + 1) * gsize))
        phy2log, count = [0] * R, [0] * E
        for node, experts in enumerate(node_experts):
            cnt = [1] * E_node
            slots = list(range(E_node))
            for _ in range(R_node - E_node):
                ratios = [row[experts[i]] / cnt[i] for i in range(E_node)]
                best = ratios.index(max(ratios))  # first maximum
                slots.append(best)
                cnt[best] += 1
            placed = _pack_loop([row[experts[s]] / cnt[s] for s in slots], P // N)
            for s, (gpu, pos) in zip(slots, placed):
                phy2log[node * R_node + gpu * per_gpu + pos] = experts[s]
            for i, e in enumerate(experts):
                count[e] = cnt[i]
        out_phy.append(phy2log)
        out_cnt.append(count)
    return (torch.tensor(out_phy, dtype=torch.int64).view(L, R),
            torch.tensor(out_cnt, dtype=torch.int64).view(L, E))


def preserve_slots(old_phy2log: torch.Tensor, new_phy2log: torch.Tensor, num_gpus: int) -> torch.Tensor:
    """Reorder a new placement inside each GPU so experts that stay on a GPU keep their slot.

    On each GPU, an old slot keeps its expert when the new placement still puts that expert
    on the GPU (matching the i-th copy of an expert on a GPU with its i-th new copy, in slot
    order); the freed slots, in slot order, take the newcomers in the new placement's order.
    The experts on each GPU are exactly the new placement's; only their slots move.

    Args:
        old_phy2log: [L, R] int64, the current placement.
        new_phy2log: [L, R] int64, the policy's answer.
        num_gpus: P, a divisor of R (GPU g owns slots g*R/P .. (g+1)*R/P - 1).
    Returns:
        [L, R] int64, new_phy2log reordered within each GPU.
    """
    for name, t in (("old_phy2log", old_phy2log), ("new_phy2log", new_phy2log)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.is_floating_point():
            raise ValueError(f"{name} must be a 2-D integer tensor [L, R], got {getattr(t, 'shape', type(t))}")
    if old_phy2log.shape != new_phy2log.shape:
        raise ValueError(f"old_phy2log and new_phy2log must have one shape, got {tuple(old_phy2log.shape)} "
                         f"and {tuple(new_phy2log.shape)}")
    L, R = new_phy2log.shape
    P = _positive_int("num_gpus", num_gpus)
    if R % P:
        raise ValueError(f"num_gpus={P} must divide the number of slots R={R}")
    S = R // P
    old = old_phy2log.to("cpu", torch.int64).reshape(L * P, S)
    new = new_phy2log.to("cpu", torch.int64).reshape(L * P, S)
    before = torch.ones(S, S, dtype=torch.bool).tril(-1)  # before[s, s'] = s' < s

    def copy_number(a):  # how many earlier slots of the row hold the same expert: [X, S]
        return ((a.unsqueeze(-1) == a.unsqueeze(-2)) & before).sum(-1)

    def copies_in(a, b):  # how many slots of b hold each slot's expert of a: [X, S]
        return (a.unsqueeze(-1) == b.unsqueeze(-2)).sum(-1)

    keep = copy_number(old) < copies_in(old, new)  # [X, S] old slot keeps its expert
    matched = copy_number(new) < copies_in(new, old)  # [X, S] new copy already in place
    free = torch.sort(keep.to(torch.int8), dim=-1, stable=True).indices  # freed slots first
    newcomers = torch.sort(matched.to(torch.int8), dim=-1, stable=True).indices  # unmatched first
    num_free = (~keep).sum(-1, keepdim=True)
    first = torch.arange(S).unsqueeze(0) < num_free  # [X, S]
    values = torch.where(first, new.gather(-1, newcomers), old.gather(-1, free))
    return old.scatter(-1, free, values).view(L, R)


def gpu_loads(load: torch.Tensor, phy2log: torch.Tensor, num_gpus: int) -> torch.Tensor:
    """Per-GPU load when each expert's load is split evenly over its replicas.

    Args:
        load: [L, E] logical loads.  phy2log: [L, R] int64.  num_gpus: P, a divisor of R.
    Returns:
        [L, P] float64.
    """
    L, R = phy2log.shape
    P = _positive_int("num_gpus", num_gpus)
    if R % P:
        raise ValueError(f"num_gpus={P} must divide the number of slots R={R}")
    w = load.detach().to("cpu", torch.float64)
    phy2log = phy2log.to("cpu", torch.int64)
    if phy2log.numel() and not 0 <= int(phy2log.min()) <= int(phy2log.max()) < w.shape[-1]:
        raise ValueError(f"phy2log entries must lie in [0, E={w.shape[-1]}), got values in "
                         f"[{int(phy2log.min())}, {int(phy2log.max())}]")
    count = torch.zeros_like(w).scatter_add_(-1, phy2log, torch.ones(L, R, dtype=torch.float64))
    if bool((count == 0).any()):
        raise ValueError("phy2log must give every logical expert at least one slot, got an expert with none")
    slot = (w / count).gather(-1, phy2log)
    return slot.view(L, P, R // P).sum(-1)


def static_gpu_loads(load: torch.Tensor, num_gpus: int) -> torch.Tensor:
    """Per-GPU load without EPLB: E experts in contiguous blocks, the first E % P GPUs one more
    (with P > E, one expert on each of the first E GPUs and none on the rest).

    Args:
        load: [L, E] logical loads.  num_gpus: P.
    Returns:
        [L, P] float64.
    """
    L, E = load.shape
    P = _positive_int("num_gpus", num_gpus)
    base, extra = divmod(E, P)
    sizes = torch.tensor([base + (1 if g < extra else 0) for g in range(P)])
    owner = torch.repeat_interleave(torch.arange(P), sizes)  # [E]
    w = load.detach().to("cpu", torch.float64)
    return w.new_zeros(L, P).index_add_(1, owner, w)


def improves(load: torch.Tensor, old: torch.Tensor, new: torch.Tensor, num_gpus: int,
             min_improvement: float = 0.0) -> torch.Tensor:
    """Per layer, whether placement `new` lowers the busiest GPU's load below `old`'s by more
    than the fraction min_improvement (a layer without load never improves).

    Args:
        load: [L, E] logical loads.  old, new: [L, R] int64 placements.  num_gpus: P.
    Returns:
        [L] bool.
    """
    peak_old = gpu_loads(load, old, num_gpus).amax(-1)  # [L]
    peak_new = gpu_loads(load, new, num_gpus).amax(-1)  # [L]
    return peak_new < peak_old * (1.0 - min_improvement)


def balancedness(gpu_load: torch.Tensor) -> Tuple[torch.Tensor, float]:
    """Mean / max load per GPU: per layer, and overall as sum of means / sum of maxima.

    The overall figure weighs layers by their slowest GPU, i.e. by the time they take.
    A layer with no load counts as perfectly balanced (1.0).

    Args:
        gpu_load: [L, P] float.
    Returns:
        per_layer: [L] float64.  overall: float.
    """
    g = gpu_load.to(torch.float64)
    mean, peak = g.mean(-1), g.amax(-1)
    per_layer = torch.where(peak > 0, mean / peak.clamp_min(torch.finfo(torch.float64).tiny), torch.ones_like(mean))
    total_peak = float(peak.sum())
    overall = float(mean.sum()) / total_peak if total_peak > 0 else 1.0
    return per_layer, overall

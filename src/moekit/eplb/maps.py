"""EPLB maps: logical <-> physical expert ids, and the routing-time replica choice.

Letters: T tokens, k experts per token, L layers, E logical experts, R physical slots,
M = R - E + 1 the fixed width of log2phy (the most replicas one expert can have), P ranks.

`map_to_physical` runs in every forward: tensor ops only, no host synchronisation and no
data-dependent shapes, so it can be captured in a CUDA graph. The rest runs at placement
time.
"""

from __future__ import annotations

from typing import Tuple

import torch

__all__ = [
    "map_to_physical",
    "initial_placement",
    "maps_from_phy2log",
    "physical_to_logical_load",
    "local_slots",
    "physical_expert_map",
]


def map_to_physical(topk_ids: torch.Tensor, log2phy: torch.Tensor, replica_count: torch.Tensor) -> torch.Tensor:
    """Logical ids -> physical slots: flattened slot f = t*k + j takes replica f mod count.

    Deterministic, and consecutive assignments of one expert alternate over its replicas.

    Args:
        topk_ids: [T, k] int logical expert ids.
        log2phy: [E, M] int64 slots of each expert (-1 padded), on topk_ids' device.
        replica_count: [E] int64 replicas per expert (>= 1), on topk_ids' device.
    Returns:
        [T, k] int32 physical slot ids.
    """
    T, k = topk_ids.shape
    ids = topk_ids.long()
    f = torch.arange(T * k, device=ids.device).view(T, k)
    replica = f % replica_count[ids]  # [T, k]
    return log2phy.reshape(-1)[ids * log2phy.shape[1] + replica].to(torch.int32)


def initial_placement(num_layers: int, num_logical: int, num_physical: int) -> torch.Tensor:
    """Placement before any load is known: slot i holds expert i mod E.

    Returns:
        phy2log: [L, R] int64.
    """
    if num_logical < 1:
        raise ValueError(f"num_logical must be >= 1, got {num_logical}")
    if num_physical < num_logical:
        raise ValueError(f"num_physical={num_physical} must be >= num_logical={num_logical}")
    return (torch.arange(num_physical) % num_logical).expand(num_layers, num_physical).clone()


def maps_from_phy2log(phy2log: torch.Tensor, num_logical: int, width: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Build log2phy and replica counts from a placement; replicas listed in slot order.

    Args:
        phy2log: [L, R] int64, every expert in [0, E) present at least once.
        num_logical: E.
        width: M, the padded width of log2phy (at least the largest replica count).
    Returns:
        log2phy: [L, E, M] int64 (-1 padded).  replica_count: [L, E] int64.
    """
    if phy2log.dim() != 2 or phy2log.is_floating_point():
        raise ValueError(f"phy2log must be a 2-D integer tensor [L, R], got {phy2log.dtype} {tuple(phy2log.shape)}")
    L, R = phy2log.shape
    p2l = phy2log.to("cpu", torch.int64)
    if p2l.numel() and (int(p2l.min()) < 0 or int(p2l.max()) >= num_logical):
        raise ValueError(f"phy2log entries must lie in [0, {num_logical}), got values outside")
    count = torch.zeros(L, num_logical, dtype=torch.int64).scatter_add_(-1, p2l, torch.ones_like(p2l))
    if bool((count == 0).any()):
        raise ValueError("phy2log must give every logical expert at least one slot, got an expert with none")
    if int(count.max()) > width:
        raise ValueError(f"width={width} is smaller than the largest replica count {int(count.max())}")
    order = torch.sort(p2l, dim=-1, stable=True).indices  # slots grouped by expert, slot order inside
    expert_sorted = p2l.gather(-1, order)
    start = count.cumsum(-1) - count  # [L, E] first sorted position of each expert
    rank_sorted = torch.arange(R).expand(L, R) - start.gather(-1, expert_sorted)
    log2phy = torch.full((L, num_logical * width), -1, dtype=torch.int64)
    log2phy.scatter_(-1, expert_sorted * width + rank_sorted, order)
    return log2phy.view(L, num_logical, width), count


def physical_to_logical_load(load: torch.Tensor, phy2log: torch.Tensor, num_logical: int) -> torch.Tensor:
    """Sum per-slot loads [L, R] into per-expert loads [L, E] (same dtype and device as load)."""
    if load.dim() != 2 or tuple(load.shape) != tuple(phy2log.shape):
        raise ValueError(f"load must be [L, R] like phy2log {tuple(phy2log.shape)}, got {tuple(load.shape)}")
    return load.new_zeros(load.shape[0], num_logical).scatter_add_(-1, phy2log.to(load.device), load)


def local_slots(num_physical: int, num_ranks: int, rank: int) -> range:
    """The physical slots rank `rank` holds: a contiguous block of R / P."""
    if num_physical % num_ranks:
        raise ValueError(f"the number of ranks {num_ranks} must divide the number of slots R={num_physical}")
    per_rank = num_physical // num_ranks
    return range(rank * per_rank, (rank + 1) * per_rank)


def physical_expert_map(num_physical: int, num_ranks: int, rank: int, device=None) -> torch.Tensor:
    """expert_map over physical slots for one rank: [R] int32, local slot id or -1."""
    slots = local_slots(num_physical, num_ranks, rank)
    emap = torch.full((num_physical,), -1, dtype=torch.int32, device=device)
    emap[slots.start:slots.stop] = torch.arange(len(slots), dtype=torch.int32, device=device)
    return emap

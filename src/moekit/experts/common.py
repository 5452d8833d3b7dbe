"""Small pure tensor helpers shared by the experts backends."""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["local_ids", "sort_by_expert", "combine_k"]


def local_ids(topk_ids: torch.Tensor, expert_map: Optional[torch.Tensor]) -> torch.Tensor:
    """Map ids [T, k] to local expert ids (int64); -1 where the expert lives elsewhere."""
    ids = topk_ids.long()
    if expert_map is None:
        return ids
    return expert_map.long()[ids]


def sort_by_expert(ids_flat: torch.Tensor, num_experts: int):
    """Stable sort of flattened assignments by local expert (non-local -1 ids go last).

    Args:
        ids_flat: [T*k] int64 local ids, -1 for non-local.
    Returns:
        order [T*k] int64 (assignment index of each sorted row), counts [E] int64.
    """
    key = torch.where(ids_flat < 0, torch.full_like(ids_flat, num_experts), ids_flat)
    key_sorted, order = torch.sort(key, stable=True)
    # Counts from the sorted keys: bincount would read the maximum back to the host (a sync
    # that breaks CUDA-graph capture).
    bounds = torch.arange(num_experts + 1, device=key.device, dtype=key.dtype)
    counts = torch.diff(torch.searchsorted(key_sorted, bounds))
    return order, counts


def combine_k(y_sorted: torch.Tensor, order: torch.Tensor, T: int, k: int) -> torch.Tensor:
    """Bring sorted per-assignment rows [T*k, H] home and sum over k in a fixed order.

    Deterministic (no atomics): rows are scattered to their assignment slot t*k + j, then
    summed over j. Returns [T, H] in y_sorted's dtype.
    """
    H = y_sorted.shape[-1]
    y_flat = torch.empty_like(y_sorted)
    y_flat[order] = y_sorted
    return y_flat.view(T, k, H).sum(dim=1)

"""Small pure tensor helpers shared by the experts backends."""

from __future__ import annotations

from typing import Callable, Optional

import torch

__all__ = ["local_ids", "sort_by_expert", "combine_k", "loop_over_experts"]


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


def loop_over_experts(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_map: Optional[torch.Tensor],
    num_experts: int,
    apply_router_weight_on_input: bool,
    expert_fn: Callable[[int, torch.Tensor], torch.Tensor],
    row_dtype: torch.dtype,
) -> torch.Tensor:
    """Sort assignments by expert, run expert_fn on each active expert's rows, weight, sum over k.

    For host-driven backends (CPU): the per-expert counts are read to the host once.

    Args:
        x: [T, H].  topk_weights: [T, k] fp32.  topk_ids: [T, k] int32.
        expert_map: [E_global] int32 or None.
        expert_fn: (e, rows [n, H] in row_dtype) -> [n, H] fp32, expert e's unweighted output.
        row_dtype: dtype of the rows handed to expert_fn (router weights on the input are
            applied in fp32 first).
    Returns:
        [T, H] fp32.
    """
    T, k = topk_ids.shape
    H = x.shape[1]
    order, counts = sort_by_expert(local_ids(topk_ids, expert_map).reshape(-1), num_experts)
    counts_list = counts.tolist()
    n_valid = sum(counts_list)
    w_sorted = topk_weights.reshape(-1)[order].float().unsqueeze(-1)  # [T*k, 1]
    x_sorted = x[order[:n_valid] // k]  # [n_valid, H]
    if apply_router_weight_on_input:
        x_sorted = x_sorted.float() * w_sorted[:n_valid]
    x_sorted = x_sorted.to(row_dtype)
    y_sorted = x.new_zeros((T * k, H), dtype=torch.float32)  # rows >= n_valid stay zero (non-local)
    start = 0
    for e, n in enumerate(counts_list):
        if n:
            y_sorted[start:start + n] = expert_fn(e, x_sorted[start:start + n])
            start += n
    if not apply_router_weight_on_input:
        y_sorted = y_sorted * w_sorted
    return combine_k(y_sorted, order, T, k)

"""`allgather_reducescatter`: every rank sees every token; a reduce-scatter sums the partials.

Dispatch: an all-gather of the token counts (one host read: it sizes the buffers), then
one all-gather of packed rows [x | routing weights | ids], each rank's block padded to
the largest count. Padding rows are zero tokens whose ids point at an expert this rank
does not hold and whose weights are 0, so every backend skips them. Each rank runs its
local experts on all P * T_max rows; combine reduce-scatters the [P * T_max, H] partial
outputs so that rank r receives the sum for its own block, and drops the padding.

Simple and robust (two collectives of fixed shape per direction), but every rank moves
and scans all tokens: P * T_max * row_bytes in, P * T_max * H * 4 out. all_to_all.py
moves only the (token, rank) pairs that are needed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Dispatched
from .config import ParallelConfig
from .ep_common import (ExpertParallelDispatcher, all_gather_single, check_no_grad, pack_rows, reduce_scatter_single,
                        unpack_rows)

__all__ = ["AllGatherReduceScatterDispatcher"]


@dataclass(frozen=True)
class AllGatherHandle:
    """What combine needs: this rank's T and the padded block size T_max."""

    num_tokens: int
    block_tokens: int


class AllGatherReduceScatterDispatcher(ExpertParallelDispatcher):
    """All-gather dispatch, reduce-scatter combine (see the module docstring)."""

    name = "allgather_reducescatter"

    def __init__(self, parallel: ParallelConfig, num_experts: int, top_k: int, kernels: str = "auto",
                 kernel_config=None) -> None:
        if kernels == "triton" or kernel_config is not None:
            raise ValueError(
                "allgather_reducescatter has no Triton kernels (its packing is a few whole-tensor copies), got "
                f"kernels={kernels!r}, kernel_config={kernel_config!r}; leave them at 'auto' and None")
        super().__init__(parallel, num_experts, top_k, kernels)

    def dispatch(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> Dispatched:
        """x [T, H], topk_weights [T, k] fp32, topk_ids [T, k] global ids -> all ranks' tokens [P*T_max, ..]."""
        check_no_grad(x, "x")
        check_no_grad(topk_weights, "topk_weights (the routing weights: a trainable gate or router)")
        T, H = x.shape
        k, P = topk_ids.shape[1], self.size
        _, emap = self.tables(x.device)
        counts = torch.empty(P, dtype=torch.int64, device=x.device)
        all_gather_single(counts, torch.full((1,), T, dtype=torch.int64, device=x.device), group=self.group)
        T_max = max(counts.tolist())  # the one host sync
        layout = self.layout(H, x.dtype, k)
        zeros = torch.zeros((T_max - T, layout.row_bytes), dtype=torch.uint8, device=x.device)
        block = pack_rows(x, topk_weights, topk_ids, layout, tail=zeros)  # [T_max, B]
        rows = torch.empty((P * T_max, layout.row_bytes), dtype=torch.uint8, device=x.device)
        all_gather_single(rows, block, group=self.group)
        x_all, w_all, ids_all = unpack_rows(rows, layout)  # [P*T_max, H], [P*T_max, k], [P*T_max, k]
        # Padding rows are zero bytes (weight 0); pointing their ids at a foreign expert lets backends skip them.
        valid = (torch.arange(T_max, device=x.device) < counts.unsqueeze(1)).reshape(P * T_max, 1)
        ids_all = torch.where(valid, ids_all, self.pad_id)
        return Dispatched(x_all, w_all, ids_all, emap, AllGatherHandle(T, T_max))

    def combine(self, y: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        """y [P*T_max, H] weighted partial outputs -> [T, H] fp32 for this rank's tokens."""
        check_no_grad(y, "the experts' output")
        h: AllGatherHandle = dispatched.handle
        out = torch.empty((h.block_tokens, y.shape[1]), dtype=torch.float32, device=y.device)
        reduce_scatter_single(out, y.float().contiguous(), group=self.group)
        return out[:h.num_tokens]

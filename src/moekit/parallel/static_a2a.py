"""`static_all_to_all`: the decode path. Fixed-capacity buffers, no host synchronisation.

Every (source rank, destination rank) pair owns a block of C = max_tokens_per_rank rows,
so dispatch and combine are each ONE all_to_all_single with equal split sizes and static
shapes: nothing is read back to the host, and a decode step (router, dispatch, experts,
combine) can be captured in a CUDA graph and replayed.

Capacity and overflow. A token goes at most once to each rank, so a rank never sends
more than T rows to one destination; with T <= C no block can overflow, whatever the
routing. The only possible overflow is a rank passing more than C tokens, which the
host sees from the (static) shape of x: dispatch raises ValueError before any
communication, naming max_tokens_per_rank. Nothing is ever dropped. (The ranks that did
not overflow then wait in their collective until the process group's own timeout ends
them, as with any collective a rank leaves.)

Empty slots carry padding rows: zero tokens with weights 0 whose ids all point at an
expert the destination rank does not hold, so every experts backend skips them and the
receiver needs no extra work.

Trade-off against `all_to_all` (the dynamic path):
  + no count exchange and no host sync (the dynamic path pays an extra small collective
    and a device-to-host read per call, about 60 us on two H200s);
  + static shapes: CUDA graphs and torch.compile can take the whole step;
  - it always moves P * C * row_bytes out and P * C * H * 4 bytes back per rank, however
    few tokens are routed, and the experts scan P * C rows, most of them empty when T is
    far below C: use it for decode (small C), keep the dynamic path for prefill;
  - buffers of P * C * (row_bytes + 4 H) bytes per call are allocated (from the graph's
    private pool when captured).
The tables it reads (owner, expert_map) are copied to the device on the first call:
run one step before capturing.

On CUDA the per-token passes are ep_kernels.py's Triton kernels (plan, pack with the
padding rows, combine: three launches, graph-capturable); the torch path is the reference
they match bit for bit. With no host read, this path cannot report topk_ids outside
[0, E) as the dynamic one does: the torch path's indexing fails on them, the Triton plan
sends such an id nowhere. They come from a broken router or custom routing function.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from .base import Dispatched
from .config import ParallelConfig
from .ep_common import (ExpertParallelDispatcher, check_no_grad, combine_rows, destination_mask, pack_rows,
                        padding_rows, row_sources, send_rows, sum_partials, unpack_rows)
from .placement import non_local_expert

__all__ = ["StaticAllToAllDispatcher"]


@dataclass(frozen=True)
class StaticHandle:
    """What combine needs: this rank's T and where each token's partials come back: rows [C, T]
    (trash row P*cap) on the torch path, the plan's meta buffer (ep_kernels) on the Triton path."""

    num_tokens: int
    rows: Optional[torch.Tensor] = None
    meta: Optional[torch.Tensor] = None


class StaticAllToAllDispatcher(ExpertParallelDispatcher):
    """Fixed-capacity all_to_all without host sync (see the module docstring)."""

    name = "static_all_to_all"
    graph_safe = True

    def __init__(self, parallel: ParallelConfig, num_experts: int, top_k: int, kernels: str = "auto",
                 kernel_config=None) -> None:
        super().__init__(parallel, num_experts, top_k, kernels, kernel_config)
        if parallel.max_tokens_per_rank is None:
            raise ValueError("static_all_to_all needs ParallelConfig.max_tokens_per_rank, got None")
        self.capacity = parallel.max_tokens_per_rank
        # padding id for each destination rank: an expert that rank does not hold
        self._pad_ids_cpu = torch.tensor(
            [non_local_expert(num_experts, self.size, r, parallel.placement) for r in range(self.size)],
            dtype=torch.int32)

    def dispatch(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> Dispatched:
        """x [T, H] (T <= capacity), topk_weights [T, k] fp32, topk_ids [T, k] -> [P*cap, ..] rows to compute here."""
        check_no_grad(x, "x")
        check_no_grad(topk_weights, "topk_weights (the routing weights: a trainable gate or router)")
        T, H = x.shape
        k, P, C = topk_ids.shape[1], self.size, self.capacity
        if T > C:
            raise ValueError(
                f"static_all_to_all: this rank got {T} tokens, more than its capacity "
                f"max_tokens_per_rank={C}; raise max_tokens_per_rank or use the 'all_to_all' dispatcher"
            )
        device = x.device
        owner, emap = self.tables(device)
        layout = self.layout(H, x.dtype, k)
        kern = self.triton_for(x)
        if kern is not None:
            pad_ids = self.cached(("pad_ids", device), lambda: self._pad_ids_cpu.to(device))  # [P]
            meta = torch.empty(kern.meta_size(P, T), dtype=torch.int32, device=device)
            kern.plan(topk_ids, owner, P, meta, self._kernel_config)
            send = torch.empty((P * C, layout.row_bytes), dtype=torch.uint8, device=device)
            kern.pack(x, topk_weights, topk_ids, meta, layout, send, P, C, pad_ids, self._kernel_config)
            handle = StaticHandle(T, meta=meta)
        else:
            pad = self.cached(("pad", device, x.dtype, H, k),
                              lambda: padding_rows(layout, self._pad_ids_cpu.to(device)))  # [P, B]
            # slot i of block r keeps padding row T + r unless a token is written there; the trash slot too
            block = self.cached(("block", device),
                                lambda: torch.arange(P * C + 1, device=device).floor_divide(C).clamp(max=P - 1))
            mask_PT = destination_mask(topk_ids, owner, P)  # [P, T]
            rows_PT = send_rows(mask_PT, C, trash=P * C)  # [P, T]
            src = row_sources(rows_PT, block + T)  # [P*C]
            send = pack_rows(x, topk_weights, topk_ids, layout, tail=pad)[src]  # [P*C, B]
            handle = StaticHandle(T, rows=combine_rows(rows_PT, k))
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)
        x_r, w_r, ids_r = unpack_rows(recv, layout)  # [P*C, H], [P*C, k], [P*C, k]
        return Dispatched(x_r, w_r, ids_r, emap, handle)

    def combine(self, y: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        """y [P*cap, H] weighted partial outputs -> [T, H] fp32 for this rank's tokens."""
        check_no_grad(y, "the experts' output")
        h: StaticHandle = dispatched.handle
        n, H = self.size * self.capacity, y.shape[1]
        y = y.float().contiguous()
        if h.meta is not None:
            back = torch.empty((n, H), dtype=torch.float32, device=y.device)
            dist.all_to_all_single(back, y, group=self.group)
            out = torch.empty((h.num_tokens, H), dtype=torch.float32, device=y.device)
            self._triton.combine(back, h.meta, self.size, self.capacity, out, self._kernel_config)
            return out
        back = torch.empty((n + 1, H), dtype=torch.float32, device=y.device)
        back[n].zero_()  # the trash row padding entries read
        dist.all_to_all_single(back[:n], y, group=self.group)
        return sum_partials(back, h.rows)

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

Rows carry a flag column: filled slots have flag 1; empty slots are zero bytes (flag 0)
and the receiver turns them into zero tokens whose ids point at an expert it does not
hold and whose weights are 0, so every experts backend skips them.

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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .base import Dispatched
from .config import ParallelConfig
from .ep_common import (ExpertParallelDispatcher, RowLayout, destinations, gather_sources, pack_meta, pack_rows,
                        send_slots, sum_partials, unpack_rows)

__all__ = ["StaticAllToAllDispatcher"]


@dataclass(frozen=True)
class StaticHandle:
    """What combine needs: slots [T, C_copies] rows per (token, destination), trash row P*C for padding."""

    slots: torch.Tensor


class StaticAllToAllDispatcher(ExpertParallelDispatcher):
    """Fixed-capacity all_to_all without host sync (see the module docstring)."""

    name = "static_all_to_all"

    def __init__(self, parallel: ParallelConfig, num_experts: int, top_k: int) -> None:
        super().__init__(parallel, num_experts, top_k)
        if parallel.max_tokens_per_rank is None:
            raise ValueError("static_all_to_all needs ParallelConfig.max_tokens_per_rank, got None")
        self.capacity = parallel.max_tokens_per_rank

    def dispatch(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> Dispatched:
        """x [T, H] (T <= capacity), topk_weights [T, k] fp32, topk_ids [T, k] -> [P*C, ..] rows to compute here."""
        T, H = x.shape
        k = topk_ids.shape[1]
        P, C = self.size, self.capacity
        if T > C:
            raise ValueError(
                f"static_all_to_all: this rank got {T} tokens, more than its capacity "
                f"max_tokens_per_rank={C}; raise max_tokens_per_rank or use the 'all_to_all' dispatcher"
            )
        owner, emap = self.tables(x.device)
        mask, dest = destinations(topk_ids, owner, P)  # [T, P], [T, Cc]
        block_start = torch.arange(P, device=x.device) * C  # [P]
        slots = send_slots(mask, dest, block_start, trash=P * C)  # [T, Cc]
        layout = RowLayout(H, x.dtype, 2 * k + 1)
        flag = torch.ones(T, dtype=torch.int32, device=x.device)
        packed = pack_rows(x, pack_meta(topk_weights, topk_ids, flag), layout, extra_rows=1)  # [T+1, B], row T zero
        send = packed[gather_sources(slots, P * C, fill=T)]  # [P*C, B]; empty slots copy the zero row
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)
        x_r, meta = unpack_rows(recv, layout)  # [P*C, H], [P*C, 2k+1]
        valid = meta[:, 2 * k:] == 1  # [P*C, 1]
        w_r = torch.where(valid, meta[:, :k].view(torch.float32), 0.0)
        ids_r = torch.where(valid, meta[:, k:2 * k], self.pad_id)
        return Dispatched(x_r, w_r, ids_r, emap, StaticHandle(slots))

    def combine(self, y: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        """y [P*C, H] weighted partial outputs -> [T, H] fp32 for this rank's tokens."""
        slots = dispatched.handle.slots
        n = self.size * self.capacity
        back = torch.empty((n + 1, y.shape[1]), dtype=torch.float32, device=y.device)
        back[n].zero_()  # the trash row padding slots read
        dist.all_to_all_single(back[:n], y.float().contiguous(), group=self.group)
        return sum_partials(back, slots)

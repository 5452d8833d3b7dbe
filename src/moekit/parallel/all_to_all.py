"""`all_to_all`: send each token once to every rank that holds any of its experts.

Dispatch (per call):
  1. destination ranks of each token from the placement (at most C = min(P, k) per token);
  2. all_to_all_single of the per-rank counts, then ONE host read of the counts (the only
     host synchronisation of this path; it sizes the receive buffer);
  3. rows [x | routing weights | ids] packed, ordered by destination rank then token, and
     sent with one all_to_all_single with per-rank split sizes.
Receivers run their local experts on every received token (the expert_map turns the ids
of experts held elsewhere into -1, which every backend skips) and return the weighted
partial sums; combine sends them back with the reversed split sizes and sums each
token's partials in destination order (deterministic).

Bytes per rank and call: N_send * row_bytes out, N_send * H * 4 back, where N_send is
the number of (token, destination rank) pairs. Not CUDA-graph capturable (data-dependent
sizes): static_a2a.py is the capturable path for decode.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List

import torch
import torch.distributed as dist

from .base import Dispatched
from .ep_common import (ExpertParallelDispatcher, RowLayout, destinations, gather_sources, pack_meta, pack_rows,
                        send_slots, sum_partials, unpack_rows)

__all__ = ["AllToAllDispatcher"]


@dataclass(frozen=True)
class AllToAllHandle:
    """What combine needs from dispatch: slots [T, C] (send row per token and destination,
    trash row n_send for padding), the split sizes of both directions, and T."""

    slots: torch.Tensor
    send_counts: List[int]
    recv_counts: List[int]
    num_tokens: int


class AllToAllDispatcher(ExpertParallelDispatcher):
    """Dynamic all_to_all_single dispatch with per-rank counts (see the module docstring)."""

    name = "all_to_all"

    def dispatch(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> Dispatched:
        """x [T, H], topk_weights [T, k] fp32, topk_ids [T, k] global ids -> tokens to compute here."""
        T, H = x.shape
        k = topk_ids.shape[1]
        P = self.size
        owner, emap = self.tables(x.device)
        mask, dest = destinations(topk_ids, owner, P)  # [T, P], [T, C]
        send_counts = mask.sum(dim=0)  # [P] int64
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        counts = torch.cat((send_counts, recv_counts)).tolist()  # the one host sync
        send_list, recv_list = counts[:P], counts[P:]
        n_send, n_recv = sum(send_list), sum(recv_list)
        block_start = torch.cumsum(send_counts, dim=0) - send_counts  # [P]
        slots = send_slots(mask, dest, block_start, trash=n_send)  # [T, C]
        layout = RowLayout(H, x.dtype, 2 * k)
        packed = pack_rows(x, pack_meta(topk_weights, topk_ids), layout)  # [T, B]
        send = packed[gather_sources(slots, n_send, fill=0)]  # [n_send, B] grouped by destination
        recv = torch.empty((n_recv, layout.row_bytes), dtype=torch.uint8, device=x.device)
        dist.all_to_all_single(recv, send, recv_list, send_list, group=self.group)
        x_r, meta = unpack_rows(recv, layout)  # [n_recv, H], [n_recv, 2k]
        handle = AllToAllHandle(slots, send_list, recv_list, T)
        return Dispatched(x_r, meta[:, :k].view(torch.float32), meta[:, k:], emap, handle)

    def combine(self, y: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        """y [n_recv, H] weighted partial outputs -> [T, H] fp32 for this rank's tokens."""
        h: AllToAllHandle = dispatched.handle
        H = y.shape[1]
        n_send = sum(h.send_counts)
        back = torch.empty((n_send + 1, H), dtype=torch.float32, device=y.device)
        back[n_send].zero_()  # the trash row padding slots read
        dist.all_to_all_single(back[:n_send], y.float().contiguous(), h.send_counts, h.recv_counts, group=self.group)
        return sum_partials(back, h.slots)  # [T, H]

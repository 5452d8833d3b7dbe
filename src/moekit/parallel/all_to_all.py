"""`all_to_all`: send each token once to every rank that holds any of its experts.

Dispatch (per call):
  1. the destination ranks of each token, from the placement: a [P, T] mask;
  2. all_to_all_single of the per-rank counts, then ONE host read of the counts (the only
     host synchronisation of this path; it sizes the buffers);
  3. rows [x | routing weights | ids] packed, ordered by destination rank then token, and
     sent with one all_to_all_single with per-rank split sizes.
Receivers run their local experts on every received token (the expert_map turns the ids
of experts held elsewhere into -1, which every backend skips) and return the weighted
partial sums; combine sends them back with the reversed split sizes and sums each
token's partials in destination order (deterministic).

Bytes per rank and call: N_send * row_bytes out, N_send * H * 4 back, N_send being the
number of (token, destination rank) pairs. Not CUDA-graph capturable (data-dependent
sizes): static_a2a.py is the capturable path for decode.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List

import torch
import torch.distributed as dist

from .base import Dispatched
from .ep_common import (ExpertParallelDispatcher, RowLayout, check_no_grad, combine_rows, destination_mask, pack_rows,
                        row_sources, send_rows, sum_partials, unpack_rows)

__all__ = ["AllToAllDispatcher"]


@dataclass(frozen=True)
class AllToAllHandle:
    """What combine needs from dispatch: rows [C, T] (the returned row of each token's
    partial per destination, trash row n_send for padding) and both directions' split sizes."""

    rows: torch.Tensor
    send_counts: List[int]
    recv_counts: List[int]


class AllToAllDispatcher(ExpertParallelDispatcher):
    """Dynamic all_to_all_single dispatch with per-rank counts (see the module docstring)."""

    name = "all_to_all"

    def dispatch(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> Dispatched:
        """x [T, H], topk_weights [T, k] fp32, topk_ids [T, k] global ids -> tokens to compute here."""
        check_no_grad(x, "x")
        H, k, P = x.shape[1], topk_ids.shape[1], self.size
        owner, emap = self.tables(x.device)
        layout = RowLayout(H, x.dtype, k)
        mask_PT = destination_mask(topk_ids, owner, P)  # [P, T]
        send_counts = mask_PT.sum(dim=1)  # [P]
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        packed = pack_rows(x, topk_weights, topk_ids, layout)  # [T, B], queued before the host waits
        counts = torch.cat((send_counts, recv_counts)).tolist()  # the one host sync
        send_list, recv_list = counts[:P], counts[P:]
        n_send, n_recv = sum(send_list), sum(recv_list)
        rows_PT = send_rows(mask_PT, None, trash=n_send)  # [P, T]
        # every row < n_send is written by exactly one pair, so the fill may stay uninitialised
        src = row_sources(rows_PT, torch.empty(n_send + 1, dtype=torch.int64, device=x.device))
        recv = torch.empty((n_recv, layout.row_bytes), dtype=torch.uint8, device=x.device)
        dist.all_to_all_single(recv, packed[src], recv_list, send_list, group=self.group)
        x_r, w_r, ids_r = unpack_rows(recv, layout)  # [n_recv, H], [n_recv, k], [n_recv, k]
        return Dispatched(x_r, w_r, ids_r, emap, AllToAllHandle(combine_rows(rows_PT, k), send_list, recv_list))

    def combine(self, y: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        """y [n_recv, H] weighted partial outputs -> [T, H] fp32 for this rank's tokens."""
        check_no_grad(y, "the experts' output")
        h: AllToAllHandle = dispatched.handle
        n_send = sum(h.send_counts)
        back = torch.empty((n_send + 1, y.shape[1]), dtype=torch.float32, device=y.device)
        back[n_send].zero_()  # the trash row padding entries read
        dist.all_to_all_single(back[:n_send], y.float().contiguous(), h.send_counts, h.recv_counts, group=self.group)
        return sum_partials(back, h.rows)  # [T, H]

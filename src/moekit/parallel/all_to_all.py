"""`all_to_all`: send each token once to every rank that holds any of its experts.

Dispatch (per call):
  1. the destination ranks of each token, from the placement, and the rows per rank;
  2. an all_to_all_single of (rows, bad ids) per rank, started asynchronously; the send
     rows [x | routing weights | ids], ordered by destination rank then token, are packed
     while it runs (their places depend on this rank's routing only);
  3. ONE host read of the exchanged counts (the only host synchronisation of this path; it
     sizes the buffers), then one all_to_all_single of the rows with per-rank split sizes.
The count exchange also carries whether each rank has tokens after this round, so the
runner's chunk loop needs no collective of its own (rounds_in_dispatch), and whether a rank
refused the call before dispatching (refuse): then every rank raises, none waits.
Receivers run their local experts on every received token (the expert_map turns the ids
of experts held elsewhere into -1, which every backend skips) and return the weighted
partial sums; combine sends them back with the reversed split sizes and sums each
token's partials in destination order, from zero (deterministic).

On CUDA the per-token passes are three Triton launches (plan, pack, combine: ep_kernels.py);
the torch path (CPU, or kernels="torch") is the reference they match bit for bit.

Bytes per rank and call: N_send * row_bytes out, N_send * H * 4 back, N_send being the
number of (token, destination rank) pairs. Not CUDA-graph capturable (data-dependent
sizes): static_a2a.py is the capturable path for decode.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.distributed as dist

from .base import Dispatched
from .ep_common import (MORE_ROUNDS, REFUSED, ExpertParallelDispatcher, check_no_grad, combine_rows, destination_mask,
                        pack_rows, read_exchange, row_sources, send_rows, sum_partials, unpack_rows)

__all__ = ["AllToAllDispatcher"]


@dataclass(frozen=True)
class AllToAllHandle:
    """What combine needs from dispatch: both directions' split sizes, this rank's T, and where
    each token's partials come back: rows [C, T] (trash row n_send) on the torch path, the
    plan's meta buffer (ep_kernels) on the Triton path."""

    send_counts: List[int]
    recv_counts: List[int]
    num_tokens: int
    rows: Optional[torch.Tensor] = None
    meta: Optional[torch.Tensor] = None


class AllToAllDispatcher(ExpertParallelDispatcher):
    """Dynamic all_to_all_single dispatch with per-rank counts (see the module docstring)."""

    name = "all_to_all"

    @property
    def rounds_in_dispatch(self) -> bool:
        """Without max_tokens_per_rank the count exchange agrees on the rounds (module docstring)."""
        return self.max_tokens_per_rank is None

    def dispatch(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                 more: bool = False) -> Dispatched:
        """x [T, H], topk_weights [T, k] fp32, topk_ids [T, k] global ids -> tokens to compute here.

        more: this rank has tokens after these (Dispatched.more_rounds tells whether any rank has).
        """
        check_no_grad(x, "x")
        check_no_grad(topk_weights, "topk_weights (the routing weights: a trainable gate or router)")
        T, H = x.shape
        k, P, E = topk_ids.shape[1], self.size, self.num_experts
        if T * k >= MORE_ROUNDS:
            raise ValueError(f"all_to_all dispatches fewer than {MORE_ROUNDS} assignments a call, got T*k={T * k} "
                             "(lower the runner's chunk size, MOEKIT_CHUNK_SIZE)")
        flag = MORE_ROUNDS if more else 0
        owner, emap = self.tables(x.device)
        layout = self.layout(H, x.dtype, k)
        kern = self.triton_for(x)
        if kern is not None:
            meta = torch.empty(kern.meta_size(P, T), dtype=torch.int32, device=x.device)
            kern.plan(topk_ids, owner, P, meta, self._kernel_config)
            if flag:
                meta[1:2 * P:2] += flag  # (rows, status) per destination
            exchange = dist.all_to_all_single(meta[2 * P:4 * P], meta[:2 * P], group=self.group, async_op=True)
            send = torch.empty((min(P, k) * T, layout.row_bytes), dtype=torch.uint8, device=x.device)
            kern.pack(x, topk_weights, topk_ids, meta, layout, send, P, 0, None, self._kernel_config)
            exchange.wait()
            send_list, recv_list, more_rounds = read_exchange(meta[:4 * P].tolist(), P, E)  # the one host sync
            send, rows = send[:sum(send_list)], None
        else:
            outside = (topk_ids < 0) | (topk_ids >= E)  # [T, k]
            mask_PT = destination_mask(topk_ids.masked_fill(outside, 0), owner, P)  # [P, T]
            counts = torch.stack((mask_PT.sum(dim=1), outside.sum().expand(P) + flag), 1).reshape(2 * P)  # (rows, status)
            info = torch.cat((counts, counts))  # the exchange overwrites the second half
            exchange = dist.all_to_all_single(info[2 * P:], info[:2 * P], group=self.group, async_op=True)
            packed = pack_rows(x, topk_weights, topk_ids, layout)  # [T, B], queued before the host waits
            exchange.wait()
            send_list, recv_list, more_rounds = read_exchange(info.tolist(), P, E)  # the one host sync
            n_send = sum(send_list)
            rows_PT = send_rows(mask_PT, None, trash=n_send)  # [P, T]
            # every row < n_send is written by exactly one pair, so the fill may stay uninitialised
            send = packed[row_sources(rows_PT, torch.empty(n_send + 1, dtype=torch.int64, device=x.device))]
            rows, meta = combine_rows(rows_PT, k), None  # [C, T]
        recv = torch.empty((sum(recv_list), layout.row_bytes), dtype=torch.uint8, device=x.device)
        dist.all_to_all_single(recv, send, recv_list, send_list, group=self.group)
        x_r, w_r, ids_r = unpack_rows(recv, layout)  # [n_recv, H], [n_recv, k], [n_recv, k]
        return Dispatched(x_r, w_r, ids_r, emap, AllToAllHandle(send_list, recv_list, T, rows, meta), more_rounds)

    def refuse(self, x: torch.Tensor) -> None:
        """Send every rank status REFUSED and no rows in this round's count exchange, in the
        dtype the others use (int32 on the Triton path, int64 on the torch path)."""
        P = self.size
        dtype = torch.int32 if self.triton_for(x) is not None else torch.int64
        info = torch.full((4 * P,), REFUSED, dtype=dtype, device=x.device)
        info[:2 * P:2] = 0  # (rows, status) per destination
        dist.all_to_all_single(info[2 * P:], info[:2 * P], group=self.group)

    def combine(self, y: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        """y [n_recv, H] weighted partial outputs -> [T, H] fp32 for this rank's tokens."""
        check_no_grad(y, "the experts' output")
        h: AllToAllHandle = dispatched.handle
        n_send, H = sum(h.send_counts), y.shape[1]
        y = y.float().contiguous()
        if h.meta is not None:
            back = torch.empty((n_send, H), dtype=torch.float32, device=y.device)
            dist.all_to_all_single(back, y, h.send_counts, h.recv_counts, group=self.group)
            out = torch.empty((h.num_tokens, H), dtype=torch.float32, device=y.device)
            self._triton.combine(back, h.meta, self.size, 0, out, self._kernel_config)
            return out
        back = torch.empty((n_send + 1, H), dtype=torch.float32, device=y.device)
        back[n_send].zero_()  # the trash row padding entries read
        dist.all_to_all_single(back[:n_send], y, h.send_counts, h.recv_counts, group=self.group)
        return sum_partials(back, h.rows)  # [T, H]

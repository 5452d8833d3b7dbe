"""What the expert-parallel dispatchers share: placement state, row packing, destination math.

Packing: a token travels as one row of bytes [x (H values) | pad to 4 | weights (k fp32)
| ids (k int32) | pad to 16], so dispatch moves hidden states, routing weights and ids in
one collective instead of three. Receivers read them as views of the received bytes.

Destinations: a token goes once to each rank holding any of its k experts. Pairs
(rank r, token t) are indexed as [P, T]; rows_PT[r, t] is the send-buffer row of the pair
(a "trash" row past the used ones when t does not go to r). Combine keeps, per token,
C = min(P, k) rows [C, T] in increasing rank order and sums the partials in that order,
so the result does not depend on timing (no atomics).

Every helper is a few whole-tensor ops: eager GPU calls are bound by per-op launch cost.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
import torch.distributed as dist

from .base import Dispatcher
from .config import ParallelConfig
from .placement import expert_map, expert_owner, non_local_expert

__all__ = [
    "ExpertParallelDispatcher",
    "RowLayout",
    "pack_rows",
    "padding_rows",
    "unpack_rows",
    "destination_mask",
    "send_rows",
    "row_sources",
    "combine_rows",
    "sum_partials",
    "all_gather_single",
    "reduce_scatter_single",
    "check_no_grad",
]

# torch >= 2.13 renames the single-tensor collectives; older releases only have the old names.
# (Both are None on torch builds without distributed support.)
all_gather_single = getattr(dist, "all_gather_single", None) or getattr(dist, "all_gather_into_tensor", None)
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or getattr(dist, "reduce_scatter_tensor", None)


def check_no_grad(t: torch.Tensor, name: str) -> None:
    """Collectives carry no gradients: refuse, rather than silently drop them, when autograd records."""
    if torch.is_grad_enabled() and t.requires_grad:
        raise ValueError(
            f"{name} requires grad, but parallel layers are inference-only (their collectives carry no "
            "gradients); call the layer under torch.no_grad() or torch.inference_mode()"
        )


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


class RowLayout:
    """Byte layout of one packed row: x [H] of `dtype`, then k fp32 weights and k int32 ids."""

    def __init__(self, hidden_size: int, dtype: torch.dtype, top_k: int) -> None:
        self.hidden_size, self.dtype, self.top_k = hidden_size, dtype, top_k
        self.x_bytes = hidden_size * dtype.itemsize
        self.w_offset = _round_up(self.x_bytes, 4)
        self.ids_offset = self.w_offset + 4 * top_k
        self.row_bytes = _round_up(self.ids_offset + 4 * top_k, 16)


def pack_rows(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, layout: RowLayout,
              tail: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Pack tokens into rows of bytes.

    Args:
        x: [T, H].  topk_weights: [T, k] fp32.  topk_ids: [T, k] int32.
        tail: [n, row_bytes] uint8 rows appended as they are (padding rows), or None.
    Returns:
        [T (+ n), row_bytes] uint8.
    """
    T = x.shape[0]
    n = 0 if tail is None else tail.shape[0]
    out = torch.empty((T + n, layout.row_bytes), dtype=torch.uint8, device=x.device)
    k = layout.top_k
    out[:T, :layout.x_bytes] = x.contiguous().view(torch.uint8)
    out[:T, layout.w_offset:layout.w_offset + 4 * k] = topk_weights.float().contiguous().view(torch.uint8)
    out[:T, layout.ids_offset:layout.ids_offset + 4 * k] = topk_ids.to(torch.int32).contiguous().view(torch.uint8)
    if n:
        out[T:] = tail
    return out


def padding_rows(layout: RowLayout, ids: torch.Tensor) -> torch.Tensor:
    """Rows of zero tokens with weights 0 and every id set to ids[i] ([n] int32): [n, row_bytes] uint8."""
    n = ids.shape[0]
    x = torch.zeros((n, layout.hidden_size), dtype=layout.dtype, device=ids.device)
    w = torch.zeros((n, layout.top_k), dtype=torch.float32, device=ids.device)
    return pack_rows(x, w, ids.to(torch.int32).unsqueeze(1).expand(n, layout.top_k), layout)


def unpack_rows(rows: torch.Tensor, layout: RowLayout) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Views of packed rows [N, row_bytes]: x [N, H], weights [N, k] fp32, ids [N, k] int32."""
    k = layout.top_k
    x = rows[:, :layout.x_bytes].view(layout.dtype)
    w = rows[:, layout.w_offset:layout.w_offset + 4 * k].view(torch.float32)
    ids = rows[:, layout.ids_offset:layout.ids_offset + 4 * k].view(torch.int32)
    return x, w, ids


def destination_mask(topk_ids: torch.Tensor, owner: torch.Tensor, num_ranks: int) -> torch.Tensor:
    """Which ranks each token goes to (once per rank, however many of its experts live there).

    Args:
        topk_ids: [T, k] global expert ids.  owner: [E] int64 rank of each expert.
    Returns:
        [P, T] bool: token t goes to rank r.
    """
    mask_PT = torch.zeros((num_ranks, topk_ids.shape[0]), dtype=torch.bool, device=topk_ids.device)
    return mask_PT.scatter_(0, owner[topk_ids.t()], True)  # owner[ids^T]: [k, T] ranks


def send_rows(mask_PT: torch.Tensor, capacity: Optional[int], trash: int) -> torch.Tensor:
    """Send-buffer row of each (rank, token) pair; tokens keep their order within a rank's block.

    Args:
        mask_PT: [P, T] bool.
        capacity: None packs the blocks back to back (rank r's block starts after the
            rows of ranks < r); an int C gives rank r the fixed block [r*C, (r+1)*C).
        trash: the row given to pairs that are not sent.
    Returns:
        [P, T] int64.
    """
    P, T = mask_PT.shape
    if capacity is None:
        rows = mask_PT.reshape(-1).cumsum(0).view(P, T) - 1  # r-major running count = packed row
    else:
        start = torch.arange(P, device=mask_PT.device).unsqueeze(1) * capacity - 1  # [P, 1]
        rows = mask_PT.cumsum(1) + start
    return torch.where(mask_PT, rows, trash)


def row_sources(rows_PT: torch.Tensor, fill: torch.Tensor) -> torch.Tensor:
    """Invert send_rows: the token each send row carries.

    Args:
        rows_PT: [P, T] rows in [0, N] (N = the trash row).
        fill: [N + 1] int64, overwritten: rows no pair writes keep their value (a padding row index).
    Returns:
        [N] int64, a view of fill.
    """
    P, T = rows_PT.shape
    tokens = torch.arange(T, device=rows_PT.device).expand(P, T)
    # Only unsent pairs share an index (the trash row), so which write wins there does not matter.
    return fill.scatter_(0, rows_PT.reshape(-1), tokens.reshape(-1))[:-1]


def combine_rows(rows_PT: torch.Tensor, top_k: int) -> torch.Tensor:
    """Per token, the rows of its C = min(P, k) destinations in increasing rank order.

    Valid rows of one token increase with the rank and the trash row is the largest
    index, so the C smallest rows per token are its destinations, padded with trash.
    Returns:
        [C, T] int64.
    """
    P = rows_PT.shape[0]
    if P <= top_k:
        return rows_PT
    return torch.topk(rows_PT, top_k, dim=0, largest=False, sorted=True).values


def sum_partials(back: torch.Tensor, rows_CT: torch.Tensor) -> torch.Tensor:
    """Sum each token's partial outputs in destination order (a gather, then a fixed-order sum).

    Args:
        back: [N + 1, H] fp32 rows as returned, the last row zero (the trash row).
        rows_CT: [C, T] rows per (destination, token), N for no destination.
    Returns:
        [T, H] fp32.
    """
    return back[rows_CT].sum(dim=0)


class ExpertParallelDispatcher(Dispatcher):
    """Base of the expert-parallel dispatchers: group, placement and per-device index tensors.

    Args:
        parallel: ParallelConfig with ep_size >= 2.
        num_experts: E global experts (physical slots when EPLB adds replicas).
        top_k: k.
    """

    def __init__(self, parallel: ParallelConfig, num_experts: int, top_k: int) -> None:
        if parallel.ep_size < 2:
            raise ValueError(f"{type(self).__name__} needs ep_size >= 2, got ep_size={parallel.ep_size}")
        self.parallel = parallel
        self.group = parallel.group
        self.rank, self.size = parallel.ep_rank, parallel.ep_size
        self.num_experts, self.top_k = num_experts, top_k
        self.max_tokens_per_rank = parallel.max_tokens_per_rank
        self._owner_cpu = expert_owner(num_experts, self.size, parallel.placement)  # [E] int64
        self._map_cpu = expert_map(num_experts, self.size, self.rank, parallel.placement)  # [E] int32
        self.pad_id = non_local_expert(num_experts, self.size, self.rank, parallel.placement)
        self._cache: Dict[tuple, torch.Tensor] = {}

    def cached(self, key: tuple, make) -> torch.Tensor:
        """A constant tensor made once per key (device, dtype, ...).

        The first call on a device copies tables from the host: make it before a CUDA graph capture.
        """
        if key not in self._cache:
            self._cache[key] = make()
        return self._cache[key]

    def tables(self, device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
        """(owner [E] int64, expert_map [E] int32) on `device`."""
        return (self.cached(("owner", device), lambda: self._owner_cpu.to(device)),
                self.cached(("map", device), lambda: self._map_cpu.to(device)))

    def num_chunks(self, x: torch.Tensor, chunk_size: int) -> int:
        """Rounds every rank runs: fixed by max_tokens_per_rank, else agreed on with a MAX all-reduce."""
        T = x.shape[0]
        if self.max_tokens_per_rank is not None:
            if T > self.max_tokens_per_rank:
                raise ValueError(
                    f"this rank got {T} tokens, more than max_tokens_per_rank={self.max_tokens_per_rank} "
                    "(raise it in ParallelConfig)"
                )
            return max(1, -(-self.max_tokens_per_rank // chunk_size))
        t = torch.full((1,), T, dtype=torch.int64, device=x.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return max(1, -(-int(t.item()) // chunk_size))

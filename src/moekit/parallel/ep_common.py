"""What the expert-parallel dispatchers share: placement state, row packing, destination math.

Packing: a token travels as one row of bytes [x (H values) | pad to 4 | meta (m int32)
| pad to 16], so dispatch moves hidden states, routing weights (fp32 bits) and ids in one
collective instead of three. Receivers read x and meta as views of the received bytes.

Destinations: a token goes once to each rank holding any of its k experts, so it has
at most C = min(P, k) destinations; they are listed in increasing rank order, padded
with P. Combine sums a token's C partial outputs in that order, so the result does not
depend on timing (no atomics).
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
    "unpack_rows",
    "pack_meta",
    "destinations",
    "send_slots",
    "gather_sources",
    "sum_partials",
    "all_gather_single",
    "reduce_scatter_single",
]

# torch >= 2.13 renames the single-tensor collectives; older releases only have the old names.
# (Both are None on torch builds without distributed support.)
all_gather_single = getattr(dist, "all_gather_single", None) or getattr(dist, "all_gather_into_tensor", None)
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or getattr(dist, "reduce_scatter_tensor", None)


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


class RowLayout:
    """Byte layout of one packed row: x [H] of `dtype`, then m int32 meta values."""

    def __init__(self, hidden_size: int, dtype: torch.dtype, meta_size: int) -> None:
        self.hidden_size, self.dtype, self.meta_size = hidden_size, dtype, meta_size
        self.x_bytes = hidden_size * dtype.itemsize
        self.meta_offset = _round_up(self.x_bytes, 4)
        self.row_bytes = _round_up(self.meta_offset + 4 * meta_size, 16)


def pack_meta(topk_weights: torch.Tensor, topk_ids: torch.Tensor, flag: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Routing weights (as fp32 bits), ids and an optional flag column as int32 meta.

    Args:
        topk_weights: [T, k] fp32.  topk_ids: [T, k] integer.  flag: [T] int32 or None.
    Returns:
        [T, 2k] or [T, 2k + 1] int32.
    """
    cols = [topk_weights.float().contiguous().view(torch.int32), topk_ids.to(torch.int32)]
    if flag is not None:
        cols.append(flag.to(torch.int32).unsqueeze(1))
    return torch.cat(cols, dim=1)


def pack_rows(x: torch.Tensor, meta: torch.Tensor, layout: RowLayout, extra_rows: int = 0) -> torch.Tensor:
    """Pack x [T, H] and meta [T, m] int32 into rows [T + extra_rows, row_bytes] uint8.

    The extra rows at the end are all zero bytes (a zero token whose flag is 0).
    """
    T = x.shape[0]
    out = torch.empty((T + extra_rows, layout.row_bytes), dtype=torch.uint8, device=x.device)
    out[:T, :layout.x_bytes] = x.contiguous().view(torch.uint8)
    out[:T, layout.meta_offset:layout.meta_offset + 4 * layout.meta_size] = meta.contiguous().view(torch.uint8)
    if extra_rows:
        out[T:].zero_()
    return out


def unpack_rows(rows: torch.Tensor, layout: RowLayout) -> Tuple[torch.Tensor, torch.Tensor]:
    """Views of packed rows [N, row_bytes] uint8: x [N, H] of layout.dtype and meta [N, m] int32."""
    x = rows[:, :layout.x_bytes].view(layout.dtype)
    meta = rows[:, layout.meta_offset:layout.meta_offset + 4 * layout.meta_size].view(torch.int32)
    return x, meta


def destinations(topk_ids: torch.Tensor, owner: torch.Tensor, num_ranks: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Which ranks each token goes to (once per rank, however many of its experts live there).

    Args:
        topk_ids: [T, k] global expert ids.  owner: [E] int64 rank of each expert.
    Returns:
        mask [T, P] bool (token t goes to rank r) and dest [T, C] int64 with C = min(P, k):
        the token's destination ranks in increasing order, padded with P.
    """
    T, k = topk_ids.shape
    P = num_ranks
    ranks_Tk = owner[topk_ids.long()]  # [T, k]
    mask = torch.zeros((T, P), dtype=torch.bool, device=topk_ids.device)
    mask.scatter_(1, ranks_Tk, True)  # [T, P]
    key = torch.where(mask, torch.arange(P, device=mask.device), P)  # [T, P]
    dest = torch.topk(key, min(P, k), dim=1, largest=False, sorted=True).values  # [T, C]
    return mask, dest


def send_slots(mask: torch.Tensor, dest: torch.Tensor, block_start: torch.Tensor, trash: int) -> torch.Tensor:
    """Row of the send buffer that carries each (token, destination) pair.

    Tokens bound for rank r fill the block that starts at block_start[r] in token order.
    Args:
        mask: [T, P] bool.  dest: [T, C] int64 padded with P.  block_start: [P] int64.
        trash: the row index given to padding pairs (one past the used rows).
    Returns:
        [T, C] int64.
    """
    P = mask.shape[1]
    pos_TP = torch.cumsum(mask.long(), dim=0) - 1  # [T, P] index of t among rank r's tokens
    d = dest.clamp(max=P - 1)  # [T, C] (padding clamped, masked below)
    rows = block_start[d] + pos_TP.gather(1, d)  # [T, C]
    return torch.where(dest < P, rows, trash)


def gather_sources(slots: torch.Tensor, num_rows: int, fill: int) -> torch.Tensor:
    """Invert send_slots: for each of num_rows send rows, the token it carries (`fill` if none).

    Args:
        slots: [T, C] int64 rows in [0, num_rows] (num_rows is the trash row).
    Returns:
        [num_rows] int64 token index per send row.
    """
    T, C = slots.shape
    src = torch.full((num_rows + 1,), fill, dtype=torch.int64, device=slots.device)
    tokens = torch.arange(T, device=slots.device).repeat_interleave(C)  # [T*C]
    # Only padding pairs share an index (the trash row), so which write wins there does not matter.
    src.scatter_(0, slots.reshape(-1), tokens)
    return src[:num_rows]


def sum_partials(y_back: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Sum each token's partial outputs in destination order.

    Args:
        y_back: [N + 1, H] fp32 rows as returned, last row zero (the trash row).
        slots: [T, C] rows per (token, destination), trash for padding.
    Returns:
        [T, H] fp32.
    """
    T, C = slots.shape
    return y_back[slots.reshape(-1)].view(T, C, y_back.shape[1]).sum(dim=1)


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
        self._by_device: Dict[torch.device, Tuple[torch.Tensor, torch.Tensor]] = {}

    def tables(self, device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
        """(owner [E] int64, expert_map [E] int32) on `device`, copied once per device.

        The first call on a device copies from the host: make it before a CUDA graph capture.
        """
        if device not in self._by_device:
            self._by_device[device] = (self._owner_cpu.to(device), self._map_cpu.to(device))
        return self._by_device[device]

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
        t = torch.tensor([T], dtype=torch.int64, device=x.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return max(1, -(-int(t.item()) // chunk_size))

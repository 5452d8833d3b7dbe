"""What the expert-parallel dispatchers share: placement state, row packing, destination math.

Packing: a token travels as one row of bytes [x (H values) | pad to 16 | weights (k fp32)
| ids (k int32) | pad to 16], so dispatch moves hidden states, routing weights and ids in
one collective instead of three. Receivers read them as views of the received bytes.
Copies run on the widest integer view the bytes allow (4-byte words for even H in 16-bit
dtypes), never byte by byte.

Destinations: a token goes once to each rank holding any of its k experts. Pairs
(rank r, token t) are indexed as [P, T]; rows_PT[r, t] is the send-buffer row of the pair
(a "trash" row past the used ones when t does not go to r). Combine keeps, per token,
C = min(P, k) rows [C, T] in increasing rank order and sums the partials in that order,
from zero, so the result does not depend on timing (no atomics).

Two implementations of the per-token passes, picked by the dispatchers' `kernels` argument:
"torch" (the functions below: the readable reference, and the path on CPU/gloo) and
"triton" (ep_kernels.py: plan, pack and combine in one launch each, CUDA). "auto" takes
Triton for CUDA tensors when it is installed, torch otherwise. Both give bit-identical
rows and sums.

Count exchange (dynamic dispatchers): each rank sends every rank a pair (rows for you,
ids outside [0, E) here), so the one host read that sizes the buffers also tells every
rank whether any rank got bad ids: all of them raise, none is left waiting. A rank that
refuses the call before dispatching (NaN router logits, more tokens than its capacity)
still joins the exchange, with status REFUSED, so the others raise with it.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from ..config import settings
from .base import Dispatcher
from .config import ParallelConfig
from .placement import expert_map, expert_owner, non_local_expert

__all__ = [
    "EP_KERNELS",
    "ExpertParallelDispatcher",
    "RowLayout",
    "word_dtype",
    "pack_rows",
    "padding_rows",
    "unpack_rows",
    "destination_mask",
    "send_rows",
    "row_sources",
    "combine_rows",
    "sum_partials",
    "read_exchange",
    "MORE_ROUNDS",
    "REFUSED",
    "all_gather_single",
    "reduce_scatter_single",
    "check_no_grad",
]

EP_KERNELS = ("auto", "torch", "triton")

# torch >= 2.13 renames the single-tensor collectives; older releases only have the old names.
# (Both are None on torch builds without distributed support.)
all_gather_single = getattr(dist, "all_gather_single", None) or getattr(dist, "all_gather_into_tensor", None)
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or getattr(dist, "reduce_scatter_tensor", None)


# Added to a rank's bad-id count in the count exchange when it has tokens after this round
# (bad-id counts stay below it: dispatch refuses T * k >= MORE_ROUNDS).
MORE_ROUNDS = 1 << 30
# The status a rank sends in the count exchange when it refuses the call before dispatching
# (its own error is raised there; every other rank raises RuntimeError naming it).
REFUSED = -1


def check_no_grad(t: torch.Tensor, name: str) -> None:
    """Collectives carry no gradients: refuse, rather than silently drop them, when autograd records."""
    if torch.is_grad_enabled() and t.requires_grad:
        raise ValueError(
            f"{name} requires grad, but parallel layers are inference-only (their collectives carry no "
            "gradients); call the layer under torch.no_grad() or torch.inference_mode()"
        )


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def word_dtype(*nbytes: int) -> torch.dtype:
    """Widest integer dtype (4, 2 or 1 bytes) dividing every byte count given (sizes, strides, addresses)."""
    for dtype in (torch.int32, torch.int16):
        if all(n % dtype.itemsize == 0 for n in nbytes):
            return dtype
    return torch.uint8


class RowLayout:
    """Byte layout of one packed row: x [H] of `dtype`, padded to 16 bytes, then k fp32 weights and k int32 ids."""

    def __init__(self, hidden_size: int, dtype: torch.dtype, top_k: int) -> None:
        self.hidden_size, self.dtype, self.top_k = hidden_size, dtype, top_k
        self.x_bytes = hidden_size * dtype.itemsize
        self.w_offset = _round_up(self.x_bytes, 16)
        self.ids_offset = self.w_offset + 4 * top_k
        self.row_bytes = _round_up(self.ids_offset + 4 * top_k, 16)


def pack_rows(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, layout: RowLayout,
              tail: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Pack tokens into rows of bytes (padding bytes left uninitialised).

    Args:
        x: [T, H].  topk_weights: [T, k] float.  topk_ids: [T, k] integer.
        tail: [n, row_bytes] uint8 rows appended as they are (padding rows), or None.
    Returns:
        [T (+ n), row_bytes] uint8.
    """
    T = x.shape[0]
    n = 0 if tail is None else tail.shape[0]
    out = torch.empty((T + n, layout.row_bytes), dtype=torch.uint8, device=x.device)
    word = word_dtype(layout.x_bytes)
    if x.stride(-1) != 1 or word_dtype(layout.x_bytes, x.stride(0) * x.element_size(), x.data_ptr()) != word:
        x = x.contiguous()
    w0, i0, k = layout.w_offset // 4, layout.ids_offset // 4, layout.top_k
    out[:T].view(word)[:, :layout.x_bytes // word.itemsize] = x.view(word)
    out[:T].view(torch.float32)[:, w0:w0 + k] = topk_weights  # copy_ converts to fp32
    out[:T].view(torch.int32)[:, i0:i0 + k] = topk_ids  # and to int32
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
        topk_ids: [T, k] global expert ids in [0, E).  owner: [E] int64 rank of each expert.
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
    """Sum each token's partial outputs in destination order: 0 + back[rows[0]] + back[rows[1]] + ...

    Args:
        back: [N + 1, H] fp32 rows as returned, the last row zero (the trash row).
        rows_CT: [C, T] rows per (destination, token), N for no destination.
    Returns:
        [T, H] fp32.
    """
    out = back.new_zeros((rows_CT.shape[1], back.shape[1]))
    for rows_T in rows_CT:  # one add per destination, in order (torch.sum may reassociate)
        out += back[rows_T]
    return out


def read_exchange(info: List[int], num_ranks: int, num_experts: int) -> Tuple[List[int], List[int], bool]:
    """Split the host copy of a count exchange into (send counts, receive counts) per rank and
    whether any rank has tokens for another round.

    Args:
        info: [4P] ints: per destination (rows, status here), then per source (rows, status
            there); status = bad ids (ids outside [0, E)) + MORE_ROUNDS if that rank has more
            tokens, or REFUSED.
    Raises:
        RuntimeError when another rank refused the call (that rank raises its own reason);
        ValueError on every rank when any rank got topk_ids outside [0, E).
    """
    P = num_ranks
    status = info[2 * P + 1::2]
    refused = [r for r, s in enumerate(status) if s < 0]
    if refused:
        raise RuntimeError(f"rank(s) {refused} refused this call before dispatching its tokens (the reason is "
                           "raised there), so no rank computes it")
    bad = {r: s % MORE_ROUNDS for r, s in enumerate(status) if s % MORE_ROUNDS}
    if bad:
        raise ValueError(
            f"topk_ids must lie in [0, {num_experts}), got ids outside on rank(s) {sorted(bad)} "
            f"({sum(bad.values())} ids)"
        )
    return info[0:2 * P:2], info[2 * P::2], any(s >= MORE_ROUNDS for s in status)


class ExpertParallelDispatcher(Dispatcher):
    """Base of the expert-parallel dispatchers: group, placement and per-device index tensors.

    Args:
        parallel: ParallelConfig with ep_size >= 2.
        num_experts: E global experts (physical slots when EPLB adds replicas).
        top_k: k.
        kernels: "auto" | "torch" | "triton": who runs the per-token passes (module docstring).
        kernel_config: ep_kernels.EpKernelConfig of the Triton kernels, or None for the defaults.
    """

    def __init__(self, parallel: ParallelConfig, num_experts: int, top_k: int, kernels: str = "auto",
                 kernel_config=None) -> None:
        if parallel.ep_size < 2:
            raise ValueError(f"{type(self).__name__} needs ep_size >= 2, got ep_size={parallel.ep_size}")
        if kernels not in EP_KERNELS:
            raise ValueError(f"kernels must be one of {list(EP_KERNELS)}, got {kernels!r}")
        if kernels == "torch" and kernel_config is not None:
            raise ValueError(f"kernel_config tunes the Triton kernels, but kernels='torch', got {kernel_config!r}")
        self.parallel = parallel
        self.group = parallel.group
        self.rank, self.size = parallel.ep_rank, parallel.ep_size
        self.num_experts, self.top_k = num_experts, top_k
        self.max_tokens_per_rank = parallel.max_tokens_per_rank
        self.kernels = kernels
        self._triton = None  # the ep_kernels module, imported on first use
        self._kernel_config = kernel_config
        if kernels == "triton" or kernel_config is not None:
            self._triton_kernels()  # import errors at construction, not in forward
        self._owner_cpu = expert_owner(num_experts, self.size, parallel.placement)  # [E] int64
        self._map_cpu = expert_map(num_experts, self.size, self.rank, parallel.placement)  # [E] int32
        self.pad_id = non_local_expert(num_experts, self.size, self.rank, parallel.placement)
        self._cache: Dict[tuple, object] = {}

    def cached(self, key: tuple, make):
        """A constant (tensor, layout) made once per key (device, dtype, ...).

        The first call on a device copies tables from the host: make it before a CUDA graph capture.
        """
        if key not in self._cache:
            self._cache[key] = make()
        return self._cache[key]

    def tables(self, device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
        """(owner [E] int64, expert_map [E] int32) on `device`."""
        return (self.cached(("owner", device), lambda: self._owner_cpu.to(device)),
                self.cached(("map", device), lambda: self._map_cpu.to(device)))

    def layout(self, hidden_size: int, dtype: torch.dtype, top_k: int) -> RowLayout:
        """The RowLayout of rows for tokens of `hidden_size` values of `dtype` and `top_k` experts."""
        return self.cached(("layout", hidden_size, dtype, top_k), lambda: RowLayout(hidden_size, dtype, top_k))

    def _triton_kernels(self):
        if self._triton is None:
            from . import ep_kernels  # noqa: PLC0415 (optional dependency)

            self._triton = ep_kernels
            if self._kernel_config is None:
                self._kernel_config = ep_kernels.EpKernelConfig()
        return self._triton

    def triton_for(self, x: torch.Tensor):
        """The ep_kernels module when the Triton kernels serve x's device, else None (torch path)."""
        if self.kernels == "torch":
            return None
        if self.kernels == "triton":
            if x.device.type != "cuda" and not settings.triton_interpret:
                raise ValueError("kernels='triton' needs CUDA tensors (or TRITON_INTERPRET=1 on CPU, for tests), "
                                 f"got x on {x.device}")
            return self._triton_kernels()
        if x.device.type != "cuda" or settings.triton_interpret:
            return None
        try:
            return self._triton_kernels()
        except ImportError:
            self.kernels = "torch"  # "auto" without Triton installed: the torch path, decided once
            return None

    def num_chunks(self, x: torch.Tensor, chunk_size: int) -> int:
        """Rounds every rank runs: fixed by max_tokens_per_rank, else agreed on with a MAX all-reduce."""
        T = x.shape[0]
        if self.max_tokens_per_rank is not None:
            if T > self.max_tokens_per_rank:
                self.refuse(x)
                raise ValueError(
                    f"this rank got {T} tokens, more than max_tokens_per_rank={self.max_tokens_per_rank} "
                    "(raise it in ParallelConfig)"
                )
            return max(1, -(-self.max_tokens_per_rank // chunk_size))
        t = torch.full((1,), T, dtype=torch.int64, device=x.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return max(1, -(-int(t.item()) // chunk_size))

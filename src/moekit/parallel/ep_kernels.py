"""Triton kernels of the expert-parallel dispatchers (CUDA): plan, pack and combine, one launch each.

ep_common.py holds the torch path each kernel must match bit for bit; the dispatchers pick
one of the two (their `kernels` argument). Letters: T tokens, H hidden size, k experts per
token, P ranks, E global experts.

    plan     topk_ids [T, k] -> meta = [send (count, bad ids) per rank | receive part,
             written by the count exchange | pos [P, T]]: pos[r, t] is token t's place in
             the block of rank r (-1: t does not go to r). ONE program scans the tokens in
             blocks and keeps a running count per rank.
    pack     one program per token writes its row [x | weights | ids] to each destination's
             block; with a capacity, one more program per slot fills the empty slots with
             padding rows (zero token, weights 0, every id an expert that rank lacks).
    combine  one program per (token, H block) sums the returned partials of the token's
             destinations in increasing rank order, in fp32, from zero (no atomics).

The row of (r, t) is base[r] + pos[r, t], with base[r] = r * capacity (static) or the rows
of ranks < r (dynamic). Every kernel recomputes base from the P counts on the device, so
nothing waits for a host value and the dynamic path can pack before the host reads the
counts. Copies move 4-byte words where the bytes allow (rows are multiples of 16 bytes
and x's region is padded to 16 bytes), which the compiler turns into 16-byte accesses.

Importing this module needs the optional `triton` package (`pip install moekit[gpu]`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional

import torch

try:
    import triton
    import triton.language as tl
except ImportError as err:  # pragma: no cover - depends on the environment
    raise ImportError("moekit.parallel.ep_kernels needs Triton: `pip install moekit[gpu]`") from err

from .ep_common import word_dtype

__all__ = ["EpKernelConfig", "meta_size", "plan", "pack", "combine"]


@dataclass(frozen=True)
class EpKernelConfig:
    """Tile sizes and warps of the three kernels (powers of two).

    Fields:
        plan_block: tokens per step of the one-program plan scan.
        pack_block: 4-byte words of a row copied per step of a pack program.
        combine_block: H values per combine program.
        *_warps: warps per program of each kernel.
    """

    plan_block: int = 1024
    plan_warps: int = 4
    pack_block: int = 1024
    pack_warps: int = 4
    combine_block: int = 1024
    combine_warps: int = 4

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1 or v & (v - 1):
                raise ValueError(f"EpKernelConfig.{f.name} must be a power of two >= 1, got {v!r}")


def meta_size(num_ranks: int, num_tokens: int) -> int:
    """int32 entries of the meta buffer: send (count, bad) [2P], receive [2P], pos [P, T]."""
    return 4 * num_ranks + num_ranks * num_tokens


@triton.jit
def _row_base(meta_ptr, ranks, P, capacity):
    """First row of each rank's block: r * capacity, or the rows of the ranks before it."""
    counts = tl.load(meta_ptr + 2 * ranks, mask=ranks < P, other=0)
    return tl.where(capacity > 0, ranks * capacity, tl.cumsum(counts, 0) - counts)


@triton.jit(do_not_specialize=["T"])  # T changes every call: one build for all
def ep_plan_kernel(ids_ptr, owner_ptr, meta_ptr, T, E, P, ids_s0, ids_s1,
                   K: tl.constexpr, P_PAD: tl.constexpr, BLOCK_T: tl.constexpr):
    """Counts per rank, ids out of [0, E), and pos [P, T] (see the module docstring). Grid (1,)."""
    ranks = tl.arange(0, P_PAD)
    carry = tl.zeros([P_PAD], dtype=tl.int32)
    bad = tl.zeros([BLOCK_T], dtype=tl.int32)
    pos_ptr = meta_ptr + 4 * P
    for t0 in range(0, T, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        live = t < T
        dest = tl.zeros([BLOCK_T, P_PAD], dtype=tl.int32)
        for j in tl.static_range(K):
            e = tl.load(ids_ptr + t.to(tl.int64) * ids_s0 + j * ids_s1, mask=live, other=0).to(tl.int32)
            outside = (e < 0) | (e >= E)
            bad += (live & outside).to(tl.int32)
            # an id outside [0, E) goes nowhere; the count exchange reports it and every rank raises
            o = tl.load(owner_ptr + e, mask=live & (outside == 0), other=-1).to(tl.int32)
            dest = dest | (o[:, None] == ranks[None, :]).to(tl.int32)
        pos = tl.where(dest != 0, tl.cumsum(dest, 0) - 1 + carry[None, :], -1)
        tl.store(pos_ptr + ranks[None, :] * T + t[:, None], pos, mask=live[:, None] & (ranks[None, :] < P))
        carry += tl.sum(dest, 0)
    nbad = tl.sum(bad, 0)
    tl.store(meta_ptr + 2 * ranks, carry, mask=ranks < P)
    tl.store(meta_ptr + 2 * ranks + 1, tl.zeros([P_PAD], dtype=tl.int32) + nbad, mask=ranks < P)


@triton.jit(do_not_specialize=["T"])  # T changes every call: one build for all
def ep_pack_kernel(x_ptr, w_ptr, ids_ptr, meta_ptr, pad_ids_ptr, out_x_ptr, out_i_ptr,
                   T, P, capacity, x_s0, w_s0, w_s1, ids_s0, ids_s1, row_xw, row_iw, XW, W_OFF, ID_OFF,
                   K: tl.constexpr, K_PAD: tl.constexpr, P_PAD: tl.constexpr, BLOCK_X: tl.constexpr):
    """Programs [0, T): token rows to their destinations; [T, T + P*capacity): padding of empty slots."""
    pid = tl.program_id(0)
    ranks = tl.arange(0, P_PAD)
    cols = tl.arange(0, BLOCK_X)
    j = tl.arange(0, K_PAD)
    jm = j < K
    if pid < T:
        pos = tl.load(meta_ptr + 4 * P + ranks * T + pid, mask=ranks < P, other=-1)
        sent = pos >= 0
        row = (_row_base(meta_ptr, ranks, P, capacity) + pos).to(tl.int64)  # [P_PAD]
        src = x_ptr + pid.to(tl.int64) * x_s0
        for c0 in range(0, XW, BLOCK_X):
            c = c0 + cols
            v = tl.load(src + c, mask=c < XW)
            tl.store(out_x_ptr + row[:, None] * row_xw + c[None, :], v[None, :], mask=sent[:, None] & (c < XW)[None, :])
        w = tl.load(w_ptr + pid.to(tl.int64) * w_s0 + j * w_s1, mask=jm, other=0.0).to(tl.float32)
        ids = tl.load(ids_ptr + pid.to(tl.int64) * ids_s0 + j * ids_s1, mask=jm, other=0).to(tl.int32)
        dst = out_i_ptr + row[:, None] * row_iw + j[None, :]
        both = sent[:, None] & jm[None, :]
        tl.store(dst + W_OFF, w.to(tl.int32, bitcast=True)[None, :], mask=both)
        tl.store(dst + ID_OFF, ids[None, :], mask=both)
    else:
        s = pid - T
        r = s // capacity
        if s - r * capacity >= tl.load(meta_ptr + 2 * r):
            row = s.to(tl.int64)
            zero = tl.zeros([BLOCK_X], dtype=out_x_ptr.dtype.element_ty)
            for c0 in range(0, XW, BLOCK_X):
                c = c0 + cols
                tl.store(out_x_ptr + row * row_xw + c, zero, mask=c < XW)
            dst = out_i_ptr + row * row_iw + j
            tl.store(dst + W_OFF, tl.zeros([K_PAD], dtype=tl.int32), mask=jm)
            tl.store(dst + ID_OFF, tl.zeros([K_PAD], dtype=tl.int32) + tl.load(pad_ids_ptr + r), mask=jm)


@triton.jit(do_not_specialize=["T"])  # T changes every call: one build for all
def ep_combine_kernel(back_ptr, meta_ptr, out_ptr, T, H, P, capacity, back_s0, out_s0,
                      P_PAD: tl.constexpr, BLOCK_H: tl.constexpr):
    """out[t, h-block] = sum over the token's destinations r = 0, 1, ... of back[row(r, t)]. Grid (T, H blocks)."""
    t = tl.program_id(0)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ranks = tl.arange(0, P_PAD)
    pos = tl.load(meta_ptr + 4 * P + ranks * T + t, mask=ranks < P, other=-1)
    row = _row_base(meta_ptr, ranks, P, capacity) + pos
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for r in range(P):  # increasing rank: the sum order does not depend on timing
        p = tl.max(tl.where(ranks == r, pos, -1), 0)
        rr = tl.max(tl.where(ranks == r, row, -1), 0)
        # h < 0 masks a rank the token does not go to (a vector mask: the interpreter rejects vector & scalar)
        acc += tl.load(back_ptr + rr.to(tl.int64) * back_s0 + h, mask=h < tl.where(p >= 0, H, 0), other=0.0)
    tl.store(out_ptr + t.to(tl.int64) * out_s0 + h, acc.to(out_ptr.dtype.element_ty), mask=h < H)


def _pow2(n: int, lo: int = 1) -> int:
    return max(lo, triton.next_power_of_2(n))


def plan(topk_ids: torch.Tensor, owner: torch.Tensor, num_ranks: int, meta: torch.Tensor,
         config: EpKernelConfig) -> None:
    """Write send counts, bad-id counts and pos into meta (see the module docstring).

    Args:
        topk_ids: [T, k] integer global ids.  owner: [E] integer rank of each expert.
        meta: [meta_size(P, T)] int32, contiguous, overwritten except the receive part.
    """
    T, K = topk_ids.shape
    block = min(config.plan_block, _pow2(T, 16))
    ep_plan_kernel[(1,)](topk_ids, owner, meta, T, owner.shape[0], num_ranks, topk_ids.stride(0),
                         topk_ids.stride(1), K=K, P_PAD=_pow2(num_ranks, 2), BLOCK_T=block,
                         num_warps=config.plan_warps)


def pack(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, meta: torch.Tensor, layout,
         out: torch.Tensor, num_ranks: int, capacity: int, pad_ids: Optional[torch.Tensor],
         config: EpKernelConfig) -> None:
    """Write every token's row into the send buffer `out`, and padding rows when capacity > 0.

    Args:
        x: [T, H] with unit stride along H.  topk_weights: [T, k] float.  topk_ids: [T, k] integer.
        meta: as written by plan.  layout: the RowLayout of the rows.
        out: [N, row_bytes] uint8 send buffer; rows no pair writes are left alone (dynamic path).
        capacity: 0 for blocks back to back (dynamic), else C rows per rank (N = P * C).
        pad_ids: [P] int32 padding id per destination rank (capacity > 0 only).
    """
    T, K = topk_ids.shape
    n_pad = num_ranks * capacity
    if T + n_pad == 0:
        return
    if x.stride(-1) != 1:
        x = x.contiguous()
    word = word_dtype(layout.x_bytes, x.stride(0) * x.element_size(), x.data_ptr())
    xw = x.view(word)
    out_x, out_i = out.view(word), out.view(torch.int32)
    XW = layout.x_bytes // word.itemsize
    ep_pack_kernel[(T + n_pad,)](
        xw, topk_weights, topk_ids, meta, out_i if pad_ids is None else pad_ids, out_x, out_i,
        T, num_ranks, capacity, xw.stride(0), topk_weights.stride(0), topk_weights.stride(1),
        topk_ids.stride(0), topk_ids.stride(1), out_x.stride(0), out_i.stride(0), XW,
        layout.w_offset // 4, layout.ids_offset // 4,
        K=K, K_PAD=_pow2(K), P_PAD=_pow2(num_ranks, 2), BLOCK_X=min(config.pack_block, _pow2(XW, 16)),
        num_warps=config.pack_warps)


def combine(back: torch.Tensor, meta: torch.Tensor, num_ranks: int, capacity: int, out: torch.Tensor,
            config: EpKernelConfig) -> None:
    """out [T, H] = each token's returned partials back [N, H] summed in increasing rank order.

    Args:
        back: [N, H] fp32, unit stride along H.  meta: as written by plan for these T tokens.
        capacity: as given to pack.  out: [T, H] fp32, unit stride along H.
    """
    T, H = out.shape
    if T == 0 or H == 0:
        return
    block = min(config.combine_block, _pow2(H, 16))
    ep_combine_kernel[(T, triton.cdiv(H, block))](
        back, meta, out, T, H, num_ranks, capacity, back.stride(0), out.stride(0),
        P_PAD=_pow2(num_ranks, 2), BLOCK_H=block, num_warps=config.combine_warps)

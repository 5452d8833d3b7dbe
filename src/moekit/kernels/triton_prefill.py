"""Triton kernels of the experts for prefill (many tokens per expert) and their launcher:
GEMM1 (w13, activation fused) and GEMM2 (w2, routed weight applied) over a tile schedule
computed on the device, weight tiles through TMA tensor descriptors, short tail tiles.

Rows: triton_align pads each expert's assignments to a multiple of the row granule
G = BM / TAIL (not of BM), so an expert with P padded rows has cdiv(P, BM) row tiles and
its last tile holds P mod BM rows (or BM). With TAIL > 1 a last tile of at most BM / 2
(BM / 4) rows runs the BM / 2 (BM / 4) row variant of the loop, so the tensor cores do
not multiply up to BM - G rows of padding per expert (DeepSeek-V3 at M = 4096 has about
128 rows per expert: BM = 128 tiles alone multiply about 1.5 times the rows it has).
Schedule: row tiles are numbered expert by expert; each program reads the experts'
padded extents once and finds a tile's expert by a comparison over the experts (no host
sync, no extra launch). Work items (row tile, column tile) go in groups of GROUP_M row
tiles so the weight tiles they share stay in L2; PROGRAMS programs walk them with stride
PROGRAMS (a persistent grid when PROGRAMS is the multiprocessor count, one item each when
it is the item bound). FLATTEN (TAIL = 1, persistent) asks Triton to flatten the two loops
into one pipelined loop, so a tile's first loads overlap the previous tile's epilogue (with
WS, GEMM1's loops only). WS (GEMM2; TAIL = 1, persistent, both operands by TMA, no bias:
Triton 3.6's Hopper pass takes no other loads) asks Triton to warp-specialize the tile loop
instead: a producer warpgroup keeps the TMA loads in flight across tiles while two consumer
warpgroups multiply and store.
Weights: w13 [E, R, H] and w2 [E, H, I] are read as 2-D [E * R, H] and [E * H, I] through
TMA descriptors built on the host (TMA=1) or in the kernel (TMA=2), or pointers (TMA=0).
A tile of BN weight rows may run past an expert's rows into the next matrix; those columns
are computed and never stored, and TMA fills rows and K columns past the tensor with zeros.
Activation rows (ACT_TMA: GEMM2's act, contiguous per expert; X_TMA: x gathered into the
sorted row order by one copy first) come through descriptors built in the kernel, one per
row-tile height; a tile's BMT rows may run past its expert's, and those rows are not stored.
GEMM2 writes each assignment's weighted row y[a] in x's dtype and triton_moe.sum_k_kernel
adds a token's k rows in slot order (deterministic, as on the other sorted path). Both GEMMs
store with OUT_POLICY (triton_moe.store_policy: L2's evict-last for buffers up to 16 MB).

Letters: T tokens, H hidden, I intermediate, E local experts, k slots per token,
TK = T * k assignments, R rows of the activation buffer.
"""

from __future__ import annotations

import functools
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from ..activations import is_gated
from .triton_moe import _gate_up_act, _gate_up_bias, _silu_mul_scaled, _gemm2_operands, _grouped, store_policy, sum_over_k
from .triton_quant_rows import to_quant
from .tuning import FP8_MIN_TILE_ROWS, MoEConfig, TileConfig

__all__ = ["prefill_gemm1_kernel", "prefill_gemm2_kernel", "fused_moe_prefill", "row_tiles_bound", "E_LANES",
           "INTERPRETER_SMS", "FP8_MIN_TILE_ROWS"]

# Lanes of the per-expert schedule vectors: at least this many (a power of two), so every
# E up to it shares one compiled kernel.
E_LANES = 256
# Multiprocessors assumed under the Triton interpreter (CPU tensors), so a persistent grid
# of a few programs walks several tiles each in tests.
INTERPRETER_SMS = 2


@triton.jit
def _schedule(expert_end_ptr, E, BM: tl.constexpr, E_PAD: tl.constexpr):
    """Per expert lane: tiles ending there (cumulative), the row base of its tiles (row of
    its tile m is base + m * BM), its padded end row; and the number of row tiles."""
    lanes = tl.arange(0, E_PAD)
    ends = tl.load(expert_end_ptr + lanes, mask=lanes < E, other=0)
    starts = tl.load(expert_end_ptr + lanes - 1, mask=(lanes >= 1) & (lanes < E), other=0)
    tiles = (ends - starts + BM - 1) // BM
    tile_end = tl.cumsum(tiles, axis=0)
    row_base = starts - (tile_end - tiles) * BM
    return tile_end, row_base, ends, tl.sum(tiles, axis=0)


@triton.jit
def _tile_rows(m, tile_end, row_base, ends, BM: tl.constexpr, E_PAD: tl.constexpr):
    """(expert, first row, rows) of row tile m (rows <= BM, a multiple of the row granule)."""
    e = tl.sum((tile_end <= m).to(tl.int32), axis=0)
    sel = tl.arange(0, E_PAD) == e
    row0 = tl.sum(tl.where(sel, row_base, 0), axis=0) + m * BM
    rows = tl.minimum(tl.sum(tl.where(sel, ends, 0), axis=0) - row0, BM)
    return e, row0, rows


@triton.jit
def _whole_tile_rows(m, expert_end_ptr, E, BM: tl.constexpr, E_PAD: tl.constexpr):
    """(expert, first row, rows) of row tile m when every expert is padded to whole tiles
    (tail 1), read from the padded ends per tile: Triton's warp specialization takes no
    scan and no tensor held across the tile loop."""
    lanes = tl.arange(0, E_PAD)
    ends = tl.load(expert_end_ptr + lanes, mask=lanes < E, other=2**31 - 1)
    row0 = m * BM
    return tl.sum((ends <= row0).to(tl.int32), axis=0), row0, BM


@triton.jit
def _variant(rows, BM: tl.constexpr, TAIL: tl.constexpr):
    """Which loop serves a tile of `rows` rows (TAIL 2 or 4): 0 (BM rows), 1 (BM / 2) or 2
    (BM / 4, TAIL 4 only), the shortest that holds them."""
    v = (rows <= BM // 2).to(tl.int32)
    if TAIL == 4:
        v += (rows <= BM // 4).to(tl.int32)
    return v


@triton.jit
def _row_descs(ptr, R, K, stride, BM: tl.constexpr, BK: tl.constexpr, TAIL: tl.constexpr, ON: tl.constexpr):
    """TMA descriptors of a row-major [R, K] operand with [BM, BK], [BM/2, BK], [BM/4, BK]
    blocks, one per row-tile height the tail loops use (ptr stands in for the others, and
    for all three when ON is false)."""
    d0 = ptr
    d1 = ptr
    d2 = ptr
    if ON:
        d0 = tl.make_tensor_descriptor(ptr, shape=[R, K], strides=[stride, 1], block_shape=[BM, BK])
        if TAIL >= 2:
            d1 = tl.make_tensor_descriptor(ptr, shape=[R, K], strides=[stride, 1], block_shape=[BM // 2, BK])
        if TAIL == 4:
            d2 = tl.make_tensor_descriptor(ptr, shape=[R, K], strides=[stride, 1], block_shape=[BM // 4, BK])
    return d0, d1, d2


@triton.jit
def _mma(a, b, acc, IEEE: tl.constexpr):
    """acc + a @ b; exact fp32 products for fp32 inputs."""
    if IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _weight_tile(w_ptr, w_desc, e, n0, k0, ks, cols, w_rows, N, K, stride_we, stride_wn,
                 TMA: tl.constexpr):
    """[BK, BN] tile of expert e's weight rows n0 + cols (K-contiguous), columns k0 + ks."""
    if TMA > 0:
        return w_desc.load([e * w_rows + n0, k0]).T
    ptrs = w_ptr + e.to(tl.int64) * stride_we + cols[None, :].to(tl.int64) * stride_wn + (k0 + ks)[:, None]
    return tl.load(ptrs, mask=((k0 + ks) < K)[:, None] & (cols < N)[None, :], other=0.0)


@triton.jit
def _x_tile(x_desc, a_ptrs, row0, k0, live, ks, K, X_TMA: tl.constexpr):
    """GEMM1's [BMT, BK] A tile at column k0: rows from row0 by TMA (X_TMA, x gathered in the
    sorted row order), else each live row's token row through pointers."""
    if X_TMA:
        return x_desc.load([row0, k0])
    return tl.load(a_ptrs, mask=live[:, None] & ((k0 + ks) < K)[None, :], other=0.0)


@triton.jit
def _gemm1_tile(
    x_ptr, x_desc, w_ptr, w_desc, b_ptr, out_ptr, topk_w_ptr, sorted_ptr, src_ptr,
    sx_ptr, sw13_ptr, sa2_ptr, sw2_ptr, wy_ptr,
    e, row0, rows, n0, N, K, TK, top_k, w_rows,
    stride_xm, stride_we, stride_wn, stride_be, stride_om, alpha, limit,
    BMT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, TMA: tl.constexpr, X_TMA: tl.constexpr,
    GATED: tl.constexpr, ACT: tl.constexpr, HAS_BIAS: tl.constexpr, ON_INPUT: tl.constexpr, IEEE: tl.constexpr,
    GU1: tl.constexpr, SCALED: tl.constexpr, FOLD: tl.constexpr, OUT_POLICY: tl.constexpr,
):
    """act rows [row0, row0 + rows) (rows <= BMT), columns [n0, n0 + BN) of expert e.

    X_TMA: x_desc reads x's rows already gathered into the sorted row order ([R, K], blocks
    [BMT, BK]); rows past the tile's only reach rows that are not stored. GU1 (gated, TMA=2):
    w_desc reads w13 as [E * 2, N, K] in [2, BN, BK] blocks, the gate and up rows of a tile,
    multiplied as one [BK, 2 BN] product (same sums per element, one MMA instead of two).
    SCALED (fp8, static per-tensor scales): assignment a reads x's row src[a]; the product is
    dequantized by expert e's scales sx[e] (x) and sw13[e] (w13) after the K loop, and the
    activation is stored quantized to fp8 with sa2[e], GEMM2's input scale. FOLD (SCALED, no
    bias in GEMM2): the column tile at n0 = 0 also stores wy[a] = w[a] sa2[e] sw2[e], the
    routed weight with GEMM2's scales, for GEMM2 to apply in one multiply."""
    r = tl.arange(0, BMT)
    in_tile = r < rows
    assign = tl.load(sorted_ptr + row0 + r, mask=in_tile, other=TK)
    live = assign < TK
    if SCALED:
        token = tl.load(src_ptr + assign, mask=live, other=0).to(tl.int64)
    else:
        token = tl.where(live, assign // top_k, 0).to(tl.int64)
    ks = tl.arange(0, BK)
    cols = n0 + tl.arange(0, BN)
    col_ok = cols < N
    a_ptrs = x_ptr + token[:, None] * stride_xm + ks[None, :]
    # The epilogue's operands are loaded before the K loop, so it does not wait for them.
    w_row = tl.zeros([BMT], dtype=tl.float32)
    if ON_INPUT or FOLD:
        w_row = tl.load(topk_w_ptr + assign, mask=live, other=0.0)
    b_gate, b_up = _gate_up_bias(b_ptr, e, cols, col_ok, N, stride_be, BN, HAS_BIAS, GATED)
    xw_s = 1.0
    out_s = 1.0
    w2_s = 1.0
    if SCALED:
        xw_s = tl.load(sx_ptr + e) * tl.load(sw13_ptr + e)  # one multiply a value
        out_s = tl.load(sa2_ptr + e)
        w2_s = tl.load(sw2_ptr + e)
    if GU1:
        acc = tl.zeros([BMT, 2 * BN], dtype=tl.float32)
        for k0 in range(0, K, BK):
            a = _x_tile(x_desc, a_ptrs, row0, k0, live, ks, K, X_TMA)
            acc = _mma(a, w_desc.load([2 * e, n0, k0]).reshape([2 * BN, BK]).T, acc, IEEE)
            a_ptrs += BK
        acc_g, acc_u = acc.reshape([BMT, 2, BN]).permute(0, 2, 1).split()
    else:
        acc_g = tl.zeros([BMT, BN], dtype=tl.float32)
        acc_u = tl.zeros([BMT, BN], dtype=tl.float32)
        for k0 in range(0, K, BK):
            a = _x_tile(x_desc, a_ptrs, row0, k0, live, ks, K, X_TMA)
            acc_g = _mma(a, _weight_tile(w_ptr, w_desc, e, n0, k0, ks, cols, w_rows, N, K, stride_we, stride_wn, TMA),
                         acc_g, IEEE)
            if GATED:  # the up rows follow the N gate rows of each expert
                acc_u = _mma(a, _weight_tile(w_ptr, w_desc, e, n0 + N, k0, ks, cols + N, w_rows, 2 * N, K, stride_we,
                                             stride_wn, TMA), acc_u, IEEE)
            a_ptrs += BK
    if SCALED and GATED and ACT == "silu" and not ON_INPUT and not HAS_BIAS:
        # The scales folded into the activation (x and w13's into g's and u's, fp8 output's into u's).
        h = to_quant(_silu_mul_scaled(acc_g, acc_u, xw_s, xw_s / out_s, True), 448.0, False)
    else:
        if SCALED:
            acc_g = acc_g * xw_s
            acc_u = acc_u * xw_s
        h = _gate_up_act(acc_g, acc_u, w_row[:, None], b_gate[None, :], b_up[None, :], ACT, alpha, limit, GATED,
                         ON_INPUT, HAS_BIAS, SCALED)  # SCALED: stored as fp8
        if SCALED:
            h = to_quant(h * (1.0 / out_s), 448.0, False)  # one division a tile
    o_ptrs = out_ptr + (row0 + r).to(tl.int64)[:, None] * stride_om + cols[None, :]
    if FOLD:
        if n0 == 0:
            tl.store(wy_ptr + assign, w_row * out_s * w2_s, mask=live)
    tl.store(o_ptrs, h.to(out_ptr.dtype.element_ty), mask=in_tile[:, None] & col_ok[None, :],
             eviction_policy=OUT_POLICY)


@triton.jit
def _gemm2_tile_operands(b_ptr, topk_w_ptr, sa2_ptr, sw2_ptr, e, cols, col_ok, assign, live, stride_be,
                         BMT: tl.constexpr, BN: tl.constexpr, HAS_BIAS: tl.constexpr, ON_INPUT: tl.constexpr,
                         SCALED: tl.constexpr):
    """A GEMM2 tile's epilogue operands: (bias, routed weights, SCALED's product of static scales)."""
    scale = 1.0
    if SCALED:
        scale = tl.load(sa2_ptr + e) * tl.load(sw2_ptr + e)
    bias, route_w = _gemm2_operands(b_ptr, e, cols, col_ok, stride_be, topk_w_ptr, assign, live, BMT, BN, HAS_BIAS,
                                    ON_INPUT)
    return bias, route_w, scale


@triton.jit
def _gemm2_tile(
    a_ptr, a_desc, w_ptr, w_desc, b_ptr, y_ptr, topk_w_ptr, sorted_ptr, sa2_ptr, sw2_ptr,
    e, row0, rows, n0, N, K, TK, w_rows,
    stride_am, stride_we, stride_wn, stride_be, stride_ym,
    BMT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, TMA: tl.constexpr, ACT_TMA: tl.constexpr,
    HAS_BIAS: tl.constexpr, ON_INPUT: tl.constexpr, IEEE: tl.constexpr, SCALED: tl.constexpr,
    OUT_POLICY: tl.constexpr, WS: tl.constexpr,
):
    """y[a, n0:n0 + BN] = w[a] * (act[row] W2[e]^T + b2[e]) for the rows [row0, row0 + rows).

    ACT_TMA: a_desc ([R, K], blocks [BMT, BK]) loads all BMT rows from row0; rows past the
    tile's belong to the next expert (or are zeros past R) and only reach unstored rows.
    SCALED: act is fp8 with expert e's scale sa2[e], w2 fp8 with sw2[e], applied before the
    bias (without a bias, GEMM1 folds them into the routed weights instead: one multiply, and
    no per-tile scale loads, which Triton's warp specialization does not take)."""
    r = tl.arange(0, BMT)
    in_tile = r < rows
    assign = tl.load(sorted_ptr + row0 + r, mask=in_tile, other=TK)
    live = assign < TK
    ks = tl.arange(0, BK)
    cols = n0 + tl.arange(0, BN)
    col_ok = cols < N
    a_ptrs = a_ptr + (row0 + r).to(tl.int64)[:, None] * stride_am + ks[None, :]
    # Without WS the epilogue's operands are loaded before the K loop, so it does not wait for
    # them (Triton's warp specialization takes them where they are used, after the loop).
    if not WS:
        bias, route_w, scale = _gemm2_tile_operands(b_ptr, topk_w_ptr, sa2_ptr, sw2_ptr, e, cols, col_ok, assign, live,
                                                    stride_be, BMT, BN, HAS_BIAS, ON_INPUT, SCALED)
    acc = tl.zeros([BMT, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        if ACT_TMA:
            a = a_desc.load([row0, k0])
        else:
            a = tl.load(a_ptrs, mask=in_tile[:, None] & ((k0 + ks) < K)[None, :], other=0.0)
        acc = _mma(a, _weight_tile(w_ptr, w_desc, e, n0, k0, ks, cols, w_rows, N, K, stride_we, stride_wn, TMA),
                   acc, IEEE)
        a_ptrs += BK
    if WS:
        bias, route_w, scale = _gemm2_tile_operands(b_ptr, topk_w_ptr, sa2_ptr, sw2_ptr, e, cols, col_ok, assign, live,
                                                    stride_be, BMT, BN, HAS_BIAS, ON_INPUT, SCALED)
    if SCALED:
        acc = acc * scale
    if HAS_BIAS:
        acc += bias[None, :]
    if not ON_INPUT:
        acc = acc * route_w[:, None]
    y_ptrs = y_ptr + tl.where(live, assign, 0).to(tl.int64)[:, None] * stride_ym + cols[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=live[:, None] & col_ok[None, :],
             eviction_policy=OUT_POLICY)


@triton.jit(do_not_specialize=["TK", "top_k", "E", "PROGRAMS", "R"])
def prefill_gemm1_kernel(
    x_ptr, w_ptr, w_desc, b_ptr, out_ptr, topk_w_ptr, sorted_ptr, expert_end_ptr, src_ptr,
    sx_ptr, sw13_ptr, sa2_ptr, sw2_ptr, wy_ptr,
    N, K, TK, top_k, E, PROGRAMS, w_rows, R,
    stride_xm, stride_we, stride_wn, stride_be, stride_om, alpha, limit,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, TAIL: tl.constexpr,
    FLATTEN: tl.constexpr, E_PAD: tl.constexpr, TMA: tl.constexpr, X_TMA: tl.constexpr, GATED: tl.constexpr,
    ACT: tl.constexpr, HAS_BIAS: tl.constexpr, ON_INPUT: tl.constexpr, IEEE: tl.constexpr, GU1: tl.constexpr,
    SCALED: tl.constexpr, FOLD: tl.constexpr, OUT_POLICY: tl.constexpr = "",
):
    """act[row, n] = act(x[token] W13[e]^T + b13[e])[n] for n < N (= I), every row tile.

    x [T, K=H] (X_TMA: [R, K], x's rows gathered into the sorted row order); w13 [E, w_rows =
    2N or N, K] (w_desc: its [E * w_rows, K] descriptor, blocks [BN, BK]); b13 [E, w_rows];
    out [R, N] in x's dtype (SCALED: fp8); expert_end [E] padded row ends. SCALED (fp8 x and
    w13 with static per-tensor scales): x [T * k, K] rows read through src [T * k]; sx, sw13,
    sa2, sw2 [E] fp32 the scales of x, w13, GEMM2's input and w2;
    FOLD: wy [T * k] fp32, GEMM2's routed weights with its scales.
    """
    if GU1:
        w_desc = tl.make_tensor_descriptor(w_ptr, shape=[E * 2, N, K], strides=[N * K, K, 1], block_shape=[2, BN, BK])
    elif TMA == 2:
        w_desc = tl.make_tensor_descriptor(w_ptr, shape=[E * w_rows, K], strides=[K, 1], block_shape=[BN, BK])
    x_d0, x_d1, x_d2 = _row_descs(x_ptr, R, K, stride_xm, BM, BK, TAIL, X_TMA)
    tile_end, row_base, ends, num_m = _schedule(expert_end_ptr, E, BM, E_PAD)
    num_n = tl.cdiv(N, BN)
    for t in tl.range(tl.program_id(0), num_m * num_n, PROGRAMS, flatten=FLATTEN):
        m, nt = _grouped(t, num_m, num_n, GROUP_M)
        e, row0, rows = _tile_rows(m, tile_end, row_base, ends, BM, E_PAD)
        if TAIL == 1:
            _gemm1_tile(x_ptr, x_d0, w_ptr, w_desc, b_ptr, out_ptr, topk_w_ptr, sorted_ptr, src_ptr,
                        sx_ptr, sw13_ptr, sa2_ptr, sw2_ptr,
                        wy_ptr, e, row0, rows, nt * BN, N, K, TK, top_k, w_rows, stride_xm, stride_we,
                        stride_wn, stride_be, stride_om, alpha, limit, BM, BN, BK, TMA, X_TMA, GATED, ACT,
                        HAS_BIAS, ON_INPUT, IEEE, GU1, SCALED, FOLD, OUT_POLICY)
        else:
            v = _variant(rows, BM, TAIL)
            if v == 0:
                _gemm1_tile(x_ptr, x_d0, w_ptr, w_desc, b_ptr, out_ptr, topk_w_ptr, sorted_ptr, src_ptr,
                            sx_ptr, sw13_ptr, sa2_ptr, sw2_ptr,
                            wy_ptr, e, row0, rows, nt * BN, N, K, TK, top_k, w_rows, stride_xm, stride_we,
                            stride_wn, stride_be, stride_om, alpha, limit, BM, BN, BK, TMA, X_TMA, GATED, ACT,
                            HAS_BIAS, ON_INPUT, IEEE, GU1, SCALED, FOLD, OUT_POLICY)
            if v == 1:
                _gemm1_tile(x_ptr, x_d1, w_ptr, w_desc, b_ptr, out_ptr, topk_w_ptr, sorted_ptr, src_ptr,
                            sx_ptr, sw13_ptr, sa2_ptr, sw2_ptr,
                            wy_ptr, e, row0, rows, nt * BN, N, K, TK, top_k, w_rows, stride_xm, stride_we,
                            stride_wn, stride_be, stride_om, alpha, limit, BM // 2, BN, BK, TMA, X_TMA, GATED, ACT,
                            HAS_BIAS, ON_INPUT, IEEE, GU1, SCALED, FOLD, OUT_POLICY)
            if TAIL == 4:
                if v == 2:
                    _gemm1_tile(x_ptr, x_d2, w_ptr, w_desc, b_ptr, out_ptr, topk_w_ptr, sorted_ptr, src_ptr,
                                sx_ptr, sw13_ptr, sa2_ptr, sw2_ptr,
                                wy_ptr, e, row0, rows, nt * BN, N, K, TK, top_k, w_rows, stride_xm, stride_we,
                                stride_wn, stride_be, stride_om, alpha, limit, BM // 4, BN, BK, TMA, X_TMA, GATED, ACT,
                                HAS_BIAS, ON_INPUT, IEEE, GU1, SCALED, FOLD, OUT_POLICY)


@triton.jit(do_not_specialize=["TK", "E", "PROGRAMS", "R"])
def prefill_gemm2_kernel(
    a_ptr, w_ptr, w_desc, b_ptr, y_ptr, topk_w_ptr, sorted_ptr, expert_end_ptr, sa2_ptr, sw2_ptr,
    N, K, TK, E, PROGRAMS, w_rows, R,
    stride_am, stride_we, stride_wn, stride_be, stride_ym,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, TAIL: tl.constexpr,
    FLATTEN: tl.constexpr, E_PAD: tl.constexpr, TMA: tl.constexpr, ACT_TMA: tl.constexpr, HAS_BIAS: tl.constexpr,
    ON_INPUT: tl.constexpr, IEEE: tl.constexpr, WS: tl.constexpr, SCALED: tl.constexpr,
    OUT_POLICY: tl.constexpr = "",
):
    """y[a, n] = w[a] * (act[row] W2[e]^T + b2[e])[n] (w = 1 when it went on the input), every row tile.

    act [R, K=I]; w2 [E, N=H, K] (w_desc: its [E * N, K] descriptor, blocks [BN, BK]);
    b2 [E, N]; y [TK, N] in x's dtype; expert_end [E] padded row ends. SCALED (a bias and fp8
    act and w2): the static scales sa2[e] and sw2[e] multiply the product before the bias.
    """
    if TMA == 2:
        w_desc = tl.make_tensor_descriptor(w_ptr, shape=[E * w_rows, K], strides=[K, 1], block_shape=[BN, BK])
    a_d0, a_d1, a_d2 = _row_descs(a_ptr, R, K, stride_am, BM, BK, TAIL, ACT_TMA)
    if WS:
        num_m = tl.load(expert_end_ptr + E - 1) // BM
    else:
        tile_end, row_base, ends, num_m = _schedule(expert_end_ptr, E, BM, E_PAD)
    num_n = tl.cdiv(N, BN)
    for t in tl.range(tl.program_id(0), num_m * num_n, PROGRAMS, flatten=FLATTEN, warp_specialize=WS):
        m, nt = _grouped(t, num_m, num_n, GROUP_M)
        if WS:
            e, row0, rows = _whole_tile_rows(m, expert_end_ptr, E, BM, E_PAD)
        else:
            e, row0, rows = _tile_rows(m, tile_end, row_base, ends, BM, E_PAD)
        if TAIL == 1:
            _gemm2_tile(a_ptr, a_d0, w_ptr, w_desc, b_ptr, y_ptr, topk_w_ptr, sorted_ptr,
                        sa2_ptr, sw2_ptr, e, row0, rows,
                        nt * BN, N, K, TK, w_rows, stride_am, stride_we, stride_wn, stride_be, stride_ym,
                        BM, BN, BK, TMA, ACT_TMA, HAS_BIAS, ON_INPUT, IEEE, SCALED, OUT_POLICY, WS)
        else:
            v = _variant(rows, BM, TAIL)
            if v == 0:
                _gemm2_tile(a_ptr, a_d0, w_ptr, w_desc, b_ptr, y_ptr, topk_w_ptr, sorted_ptr,
                            sa2_ptr, sw2_ptr, e, row0, rows,
                            nt * BN, N, K, TK, w_rows, stride_am, stride_we, stride_wn, stride_be, stride_ym,
                            BM, BN, BK, TMA, ACT_TMA, HAS_BIAS, ON_INPUT, IEEE, SCALED, OUT_POLICY, WS)
            if v == 1:
                _gemm2_tile(a_ptr, a_d1, w_ptr, w_desc, b_ptr, y_ptr, topk_w_ptr, sorted_ptr,
                            sa2_ptr, sw2_ptr, e, row0, rows,
                            nt * BN, N, K, TK, w_rows, stride_am, stride_we, stride_wn, stride_be, stride_ym,
                            BM // 2, BN, BK, TMA, ACT_TMA, HAS_BIAS, ON_INPUT, IEEE, SCALED, OUT_POLICY, WS)
            if TAIL == 4:
                if v == 2:
                    _gemm2_tile(a_ptr, a_d2, w_ptr, w_desc, b_ptr, y_ptr, topk_w_ptr, sorted_ptr,
                                sa2_ptr, sw2_ptr, e, row0, rows,
                                nt * BN, N, K, TK, w_rows, stride_am, stride_we, stride_wn, stride_be, stride_ym,
                                BM // 4, BN, BK, TMA, ACT_TMA, HAS_BIAS, ON_INPUT, IEEE, SCALED, OUT_POLICY, WS)

def row_tiles_bound(TK: int, E: int, block_m: int) -> int:
    """Most row tiles TK assignments over E experts can need: every tile holds an assignment,
    and each expert adds at most one partly filled tile."""
    return max(1, min(TK, triton.cdiv(TK, block_m) + E))


@functools.lru_cache(maxsize=None)
def _multiprocessors(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _programs(items: int, per_sm: int, device: torch.device) -> int:
    """Grid size: one program per work item (per_sm = 0) or a persistent grid."""
    if per_sm == 0:
        return items
    sms = _multiprocessors(device.index if device.index is not None else torch.cuda.current_device()) \
        if device.type == "cuda" else INTERPRETER_SMS
    return max(1, min(items, sms * per_sm))


def _weight_desc(w: torch.Tensor, cfg: TileConfig, tma: int, name: str):
    """What the kernels take as w_desc for w [E, rows, K]: its 2-D [E * rows, K] host TMA
    descriptor with [BN, BK] blocks (tma = 1), or w itself (tma = 0: pointer loads; tma = 2:
    the kernel builds the descriptor in a scratch buffer from Triton's allocator, which this
    sets to torch allocations on w's device)."""
    if tma == 0:
        return w
    E, rows, K = w.shape
    if (K * w.element_size()) % 16 or w.data_ptr() % 16:
        raise ValueError(f"TMA needs {name}'s rows 16-byte aligned (K * {w.element_size()} bytes a multiple of 16), "
                         f"got K = {K}; use a config with prefill tma=0")
    if cfg.BLOCK_SIZE_N > 256 or cfg.BLOCK_SIZE_K > 256:
        raise ValueError(f"TMA blocks are at most 256 wide, got BLOCK_SIZE_N={cfg.BLOCK_SIZE_N}, "
                         f"BLOCK_SIZE_K={cfg.BLOCK_SIZE_K}")
    if tma == 2:
        triton.set_allocator(functools.partial(_scratch, w.device))
        return w
    from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: PLC0415 (triton >= 3.4)

    return TensorDescriptor(w.view(E * rows, K), [E * rows, K], [K, 1], [cfg.BLOCK_SIZE_N, cfg.BLOCK_SIZE_K])


def _scratch(device: torch.device, size: int, alignment: int, stream: Optional[int]) -> torch.Tensor:
    """Global memory Triton asks for at launch (device-built descriptors), from torch's allocator."""
    return torch.empty(size, dtype=torch.int8, device=device)


def fused_moe_prefill(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    b13: Optional[torch.Tensor],
    b2: Optional[torch.Tensor],
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_map: Optional[torch.Tensor],
    sorted_ids: torch.Tensor,
    expert_end: torch.Tensor,
    rows: int,
    activation: str,
    alpha: float,
    limit: float,
    on_input: bool,
    config: MoEConfig,
    out_dtype: torch.dtype,
    scales: Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = None,
    src: Optional[torch.Tensor] = None,
    y_dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """Routed experts through the prefill kernels, on inputs kernels.launch.fused_moe checked.

    fp8 weights with static per-tensor scales (kernels.launch_quant): x is then fp8, the rows
    of triton_quant_rows (GRAN 4) that assignment a reads at src[a]; scales, four contiguous
    [E] fp32 tensors, the per-expert scales of x, w13, GEMM2's input (which GEMM1 stores as fp8)
    and w2 (read where they are: stacking them took a kernel a call); y_dtype is the float
    dtype of GEMM2's rows.

    Args:
        x: [T, H] (with scales: [T * k, H] fp8).  w13: [E, 2I or I, H].  w2: [E, H, I].
        b13: [E, 2I or I] or None.  b2: [E, H] or None.
        topk_weights: [T, k] fp32.  topk_ids: [T, k] int32.  expert_map: [E_global] int32 or None.
        sorted_ids, expert_end: launch.moe_align's rows at granule config.block_m // config.prefill.tail.
        rows: R, rows of that alignment (max_blocks * granule).
        activation, alpha, limit, on_input: as fused_moe.  config: tiles with a PrefillConfig.
        out_dtype: float32 or x's dtype.
    Returns:
        [T, H] in out_dtype.
    """
    pre = config.prefill
    g1, g2 = config.gemm1, config.gemm2
    BM = config.block_m
    T, k = topk_ids.shape
    H = x.shape[1]
    E, _, I = w2.shape
    TK = T * k
    R13 = w13.shape[1]
    dev = x.device
    scaled = scales is not None
    if scaled and (on_input or src is None or y_dtype is None):
        raise ValueError("the fp8 prefill kernels take src and y_dtype, and the routed weight on the output")
    if scaled and BM // pre.tail < FP8_MIN_TILE_ROWS:
        raise ValueError(f"fp8 prefill tiles need BLOCK_SIZE_M / prefill tail >= {FP8_MIN_TILE_ROWS}, got "
                         f"{BM} / {pre.tail}: shorter tiles multiply fp8 on other instructions, so a row's bits "
                         "would depend on the tile its slot lands in")
    act = torch.empty(rows, I, dtype=x.dtype, device=dev)
    y = torch.empty(TK, H, dtype=y_dtype if scaled else x.dtype, device=dev)
    bound_m = row_tiles_bound(TK, E, BM)
    e_pad = max(E_LANES, triton.next_power_of_2(E))
    common = dict(TAIL=pre.tail, FLATTEN=bool(pre.flatten), E_PAD=e_pad, TMA=pre.tma, ON_INPUT=on_input,
                  IEEE=x.dtype == torch.float32)
    bias13 = b13 if b13 is not None else x
    bias2 = b2 if b2 is not None else x
    p1 = _programs(bound_m * triton.cdiv(I, g1.BLOCK_SIZE_N), pre.programs_per_sm, dev)
    w13_desc = _weight_desc(w13, g1, pre.tma, "w13")
    # x_tma: x's rows in the sorted row order; padding rows (sentinel TK, or never written
    # past the last expert's rows) take some token's row and are not stored
    xg = x
    if pre.x_tma:
        rows_of = (src.index_select(0, sorted_ids[:rows].clamp(0, TK - 1)) if scaled  # src: set for local slots
                   else sorted_ids[:rows] // k)
        xg = x.index_select(0, rows_of.clamp_(0, x.shape[0] - 1))
    sx, sw13, sa2, sw2 = scales if scaled else (topk_weights,) * 4
    fold = scaled and b2 is None  # GEMM2's scales ride on the routed weights (see _gemm1_tile)
    w_y = torch.empty(TK, dtype=torch.float32, device=dev) if fold else topk_weights
    prefill_gemm1_kernel[(p1,)](
        xg, w13, w13_desc, bias13, act, topk_weights, sorted_ids, expert_end, src if scaled else sorted_ids, sx, sw13,
        sa2, sw2, w_y,
        I, H, TK, k, E, p1, R13, rows,
        xg.stride(0), w13.stride(0), w13.stride(1), bias13.stride(0) if b13 is not None else 0, act.stride(0),
        float(alpha), float(limit),
        BM=BM, BN=g1.BLOCK_SIZE_N, BK=g1.BLOCK_SIZE_K, GROUP_M=g1.GROUP_SIZE_M, X_TMA=pre.x_tma,
        GU1=bool(pre.gu1 and is_gated(activation)), SCALED=scaled, FOLD=fold, OUT_POLICY=store_policy(act),
        GATED=is_gated(activation), ACT=activation, HAS_BIAS=b13 is not None, num_warps=g1.num_warps,
        num_stages=g1.num_stages, **common)
    p2 = _programs(bound_m * triton.cdiv(H, g2.BLOCK_SIZE_N), pre.programs_per_sm, dev)
    prefill_gemm2_kernel[(p2,)](
        act, w2, _weight_desc(w2, g2, pre.tma, "w2"), bias2, y, w_y, sorted_ids, expert_end, sa2, sw2,
        H, I, TK, E, p2, H, rows,
        act.stride(0), w2.stride(0), w2.stride(1), bias2.stride(0) if b2 is not None else 0, y.stride(0),
        BM=BM, BN=g2.BLOCK_SIZE_N, BK=g2.BLOCK_SIZE_K, GROUP_M=g2.GROUP_SIZE_M, ACT_TMA=pre.act_tma,
        WS=bool(pre.ws and b2 is None), SCALED=scaled and not fold, OUT_POLICY=store_policy(y),
        HAS_BIAS=b2 is not None,
        num_warps=g2.num_warps, num_stages=g2.num_stages, **dict(common, FLATTEN=bool(pre.flatten and not pre.ws)))
    has_map = expert_map is not None
    return sum_over_k(y, topk_ids, expert_map if has_map else topk_ids, has_map, out_dtype)

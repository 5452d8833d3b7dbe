"""Triton kernels of the quantized experts for one token, on CUDA cores: the direct path of
triton_decode over quantized weights (no alignment, no sorted rows, two launches).

A token's k assignments need no sort: each GEMM1 program takes one (assignment, BN columns of
I), quantizes the token's row as the scheme says while it streams, dequantizes its weight
tiles in registers and reduces along K in fp32; each GEMM2 program takes BN columns of H and
walks the token's (slot, K block) iterations in order, so the sum over k happens in registers
(with SPLIT, a fixed-order sum of the splits' fp32 partials: triton_moe.split_sum). Every
value each program needs is in reach of its own loads, so nothing waits for another launch.

    gemv1_quant_kernel: act[a, n] = act(deq(x[a // k]) deq(W13[e_a])^T + b13[e_a])[n];
        stored in x's dtype, or fp8 with the static scale a2_scale[e_a] (OUT_STATIC), as the
        sorted GEMM1 stores it. Non-local assignments (expert -1) write nothing.
    gemv2_quant_kernel: out[t, n] = sum_j w[t, j] (deq(act[t*k+j]) deq(W2[e_j])^T + b2[e_j])[n].

Modes (constexpr), as the sorted kernels' (triton_moe_quant) where they share a name:
    AQ        activations: 0 float (weight-only schemes); 1 static per-expert scales (a_s[e]);
              2 one dynamic scale per row (amax / QMAX, 1 for a zero row; A_TENSOR: one for all
              of the token's local rows, per-tensor scales of a single token); 3 one dynamic
              scale per K group of BK columns (1x128 groups: BK is the group).
    A_INT8    activations quantized to int8 (else fp8 e4m3); QMAX their largest value.
    W_KSCALE  weight scales per K group [E, N / W_SROWS, K / KGROUP] (KGROUP a multiple of BK);
              else one per output channel, stride_sn = 0 for one per expert.
    W_INT4    two 4-bit values per byte along K (column 2j low nibble, 2j+1 high), offset 8
              unless HAS_ZERO; HAS_ZERO: uint8 zero points shaped like the weight scales.

The quantization is the sorted path's (triton_quant_rows): v / s rounded by to_quant; the
products are the dequantized values' in fp32, so results match the emulated reference within
the schemes' tolerances.

Letters: T tokens (one on this path), H hidden, I intermediate, E local experts, k slots.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .triton_align import local_expert
from .triton_moe import _MAX_TOP_K, _apply_act, _expert_of, split_iters, split_sum, zero_counters
from .triton_quant_rows import to_quant

__all__ = ["gemv1_quant_kernel", "gemv2_quant_kernel"]


@triton.jit
def _scale_of(m, QMAX: tl.constexpr):
    """A dynamic scale from an amax: amax / QMAX, 1 for an all-zero block (as triton_quant_rows)."""
    return tl.where(m > 0.0, m / QMAX, 1.0)


@triton.jit
def _deq_dot(w_rows, k0, ks, K, zero, xv, col_ok, W_INT4: tl.constexpr, HAS_ZERO: tl.constexpr,
             BK: tl.constexpr):
    """sum over the K block's columns of (q - zero or offset)[n, k] * xv[k], fp32 [BN]: weight rows
    w_rows [BN, 1] (packed bytes for W_INT4), xv [BK] the block's (quantized) activations."""
    if W_INT4:
        kh = tl.arange(0, BK // 2)
        q = tl.load(w_rows + k0 // 2 + kh[None, :], mask=col_ok[:, None] & (2 * kh + k0 < K)[None, :], other=0.0)
        x_even, x_odd = tl.split(tl.reshape(xv, [BK // 2, 2]))
        if HAS_ZERO:
            off = zero.to(tl.int32)[:, None]
        else:
            off = 8
        lo = ((q & 15).to(tl.int32) - off).to(tl.float32)
        hi = ((q >> 4).to(tl.int32) - off).to(tl.float32)
        return tl.sum(lo * x_even[None, :] + hi * x_odd[None, :], axis=1)
    q = tl.load(w_rows + k0 + ks[None, :], mask=col_ok[:, None] & (ks + k0 < K)[None, :], other=0.0)
    if HAS_ZERO:
        v = (q.to(tl.int32) - zero.to(tl.int32)[:, None]).to(tl.float32)
    else:
        v = q.to(tl.float32)
    return tl.sum(v * xv[None, :], axis=1)


@triton.jit
def _quant_block(v, s, AQ: tl.constexpr, QMAX: tl.constexpr, A_INT8: tl.constexpr):
    """(the block's activations as the products see them, the block's scale): v itself (AQ 0),
    v / s quantized (AQ 1, 2: s given), or v / amax-scale quantized (AQ 3)."""
    if AQ == 0:
        return v, 1.0
    if AQ == 3:
        s = _scale_of(tl.max(tl.abs(v), axis=0), QMAX)
    return to_quant(v / s, QMAX, A_INT8).to(tl.float32), s


@triton.jit
def _row_amax(row, n, K, BK: tl.constexpr):
    """max |row[:K]| (fp32), 0 when n == 0 (nothing read)."""
    ks = tl.arange(0, BK)
    m = tl.zeros([BK], dtype=tl.float32)
    for k0 in range(0, K, BK):
        m = tl.maximum(m, tl.abs(tl.load(row + k0 + ks, mask=(ks + k0 < K) & (ks * 0 + n > 0), other=0.0)
                                .to(tl.float32)))
    return tl.max(m, axis=0)


@triton.jit(do_not_specialize=["top_k", "n_cnt"])
def gemv1_quant_kernel(
    x_ptr, a_s_ptr, w_ptr, ws_ptr, wz_ptr, b_ptr, out_ptr, out_s_ptr, topk_w_ptr, ids_ptr, map_ptr, cnt_ptr,
    N, K, top_k, n_cnt,
    stride_xm, stride_we, stride_wn, stride_se, stride_sn, stride_be, stride_om,
    alpha, limit,
    BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr,
    GATED: tl.constexpr, ACT: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_MAP: tl.constexpr, ON_INPUT: tl.constexpr,
    AQ: tl.constexpr, QMAX: tl.constexpr, A_INT8: tl.constexpr, OUT_STATIC: tl.constexpr,
    W_KSCALE: tl.constexpr, W_SROWS: tl.constexpr, KGROUP: tl.constexpr, W_INT4: tl.constexpr,
    HAS_ZERO: tl.constexpr,
):
    """act[a, n] for n < N (= I) of assignment a = pid // cdiv(N, BN) (see the module docstring).

    x [T, K=H] float; a_s [E] static input scales (AQ 1); w13 [E, 2N or N, K / pack] with scales
    ws and zero points wz (strides stride_se, stride_sn); b13 [E, 2N or N]; out [T*k, N] in x's
    dtype, or fp8 with out_s [E] (OUT_STATIC). Clears GEMM2's n_cnt split counters.
    """
    zero_counters(cnt_ptr, n_cnt)
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BN)
    assign = pid // num_n
    e = _expert_of(ids_ptr, map_ptr, assign, HAS_MAP)
    if e < 0:  # not a local expert: no activation row
        return
    e64 = e.to(tl.int64)
    cols = (pid - assign * num_n) * BN + tl.arange(0, BN)
    col_ok = cols < N
    rows_g = tl.where(col_ok, cols, 0)
    rows_u = rows_g + N
    x_row = x_ptr + (assign // top_k).to(tl.int64) * stride_xm
    w_a = tl.load(topk_w_ptr + assign)
    w_in = 1.0
    if ON_INPUT:  # quantized inputs take the routed weight before rounding
        w_in = w_a
    w_e = w_ptr + e64 * stride_we
    wg_rows = w_e + rows_g.to(tl.int64)[:, None] * stride_wn
    wu_rows = w_e + rows_u.to(tl.int64)[:, None] * stride_wn
    sg = ws_ptr + e64 * stride_se + (rows_g // W_SROWS) * stride_sn
    su = ws_ptr + e64 * stride_se + (rows_u // W_SROWS) * stride_sn
    zg = wz_ptr + e64 * stride_se + (rows_g // W_SROWS) * stride_sn
    zu = wz_ptr + e64 * stride_se + (rows_u // W_SROWS) * stride_sn
    s_row = 1.0
    if AQ == 1:
        s_row = tl.load(a_s_ptr + e64)
    elif AQ == 2:
        s_row = _scale_of(_row_amax(x_row, 1, K, BK) * tl.abs(w_in), QMAX)
    ks = tl.arange(0, BK)
    acc_g = tl.zeros([BN], dtype=tl.float32)
    acc_u = tl.zeros([BN], dtype=tl.float32)
    zero_g = tl.zeros([BN], dtype=tl.uint8)
    zero_u = zero_g
    for k0 in tl.range(0, K, BK, num_stages=STAGES):
        v = tl.load(x_row + k0 + ks, mask=ks + k0 < K, other=0.0).to(tl.float32)
        if AQ != 0:
            v = v * w_in
        xv, s_blk = _quant_block(v, s_row, AQ, QMAX, A_INT8)
        if HAS_ZERO:
            zero_g = tl.load(zg + k0 // KGROUP)
        pg = _deq_dot(wg_rows, k0, ks, K, zero_g, xv, col_ok, W_INT4, HAS_ZERO, BK)
        if W_KSCALE:
            pg = pg * tl.load(sg + k0 // KGROUP)
        if AQ == 3:
            pg = pg * s_blk
        acc_g += pg
        if GATED:
            if HAS_ZERO:
                zero_u = tl.load(zu + k0 // KGROUP)
            pu = _deq_dot(wu_rows, k0, ks, K, zero_u, xv, col_ok, W_INT4, HAS_ZERO, BK)
            if W_KSCALE:
                pu = pu * tl.load(su + k0 // KGROUP)
            if AQ == 3:
                pu = pu * s_blk
            acc_u += pu
    if not W_KSCALE:
        acc_g = acc_g * tl.load(sg)
        if GATED:
            acc_u = acc_u * tl.load(su)
    if AQ == 1 or AQ == 2:
        acc_g = acc_g * s_row
        acc_u = acc_u * s_row
    if ON_INPUT and AQ == 0:  # (w x) W^T = w (x W^T)
        acc_g = acc_g * w_a
        acc_u = acc_u * w_a
    if HAS_BIAS:
        b_row = b_ptr + e64 * stride_be
        acc_g += tl.load(b_row + cols, mask=col_ok, other=0.0).to(tl.float32)
        if GATED:
            acc_u += tl.load(b_row + N + cols, mask=col_ok, other=0.0).to(tl.float32)
    if GATED:
        h = _apply_act(acc_g, acc_u, ACT, alpha, limit)
    else:
        h = _apply_act(acc_g, acc_g, ACT, alpha, limit)
    o_ptrs = out_ptr + assign.to(tl.int64) * stride_om + cols
    if OUT_STATIC:  # as the sorted GEMM1 stores GEMM2's fp8 input
        tl.store(o_ptrs, to_quant(h * (1.0 / tl.load(out_s_ptr + e64)), 448.0, False), mask=col_ok)
    else:
        tl.store(o_ptrs, h.to(out_ptr.dtype.element_ty), mask=col_ok)


@triton.jit(do_not_specialize=["top_k", "n_split"])
def gemv2_quant_kernel(
    a_ptr, a_s_ptr, w_ptr, ws_ptr, wz_ptr, b_ptr, out_ptr, part_ptr, cnt_ptr, topk_w_ptr, ids_ptr, map_ptr,
    N, K, top_k, n_split,
    stride_am, stride_we, stride_wn, stride_se, stride_sn, stride_be, stride_om, stride_ps,
    BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_MAP: tl.constexpr, ON_INPUT: tl.constexpr, SPLIT: tl.constexpr,
    AQ: tl.constexpr, A_TENSOR: tl.constexpr, QMAX: tl.constexpr, A_INT8: tl.constexpr,
    W_KSCALE: tl.constexpr, W_SROWS: tl.constexpr, KGROUP: tl.constexpr, W_INT4: tl.constexpr,
    HAS_ZERO: tl.constexpr,
):
    """out[t, n] for n < N (= H) of token t = pid // cdiv(N, BN), summed over its k slots in
    slot order (see the module docstring).

    act [T*k, K=I]: x's dtype, or fp8 with static scales a_s [E] (AQ 1); w2 [E, N, K / pack]
    with scales ws, zero points wz; b2 [E, N]; out [T, N] (fp32 or x's dtype). SPLIT:
    program_id(1) takes its share of the (slot, K block) iterations; fp32 partials
    [n_split, T, N] at part_ptr, one counter per output tile at cnt_ptr.
    """
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BN)
    t = pid // num_n
    cols = (pid - t * num_n) * BN + tl.arange(0, BN)
    col_ok = cols < N
    rows = tl.where(col_ok, cols, 0)
    ks = tl.arange(0, BK)
    slots = tl.arange(0, _MAX_TOP_K)
    slot_e = local_expert(ids_ptr, map_ptr, t * top_k + slots, slots < top_k, HAS_MAP)
    slot_w = tl.load(topk_w_ptr + t * top_k + slots, mask=slots < top_k, other=0.0)
    if ON_INPUT:  # the weight went on GEMM1's input
        slot_w = tl.where(slots < top_k, 1.0, 0.0)
    a_row = a_ptr + (t * top_k).to(tl.int64) * stride_am
    # Per-row scales: static (the slot's expert) or dynamic over the slot's row (or all local rows).
    slot_s = tl.full([_MAX_TOP_K], 1.0, tl.float32)
    if AQ == 1:
        slot_s = tl.load(a_s_ptr + tl.maximum(slot_e, 0), mask=slot_e >= 0, other=1.0)
    elif AQ == 2:
        amax = tl.zeros([_MAX_TOP_K], dtype=tl.float32)
        for j in range(0, top_k):
            e_j = tl.sum(tl.where(slots == j, slot_e, 0), axis=0)
            m = _row_amax(a_row + j * stride_am, (e_j >= 0).to(tl.int32), K, BK)
            amax = tl.where(slots == j, m, amax)
        if A_TENSOR:
            amax = tl.zeros([_MAX_TOP_K], dtype=tl.float32) + tl.max(amax, axis=0)
        slot_s = _scale_of(amax, QMAX)
    num_k = tl.cdiv(K, BK)
    it_lo, it_hi = split_iters(top_k, num_k, n_split, SPLIT)
    acc = tl.zeros([BN], dtype=tl.float32)
    for it in tl.range(it_lo, it_hi, num_stages=STAGES):
        j = it // num_k
        k0 = (it - j * num_k) * BK
        on_j = slots == j
        e = tl.sum(tl.where(on_j, slot_e, 0), axis=0)
        live = e >= 0
        e64 = tl.maximum(e, 0).to(tl.int64)
        v = tl.load(a_row + j.to(tl.int64) * stride_am + k0 + ks, mask=(ks + k0 < K) & (ks * 0 + e >= 0),
                    other=0.0).to(tl.float32)
        if AQ == 1:  # stored quantized by GEMM1: the values themselves
            xv = v
            s_blk = 1.0
        else:
            xv, s_blk = _quant_block(v, tl.sum(tl.where(on_j, slot_s, 0.0), axis=0), AQ, QMAX, A_INT8)
        srow = ws_ptr + e64 * stride_se + (rows // W_SROWS) * stride_sn
        zero = tl.zeros([BN], dtype=tl.uint8)
        if HAS_ZERO:
            zero = tl.load(wz_ptr + e64 * stride_se + (rows // W_SROWS) * stride_sn + k0 // KGROUP)
        p = _deq_dot(w_ptr + e64 * stride_we + rows.to(tl.int64)[:, None] * stride_wn, k0, ks, K, zero, xv,
                     col_ok & (cols * 0 + e >= 0), W_INT4, HAS_ZERO, BK)
        if W_KSCALE:
            p = p * tl.load(srow + k0 // KGROUP)
        else:
            p = p * tl.load(srow)
        scale = tl.sum(tl.where(on_j, slot_w, 0.0), axis=0)
        if AQ == 1 or AQ == 2:
            scale = scale * tl.sum(tl.where(on_j, slot_s, 0.0), axis=0)
        elif AQ == 3:
            scale = scale * s_blk
        acc += p * tl.where(live, scale, 0.0)
    o_mask = col_ok
    if SPLIT:
        last, acc = split_sum(acc, part_ptr, cnt_ptr, pid, n_split, t.to(tl.int64) * N + cols, col_ok, stride_ps)
        o_mask = tl.where(last, o_mask, False)
    if HAS_BIAS:
        for j in range(0, top_k):
            e = tl.sum(tl.where(slots == j, slot_e, 0), axis=0)
            bias = tl.load(b_ptr + tl.maximum(e, 0).to(tl.int64) * stride_be + cols,
                           mask=col_ok & (cols * 0 + e >= 0), other=0.0).to(tl.float32)
            acc += bias * tl.sum(tl.where(slots == j, slot_w, 0.0), axis=0)
    tl.store(out_ptr + t.to(tl.int64) * stride_om + cols, acc.to(out_ptr.dtype.element_ty), mask=o_mask)

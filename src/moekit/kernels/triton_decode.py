"""Triton kernels of the direct path (a handful of tokens) on CUDA cores: GEMM1 and GEMM2 of
triton_moe's direct layout without tl.dot.

With one live row per program, tl.dot pads it to 16 rows and stages both operands in shared
memory; here each program loads [BN, BK] weight tiles (K contiguous, so 16-byte loads along a
row), multiplies them by the row's K block broadcast over BN and reduces along K in fp32.
Nothing but the weights passes through shared memory (when tl.range pipelines the loads).

    gemv1_kernel: act[a, n] = act(x[a // k] W13[e_a]^T + b13[e_a])[n], one program per
        (assignment a, BN columns); non-local assignments (expert -1) write nothing.
    gemv2_kernel: out[t, n] = sum_j w[t, j] * (act[t*k+j] W2[e_j]^T + b2[e_j])[n], one program
        per (token t, BN columns) and split; with SPLIT the slots x K blocks of a token are
        shared by n_split programs and reduced in split order (triton_moe.split_sum).
    fused_gemv_kernel: both GEMMs of one (assignment a, BC columns of I) in one program: the
        activation block stays in registers and multiplies its w2 columns over all of H into an
        fp32 partial row; so GEMM2's weights stream in the same launch as GEMM1's and no
        program waits for another.  `partial_sum_kernel` (a second, small launch) adds each
        token's k * cdiv(I, BC) partial rows in order: deterministic, no atomics.

Letters: T tokens, H hidden, I intermediate, E local experts, k slots per token.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .triton_moe import (_expert_of, _gate_up_act, direct_slots, direct_w2_ahead, direct_w2_tile, split_iters,
                         split_sum, zero_counters)

__all__ = ["gemv1_kernel", "gemv2_kernel", "fused_gemv_kernel", "partial_sum_kernel"]


@triton.jit
def _act_block(x_row, w_rows, b_row, w_a, cols, col_ok, N, K, stride_wn, alpha, limit,
               BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr, GATED: tl.constexpr, ACT: tl.constexpr,
               HAS_BIAS: tl.constexpr, ON_INPUT: tl.constexpr):
    """act(x W^T + b)[cols] in fp32 for one row x_row [K] and weight rows w_rows [BN, 1] (gate; up N
    rows further when GATED) on CUDA cores; ON_INPUT scales the product by w_a before the bias."""
    ks = tl.arange(0, BK)
    acc_g = tl.zeros([BN], dtype=tl.float32)
    acc_u = tl.zeros([BN], dtype=tl.float32)
    for k0 in tl.range(0, K, BK, num_stages=STAGES):
        k_ok = ks + k0 < K
        xk = tl.load(x_row + k0 + ks, mask=k_ok, other=0.0).to(tl.float32)
        w_mask = col_ok[:, None] & k_ok[None, :]
        wg = tl.load(w_rows + k0 + ks[None, :], mask=w_mask, other=0.0)
        acc_g += tl.sum(wg.to(tl.float32) * xk[None, :], axis=1)
        if GATED:
            wu = tl.load(w_rows + N * stride_wn + k0 + ks[None, :], mask=w_mask, other=0.0)
            acc_u += tl.sum(wu.to(tl.float32) * xk[None, :], axis=1)
    b_gate = 0.0
    b_up = 0.0
    if HAS_BIAS:
        b_gate = tl.load(b_row + cols, mask=col_ok, other=0.0).to(tl.float32)
        if GATED:
            b_up = tl.load(b_row + N + cols, mask=col_ok, other=0.0).to(tl.float32)
    return _gate_up_act(acc_g, acc_u, w_a, b_gate, b_up, ACT, alpha, limit, GATED, ON_INPUT, HAS_BIAS)


@triton.jit(do_not_specialize=["top_k", "n_cnt"])
def gemv1_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr, topk_w_ptr, ids_ptr, map_ptr, cnt_ptr,
    N, K, top_k, n_cnt,
    stride_xm, stride_we, stride_wn, stride_be, stride_om,
    alpha, limit,
    BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr,
    GATED: tl.constexpr, ACT: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_MAP: tl.constexpr,
    ON_INPUT: tl.constexpr, PDL: tl.constexpr,
):
    """act[a, n] for n < N (= I) of assignment a = pid // cdiv(N, BN).

    x [T, K=H]; w13 [E, 2N or N, K]; b13 [E, 2N or N]; out [T*k, N] in x's dtype.
    Clears GEMM2's n_cnt split counters (none: n_cnt = 0).  PDL: let GEMM2 launch early.
    """
    zero_counters(cnt_ptr, n_cnt)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BN)
    assign = pid // num_n
    e = _expert_of(ids_ptr, map_ptr, assign, HAS_MAP)
    if e < 0:  # not a local expert: no activation row
        return
    cols = (pid - assign * num_n) * BN + tl.arange(0, BN)
    col_ok = cols < N
    x_row = x_ptr + (assign // top_k).to(tl.int64) * stride_xm
    w_rows = w_ptr + e.to(tl.int64) * stride_we + cols.to(tl.int64)[:, None] * stride_wn  # [BN, 1]
    w_a = tl.load(topk_w_ptr + assign)  # used when the weight goes on the input
    h = _act_block(x_row, w_rows, b_ptr + e.to(tl.int64) * stride_be, w_a, cols, col_ok, N, K, stride_wn, alpha, limit,
                   BN, BK, STAGES, GATED, ACT, HAS_BIAS, ON_INPUT)
    tl.store(out_ptr + assign.to(tl.int64) * stride_om + cols, h.to(out_ptr.dtype.element_ty), mask=col_ok)


@triton.jit
def _gemv2_step(acc, wt, a_row, it, it_hi, num_k, slots, slot_e, slot_w, ks, K, stride_am, BK: tl.constexpr):
    """acc + wt [BN, BK] times the weighted activation block of iteration `it` (a_row: the token's
    first activation row)."""
    j = it // num_k
    k0 = (it - j * num_k) * BK
    e = tl.sum(tl.where(slots == j, slot_e, 0), axis=0)
    k_ok = (ks + k0 < K) & (ks * 0 + e >= 0) & (ks * 0 + it < it_hi)
    av = tl.load(a_row + j.to(tl.int64) * stride_am + k0 + ks, mask=k_ok, other=0.0)
    av = av.to(tl.float32) * tl.sum(tl.where(slots == j, slot_w, 0.0), axis=0)
    return acc + tl.sum(wt.to(tl.float32) * av[None, :], axis=1)


@triton.jit(do_not_specialize=["top_k", "n_split"])
def gemv2_kernel(
    a_ptr, w_ptr, b_ptr, out_ptr, part_ptr, cnt_ptr, topk_w_ptr, ids_ptr, map_ptr,
    N, K, top_k, n_split,
    stride_am, stride_we, stride_wn, stride_be, stride_om, stride_ps,
    BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_MAP: tl.constexpr, ON_INPUT: tl.constexpr,
    SPLIT: tl.constexpr, PDL: tl.constexpr, PRE: tl.constexpr,
):
    """out[t, n] for n < N (= H) of token t = pid // cdiv(N, BN), summed over its k slots in order.

    act [T*k, K=I] (x's dtype); w2 [E, N, K]; b2 [E, N]; out [T, N] (fp32 or x's dtype).
    SPLIT: program_id(1) takes its share of the token's slots x K blocks; partials
    [n_split, T, N] fp32 at part_ptr (stride_ps per split), one counter per tile at cnt_ptr.
    PRE (0-2): the weight tiles of the program's first PRE iterations are loaded into registers
    before it waits for GEMM1 (PDL), so they stream while GEMM1's last programs run.
    """
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BN)
    t = pid // num_n
    pid_n = pid - t * num_n
    cols = pid_n * BN + tl.arange(0, BN)
    col_ok = cols < N
    ks = tl.arange(0, BK)
    slots, slot_e, slot_w = direct_slots(ids_ptr, map_ptr, topk_w_ptr, t, top_k, HAS_MAP, ON_INPUT)
    num_k = tl.cdiv(K, BK)
    it_lo, it_hi = split_iters(top_k, num_k, n_split, SPLIT)
    w_cols = w_ptr + cols.to(tl.int64)[:, None] * stride_wn  # [BN, 1]
    w_pre0, w_pre1 = direct_w2_ahead(w_cols, it_lo, it_hi, num_k, slots, slot_e, ks, col_ok, K, stride_we, BK, BN,
                                     False, PRE, PDL)
    a_row = a_ptr + (t * top_k).to(tl.int64) * stride_am
    acc = tl.zeros([BN], dtype=tl.float32)
    if PRE >= 1:
        acc = _gemv2_step(acc, w_pre0, a_row, it_lo, it_hi, num_k, slots, slot_e, slot_w, ks, K, stride_am, BK)
    if PRE >= 2:
        acc = _gemv2_step(acc, w_pre1, a_row, it_lo + 1, it_hi, num_k, slots, slot_e, slot_w, ks, K, stride_am, BK)
    for it in tl.range(it_lo + PRE, it_hi, num_stages=STAGES):
        wt = direct_w2_tile(w_cols, it, it_hi, num_k, slots, slot_e, ks, col_ok, K, stride_we, BK, False)
        acc = _gemv2_step(acc, wt, a_row, it, it_hi, num_k, slots, slot_e, slot_w, ks, K, stride_am, BK)
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


@triton.jit(do_not_specialize=["top_k"])
def fused_gemv_kernel(
    x_ptr, w13_ptr, b13_ptr, w2_ptr, b2_ptr, part_ptr, topk_w_ptr, ids_ptr, map_ptr,
    H, I, top_k,
    stride_xm, stride_w13e, stride_w13n, stride_b13e, stride_w2e, stride_w2n, stride_b2e, stride_pr,
    alpha, limit,
    BC: tl.constexpr, BK: tl.constexpr, BH: tl.constexpr, STAGES1: tl.constexpr, STAGES2: tl.constexpr,
    GATED: tl.constexpr, ACT: tl.constexpr, HAS_B13: tl.constexpr, HAS_B2: tl.constexpr,
    HAS_MAP: tl.constexpr, ON_INPUT: tl.constexpr, PDL: tl.constexpr, OUT_POLICY: tl.constexpr = "",
):
    """part[a * cdiv(I, BC) + c, :H] = w_a * act(x[a // k] W13[e_a, block c]^T + b13)_c W2[e_a][:, block c]^T
    (+ w_a b2[e_a] in block 0), for program pid = (assignment a, I block c).

    The activation is rounded to x's dtype before GEMM2, as the two-launch path stores it.
    Non-local assignments (expert -1) write zero rows.  part [T*k*cdiv(I, BC), H] fp32.
    PDL: let the partial sum launch early (it waits for this grid to finish).
    OUT_POLICY: L2 eviction policy of the partial rows' stores (triton_moe.store_policy).
    """
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    pid = tl.program_id(0)
    num_c = tl.cdiv(I, BC)
    assign = pid // num_c
    c = pid - assign * num_c
    e = _expert_of(ids_ptr, map_ptr, assign, HAS_MAP)
    part_row = part_ptr + pid.to(tl.int64) * stride_pr
    hs = tl.arange(0, BH)
    if e < 0:  # not a local expert: its share of the sum is zero
        for n0 in range(0, H, BH):
            tl.store(part_row + n0 + hs, tl.zeros([BH], dtype=tl.float32), mask=n0 + hs < H,
                     eviction_policy=OUT_POLICY)
        return
    cols = c * BC + tl.arange(0, BC)
    col_ok = cols < I
    x_row = x_ptr + (assign // top_k).to(tl.int64) * stride_xm
    w_rows = w13_ptr + e.to(tl.int64) * stride_w13e + cols.to(tl.int64)[:, None] * stride_w13n  # [BC, 1]
    w_a = tl.load(topk_w_ptr + assign)
    h = _act_block(x_row, w_rows, b13_ptr + e.to(tl.int64) * stride_b13e, w_a, cols, col_ok, I, H, stride_w13n,
                   alpha, limit, BC, BK, STAGES1, GATED, ACT, HAS_B13, ON_INPUT)
    if ON_INPUT:  # the weight went on the input: GEMM2 is unweighted
        w_a = 1.0
    h = tl.where(col_ok, h.to(x_ptr.dtype.element_ty).to(tl.float32) * w_a, 0.0)
    w2_cols = w2_ptr + e.to(tl.int64) * stride_w2e + cols[None, :]  # [1, BC]
    b_scale = tl.where(c == 0, w_a, 0.0)
    for n0 in tl.range(0, H, BH, num_stages=STAGES2):
        rows = n0 + hs
        row_ok = rows < H
        wt = tl.load(w2_cols + rows.to(tl.int64)[:, None] * stride_w2n, mask=row_ok[:, None] & col_ok[None, :],
                     other=0.0)
        y = tl.sum(wt.to(tl.float32) * h[None, :], axis=1)
        if HAS_B2:
            bias = tl.load(b2_ptr + e.to(tl.int64) * stride_b2e + rows, mask=row_ok & (rows * 0 + c == 0), other=0.0)
            y += bias.to(tl.float32) * b_scale
        tl.store(part_row + rows, y, mask=row_ok, eviction_policy=OUT_POLICY)


@triton.jit(do_not_specialize=["n_rows"])
def partial_sum_kernel(
    part_ptr, out_ptr, n_rows, N, stride_pr, stride_o,
    RB: tl.constexpr, BN: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr,
):
    """out[t, n] = the sum of part[t * n_rows + r, n] over r < n_rows in a fixed order (RB-row
    tiles added row-wise, then their RB rows); one program per (token t, BN columns).
    part fp32; out fp32 or x's dtype.  PDL: wait for the producing grid."""
    if PDL:
        tl.extra.cuda.gdc_wait()
    t = tl.program_id(0)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    n_ok = n < N
    rs = tl.arange(0, RB)
    base = part_ptr + (t.to(tl.int64) * n_rows) * stride_pr + n[None, :]
    acc = tl.zeros([RB, BN], dtype=tl.float32)
    for r0 in tl.range(0, n_rows, RB, num_stages=STAGES):
        r = r0 + rs
        acc += tl.load(base + r.to(tl.int64)[:, None] * stride_pr, mask=(r < n_rows)[:, None] & n_ok[None, :],
                       other=0.0)
    tl.store(out_ptr + t.to(tl.int64) * stride_o + n, tl.sum(acc, axis=0).to(out_ptr.dtype.element_ty), mask=n_ok)

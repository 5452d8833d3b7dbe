"""Triton kernels of the quantized experts: activation quantization and the two GEMMs over
fp8, int8 or int4 weights.

Rows as in the sorted path of triton_moe: triton_align groups the assignments by expert in
BM-row blocks; GEMM1 writes the activation at the sorted row, GEMM2 each assignment's
weighted output y [T*k, H], and triton_moe.sum_k_kernel adds a token's k rows in slot order.

Products accumulate in fp32 (int32 for int8 x int8, exact). A scale that is constant along
K (per tensor, expert, output channel or row) is applied once, after the K loop; one that
changes along K (128x128 weight blocks, 1x128 activation groups, weight groups of g
columns) multiplies each K tile's partial product, so a K tile never straddles two scale
groups (the launcher keeps BK <= the group; K is a multiple of it).

Modes (constexpr):
    A_QUANT   0: float activations (weight-only schemes): integer weights minus their zero
                 point (or the int4 offset 8) are converted to the activation dtype.
              1: activations quantized before the GEMM (an fp8 / int8 buffer with scales;
                 static per-expert scales: one row per assignment, A_BY_ASSIGN).
    A_KSCALE  activation scales per row and K group [rows, K/KGROUP]; else one per row at
              a_s_ptr + e * stride_ase + row * stride_asm (stride_asm = 0: one per tensor
              or per expert).
    W_KSCALE  weight scales per K group: [E, N/W_SROWS, K/KGROUP] (128x128 blocks: W_SROWS
              128; groups: 1); else one per output channel, stride_sn = 0 for one per expert.
    W_INT4    two 4-bit values per byte along K (column 2j low nibble, 2j+1 high): a K tile
              is read as packed bytes [BK/2, BN] and multiplied by the even and the odd
              columns of the activations in two products (no byte is loaded twice).
    HAS_ZERO  uint8 zero points shaped like the weight scales (weight-only groups).
    INT_DOT   int8 x int8 products in int32.

Letters: T tokens, H hidden, I intermediate, E local experts, k slots per token,
TK = T * k assignments, R rows of the activation buffer.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .triton_moe import _apply_act, _block_expert, _expert_of, _tile_ids

__all__ = ["quant_rows_kernel", "row_amax_kernel", "gemm1_quant_kernel", "gemm2_quant_kernel", "FP8_MAX", "INT8_MAX"]

FP8_MAX = 448.0
INT8_MAX = 127.0


@triton.jit
def _rne(v):
    """v (fp32, |v| < 2^22) rounded half to even: adding then removing 1.5 * 2^23 does it,
    as torch.round and torch's casts to float8 do."""
    return (v + 12582912.0) - 12582912.0


@triton.jit
def _to_q(v, QMAX: tl.constexpr, INT8: tl.constexpr):
    """Saturate v (fp32) to +-QMAX and round to int8 or fp8 e4m3, both to nearest even.

    fp8: v is rounded onto the e4m3 grid in fp32 first (3 mantissa bits: the step is
    2^(exponent - 3), and 2^-9 below 2^-6), so the cast itself is exact; Triton's CPU
    interpreter rounds casts to fp8 wrongly (ties away from even, and carries into the
    exponent lost), and this keeps GPU and interpreter bit-identical.
    """
    v = tl.minimum(tl.maximum(v, -QMAX), QMAX)
    if INT8:
        q = _rne(v).to(tl.int8)
    else:
        exp = tl.maximum((v.to(tl.int32, bitcast=True) >> 23) & 255, 121)  # biased; 121 = 2^-6
        step = ((exp - 3) << 23).to(tl.float32, bitcast=True)
        inv_step = ((257 - exp) << 23).to(tl.float32, bitcast=True)
        q = (_rne(v * inv_step) * step).to(tl.float8e4nv)
    return q


@triton.jit(do_not_specialize=["TK", "top_k", "E"])
def row_amax_kernel(
    x_ptr, amax_ptr, topk_w_ptr, ids_ptr, map_ptr, sorted_ptr, expert_end_ptr,
    K, TK, top_k, E, stride_x,
    BK: tl.constexpr, ON_INPUT: tl.constexpr, HAS_MAP: tl.constexpr, SORTED: tl.constexpr,
):
    """amax[r] = max |x[r, :]| over the rows that reach a local expert, 0 for the others.

    SORTED: rows of the activation buffer (valid: inside the experts' rows and not padding);
    else token rows (valid: some slot is local; the routed weight multiplies the row when
    ON_INPUT, k = 1). One program per row.
    """
    r = tl.program_id(0)
    if SORTED:
        valid = (r < tl.load(expert_end_ptr + E - 1)) & (tl.load(sorted_ptr + r) < TK)
    elif HAS_MAP:
        valid = r < 0
        for j in range(0, top_k):
            valid = valid | (tl.load(map_ptr + tl.load(ids_ptr + r * top_k + j)) >= 0)
    else:
        valid = r >= 0
    ks = tl.arange(0, BK)
    row = x_ptr + r.to(tl.int64) * stride_x
    amax = tl.zeros([BK], dtype=tl.float32)
    k_end = tl.where(valid, K, 0)  # an invalid row reads nothing and gives 0
    for k0 in range(0, K, BK):
        v = tl.load(row + k0 + ks, mask=ks + k0 < k_end, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(v))
    out = tl.max(amax, axis=0)
    if ON_INPUT:
        out = out * tl.abs(tl.load(topk_w_ptr + r))
    tl.store(amax_ptr + r, out)


@triton.jit(do_not_specialize=["E", "top_k"])
def quant_rows_kernel(
    x_ptr, q_ptr, s_ptr, topk_w_ptr, expert_end_ptr, ids_ptr, map_ptr,
    K, E, top_k, stride_x, stride_q, stride_s,
    BK: tl.constexpr, GRAN: tl.constexpr, QMAX: tl.constexpr, INT8: tl.constexpr,
    ON_INPUT: tl.constexpr, SORTED: tl.constexpr, HAS_MAP: tl.constexpr,
):
    """q[r] = quantize(x[r]) with a dynamic scale (amax / QMAX, 1 for an all-zero slice).

    GRAN 1: one scale for all rows, read from s_ptr[0]; 2: one per row, written to
    s[r * stride_s]; 3: one per row and BK columns, written to s[r * stride_s + k0 / BK];
    4: rows are assignments r = t * k + j, q[r] = x[t] quantized with the static scale
    s[e] of its local expert e (non-local assignments are left alone).
    SORTED: rows past the experts' rows are never read, so they are left alone.
    ON_INPUT: the routed weight of row r (k = 1) multiplies the row first.
    """
    r = tl.program_id(0)
    if SORTED:
        if r >= tl.load(expert_end_ptr + E - 1):
            return
    x_r = r
    if GRAN == 4:
        e = _expert_of(ids_ptr, map_ptr, r, HAS_MAP)
        if e < 0:
            return
        x_r = r // top_k
    ks = tl.arange(0, BK)
    row = x_ptr + x_r.to(tl.int64) * stride_x
    q_row = q_ptr + r.to(tl.int64) * stride_q
    w_r = 1.0
    if ON_INPUT:
        w_r = tl.load(topk_w_ptr + r)
    if GRAN == 1:
        s = tl.load(s_ptr)
    elif GRAN == 4:
        s = tl.load(s_ptr + e)
    elif GRAN == 2:
        amax = tl.zeros([BK], dtype=tl.float32)
        for k0 in range(0, K, BK):
            v = tl.load(row + k0 + ks, mask=ks + k0 < K, other=0.0).to(tl.float32) * w_r
            amax = tl.maximum(amax, tl.abs(v))
        m = tl.max(amax, axis=0)
        s = tl.where(m > 0.0, m / QMAX, 1.0)
        tl.store(s_ptr + r.to(tl.int64) * stride_s, s)
    for k0 in range(0, K, BK):
        ok = ks + k0 < K
        v = tl.load(row + k0 + ks, mask=ok, other=0.0).to(tl.float32) * w_r
        if GRAN == 3:
            m = tl.max(tl.abs(v), axis=0)
            s = tl.where(m > 0.0, m / QMAX, 1.0)
            tl.store(s_ptr + r.to(tl.int64) * stride_s + k0 // BK, s)
        tl.store(q_row + k0 + ks, _to_q(v / s, QMAX, INT8), mask=ok)


@triton.jit
def _int_weights(q, zero, HAS_ZERO: tl.constexpr, OFFSET: tl.constexpr, dtype: tl.constexpr):
    """Integer weights q minus their zero point [BN] (or the constant OFFSET), in dtype."""
    if HAS_ZERO:
        v = q.to(tl.int32) - zero.to(tl.int32)[None, :]
    elif OFFSET != 0:
        v = q.to(tl.int32) - OFFSET
    else:
        v = q
    return v.to(dtype)


@triton.jit
def _k_step(acc, a, a_odd, w_ptrs, w_mask, ws_ptrs, wz_ptrs, a_s_ptrs, a_ok, col_ok, kb,
            A_QUANT: tl.constexpr, A_KSCALE: tl.constexpr, W_KSCALE: tl.constexpr, W_INT4: tl.constexpr,
            HAS_ZERO: tl.constexpr, INT_DOT: tl.constexpr):
    """acc + a [BM, BK] @ W tile [BK, BN] (the tile's K-group scales applied to its product).

    W_INT4: a holds the even and a_odd the odd columns of the K tile [BM, BK/2]; the tile's
    bytes [BK/2, BN] hold the matching low and high nibbles.
    """
    q = tl.load(w_ptrs, mask=w_mask, other=0.0)
    zero = q
    if HAS_ZERO:
        zero = tl.load(wz_ptrs + kb, mask=col_ok, other=0)
    if A_KSCALE or W_KSCALE:  # every weight-only scheme has weight groups
        if W_INT4:
            part = tl.dot(a, _int_weights(q & 15, zero, HAS_ZERO, 8, a.dtype))
            part = tl.dot(a_odd, _int_weights(q >> 4, zero, HAS_ZERO, 8, a.dtype), part)
        elif A_QUANT == 0:
            part = tl.dot(a, _int_weights(q, zero, HAS_ZERO, 0, a.dtype))
        else:
            part = tl.dot(a, q)
        if W_KSCALE:
            part = part * tl.load(ws_ptrs + kb, mask=col_ok, other=0.0)[None, :]
        if A_KSCALE:
            part = part * tl.load(a_s_ptrs + kb, mask=a_ok, other=0.0)[:, None]
        out = acc + part
    elif INT_DOT:
        out = tl.dot(a, q, acc, out_dtype=tl.int32)
    else:
        out = tl.dot(a, q, acc)
    return out


@triton.jit
def _dequant(acc, a_s_ptrs, a_ok, ws_ptrs, col_ok,
             A_QUANT: tl.constexpr, A_KSCALE: tl.constexpr, W_KSCALE: tl.constexpr):
    """The K-constant scales of the finished product: per row (activations), per column (weights)."""
    out = acc.to(tl.float32)
    if A_QUANT != 0 and not A_KSCALE:
        out = out * tl.load(a_s_ptrs, mask=a_ok, other=0.0)[:, None]
    if not W_KSCALE:
        out = out * tl.load(ws_ptrs, mask=col_ok, other=0.0)[None, :]
    return out


@triton.jit
def _mainloop(a_row_ptrs, a_ok, a_s_ptrs, w_ptr, ws_ptr, wz_ptr, cols, col_ok, N, K,
              stride_wn, stride_sn,
              BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GATED: tl.constexpr,
              A_QUANT: tl.constexpr, A_KSCALE: tl.constexpr, W_KSCALE: tl.constexpr, W_SROWS: tl.constexpr,
              W_INT4: tl.constexpr, HAS_ZERO: tl.constexpr, INT_DOT: tl.constexpr, KGROUP: tl.constexpr):
    """Dequantized products of rows a [BM, K] with one expert's weight rows `cols` (and, GATED,
    rows N + cols): returns (gate, up), fp32 [BM, BN] each (up = gate when not GATED).

    a_row_ptrs [BM]: each row's start; a_ok [BM]: live rows; a_s_ptrs [BM]: each row's
    activation scales. w_ptr, ws_ptr, wz_ptr: the expert's weights, scales, zero points.
    """
    if W_INT4:
        kk = tl.arange(0, BK // 2)
        a_ptrs = a_row_ptrs[:, None] + 2 * kk[None, :]
        k_cols = 2 * kk
    else:
        kk = tl.arange(0, BK)
        a_ptrs = a_row_ptrs[:, None] + kk[None, :]
        k_cols = kk
    w_ptrs = w_ptr + cols[None, :].to(tl.int64) * stride_wn + kk[:, None]
    up_w = N * stride_wn
    s_rows = cols // W_SROWS
    ws_g = ws_ptr + s_rows * stride_sn
    wz_g = wz_ptr + s_rows * stride_sn
    ws_u = ws_g + N // W_SROWS * stride_sn
    wz_u = wz_g + N // W_SROWS * stride_sn
    if INT_DOT and not (A_KSCALE or W_KSCALE):
        acc_g = tl.zeros([BM, BN], dtype=tl.int32)
    else:
        acc_g = tl.zeros([BM, BN], dtype=tl.float32)
    acc_u = acc_g
    for k0 in range(0, K, BK):
        k_ok = k_cols + k0 < K
        a = tl.load(a_ptrs, mask=a_ok[:, None] & k_ok[None, :], other=0.0)
        a_odd = a
        if W_INT4:
            a_odd = tl.load(a_ptrs + 1, mask=a_ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & col_ok[None, :]
        kb = k0 // KGROUP
        acc_g = _k_step(acc_g, a, a_odd, w_ptrs, w_mask, ws_g, wz_g, a_s_ptrs, a_ok, col_ok, kb,
                        A_QUANT, A_KSCALE, W_KSCALE, W_INT4, HAS_ZERO, INT_DOT)
        if GATED:
            acc_u = _k_step(acc_u, a, a_odd, w_ptrs + up_w, w_mask, ws_u, wz_u, a_s_ptrs, a_ok, col_ok, kb,
                            A_QUANT, A_KSCALE, W_KSCALE, W_INT4, HAS_ZERO, INT_DOT)
        a_ptrs += BK
        if W_INT4:
            w_ptrs += BK // 2
        else:
            w_ptrs += BK
    gate = _dequant(acc_g, a_s_ptrs, a_ok, ws_g, col_ok, A_QUANT, A_KSCALE, W_KSCALE)
    if GATED:
        up = _dequant(acc_u, a_s_ptrs, a_ok, ws_u, col_ok, A_QUANT, A_KSCALE, W_KSCALE)
    else:
        up = gate
    return gate, up


@triton.jit(do_not_specialize=["TK", "top_k", "NUM_M", "E"])
def gemm1_quant_kernel(
    a_ptr, a_s_ptr, w_ptr, ws_ptr, wz_ptr, b_ptr, out_ptr, out_s_ptr,
    topk_w_ptr, sorted_ptr, expert_end_ptr,
    N, K, TK, top_k, NUM_M, E,
    stride_am, stride_asm, stride_ase, stride_we, stride_wn, stride_se, stride_sn, stride_be, stride_om,
    alpha, limit,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    GATED: tl.constexpr, ACT: tl.constexpr, HAS_BIAS: tl.constexpr, ON_INPUT: tl.constexpr,
    A_QUANT: tl.constexpr, A_KSCALE: tl.constexpr, W_KSCALE: tl.constexpr, W_SROWS: tl.constexpr,
    W_INT4: tl.constexpr, HAS_ZERO: tl.constexpr, INT_DOT: tl.constexpr, KGROUP: tl.constexpr,
    A_BY_ASSIGN: tl.constexpr, OUT_STATIC: tl.constexpr,
):
    """act[row, n] = act(dequant(a[token] W13[e]^T) + b13[e])[n] for n < N (= I).

    a [T, K=H] (float, or quantized with a_s), or [T*k, K] one row per assignment
    (A_BY_ASSIGN); w13 [E, 2N or N, K / pack]; b13 [E, 2N or N];
    out [R, N]: x's dtype, or fp8 quantized with the static scale out_s[e] (OUT_STATIC).
    """
    pid_m, pid_n = _tile_ids(NUM_M, N, BN, GROUP_M)
    e = _block_expert(expert_end_ptr, pid_m, E, BM)
    if e >= E:  # past the last expert's rows
        return
    rows = tl.arange(0, BM)
    assign = tl.load(sorted_ptr + pid_m * BM + rows)
    live = assign < TK
    token = tl.where(live, assign // top_k, 0).to(tl.int64)
    w_row = tl.load(topk_w_ptr + assign, mask=live, other=0.0)
    cols = pid_n * BN + tl.arange(0, BN)
    col_ok = cols < N
    e64 = e.to(tl.int64)
    if A_BY_ASSIGN:
        a_rows = tl.where(live, assign, 0).to(tl.int64)
    else:
        a_rows = token
    gate, up = _mainloop(
        a_ptr + a_rows * stride_am, live, a_s_ptr + e64 * stride_ase + a_rows * stride_asm,
        w_ptr + e64 * stride_we, ws_ptr + e64 * stride_se, wz_ptr + e64 * stride_se, cols, col_ok, N, K,
        stride_wn, stride_sn, BM, BN, BK, GATED, A_QUANT, A_KSCALE, W_KSCALE, W_SROWS, W_INT4,
        HAS_ZERO, INT_DOT, KGROUP)
    if ON_INPUT and A_QUANT == 0:
        # (w x) W^T = w (x W^T); quantized inputs had w applied before rounding.
        gate = gate * w_row[:, None]
        up = up * w_row[:, None]
    if HAS_BIAS:
        b_base = b_ptr + e64 * stride_be
        gate += tl.load(b_base + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        if GATED:
            up += tl.load(b_base + N + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    h = _apply_act(gate, up, ACT, alpha, limit)
    o_ptrs = out_ptr + (pid_m * BM + rows).to(tl.int64)[:, None] * stride_om + cols[None, :]
    if OUT_STATIC:
        tl.store(o_ptrs, _to_q(h / tl.load(out_s_ptr + e64), 448.0, False), mask=col_ok[None, :])
    else:
        tl.store(o_ptrs, h.to(out_ptr.dtype.element_ty), mask=col_ok[None, :])


@triton.jit(do_not_specialize=["TK", "NUM_M", "E"])
def gemm2_quant_kernel(
    a_ptr, a_s_ptr, w_ptr, ws_ptr, wz_ptr, b_ptr, out_ptr,
    topk_w_ptr, sorted_ptr, expert_end_ptr,
    N, K, TK, NUM_M, E,
    stride_am, stride_asm, stride_ase, stride_we, stride_wn, stride_se, stride_sn, stride_be, stride_om,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    HAS_BIAS: tl.constexpr, ON_INPUT: tl.constexpr,
    A_QUANT: tl.constexpr, A_KSCALE: tl.constexpr, W_KSCALE: tl.constexpr, W_SROWS: tl.constexpr,
    W_INT4: tl.constexpr, HAS_ZERO: tl.constexpr, INT_DOT: tl.constexpr, KGROUP: tl.constexpr,
):
    """y[a, n] = w[a] * (dequant(act[row] W2[e]^T) + b2[e])[n] (w left out when it went on the input).

    act [R, K=I] (float, or quantized with a_s indexed by row); w2 [E, N=H, K / pack]; y [TK, N].
    """
    pid_m, pid_n = _tile_ids(NUM_M, N, BN, GROUP_M)
    e = _block_expert(expert_end_ptr, pid_m, E, BM)
    if e >= E:  # past the last expert's rows
        return
    rows = tl.arange(0, BM)
    assign = tl.load(sorted_ptr + pid_m * BM + rows)
    live = assign < TK
    a_rows = (pid_m * BM + rows).to(tl.int64)
    cols = pid_n * BN + tl.arange(0, BN)
    col_ok = cols < N
    e64 = e.to(tl.int64)
    acc, _ = _mainloop(
        a_ptr + a_rows * stride_am, rows >= 0, a_s_ptr + e64 * stride_ase + a_rows * stride_asm,
        w_ptr + e64 * stride_we, ws_ptr + e64 * stride_se, wz_ptr + e64 * stride_se, cols, col_ok, N, K,
        stride_wn, stride_sn, BM, BN, BK, False, A_QUANT, A_KSCALE, W_KSCALE, W_SROWS, W_INT4,
        HAS_ZERO, INT_DOT, KGROUP)
    if HAS_BIAS:
        acc += tl.load(b_ptr + e64 * stride_be + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if not ON_INPUT:
        acc = acc * tl.load(topk_w_ptr + assign, mask=live, other=0.0)[:, None]
    o_ptrs = out_ptr + tl.where(live, assign, 0).to(tl.int64)[:, None] * stride_om + cols[None, :]
    tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=live[:, None] & col_ok[None, :])

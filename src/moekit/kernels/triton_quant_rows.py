"""Triton kernels around the quantized GEMMs: activation quantization (alone or in the
alignment's launch) and the fixed-order sum of GEMM2's rows over the k slots and K splits.

Activation quantization runs on a 2-D grid, one program per block of rows (about 4096 values;
one token for GRAN 4) and chunk of BC columns, so a row's groups are quantized side by side
rather than one after another (a decode step has few rows: a loop per row would leave the GPU
waiting on one load at a time), and short rows do not make thousands of tiny programs.

Modes of the quantized rows (GRAN):
    1  one scale for all rows, read from s[0] (per tensor, dynamic: computed beforehand);
    2  one dynamic scale per row (amax / QMAX, 1 for an all-zero row), written to s[r];
    3  one dynamic scale per row and G columns, written to s[r, c];
    4  static per-expert scales, one program per token t: when its local slots' experts share
       one scale (checkpoints often give every expert the same input scale), x[t] is
       quantized once, into the row of its first local slot, and every slot reads that row;
       otherwise each local slot j gets its own row t * k + j. src[t * k + j] records the
       row slot j reads (non-local slots: left alone), so GEMM1 gathers rows through it.
       Either way a slot's row holds x[t] quantized with its expert's scale: the same bits.
    5  no quantization: row r copied in the paired column order of the int4 products with
       QuantKnobs.w_convert "pairs" (triton_moe_quant.PAIRS_ORDER, within groups of eight
       columns), and the fp32 sum of each group of G columns written to s[r, g].

Letters: T tokens, H hidden, E local experts, k slots per token, TK = T * k assignments,
S splits of GEMM2's K range.
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import triton_align as align
from .triton_moe import INTERPRETED, MAX_TOP_K, _slot_mask

__all__ = ["FP8_MAX", "INT8_MAX", "fp8_grid_rne", "to_quant", "quant_groups", "to_pairs_order", "row_amax_kernel", "quant_rows_kernel",
           "align_quant_kernel", "sum_slots_kernel"]

FP8_MAX = 448.0
INT8_MAX = 127.0
# Slots per token GRAN 4 holds in registers (kernels/launch_quant.py checks top_k against it).
MAX_SLOTS: tl.constexpr = tl.constexpr(MAX_TOP_K)


@triton.jit
def _rne(v):
    """v (fp32, |v| < 2^22) rounded half to even: adding then removing 1.5 * 2^23 does it,
    as torch.round and torch's casts to float8 do."""
    return (v + 12582912.0) - 12582912.0


@triton.jit
def fp8_grid_rne(v):
    """v (fp32, |v| <= 448) rounded to nearest even onto the e4m3 grid, still fp32 (3 mantissa
    bits: the step is 2^(exponent - 3), and 2^-9 below 2^-6), so a cast to fp8 of the result is
    exact whatever rounding the cast does."""
    exp = tl.maximum((v.to(tl.int32, bitcast=True) >> 23) & 255, 121)  # biased; 121 = 2^-6
    step = ((exp - 3) << 23).to(tl.float32, bitcast=True)
    inv_step = ((257 - exp) << 23).to(tl.float32, bitcast=True)
    return _rne(v * inv_step) * step


@triton.jit
def to_quant(v, QMAX: tl.constexpr, INT8: tl.constexpr):
    """Saturate v (fp32) to +-QMAX and round to int8 or fp8 e4m3, both to nearest even.

    fp8: compiled for a GPU, the cast itself saturates to +-448 and rounds to nearest even (one
    conversion instruction for two values on SM89+, `satfinite`; a NaN stays NaN); Triton's CPU
    interpreter rounds casts to fp8 wrongly (ties away from even, and carries into the exponent
    lost), so there v is clamped and put on the e4m3 grid first (fp8_grid_rne, a dozen
    instructions a value). Both give the same values, a zero's sign aside (the grid rounds a
    tiny negative value to +0; a GPU test checks them against each other on ties, subnormals,
    saturated and infinite values).
    """
    if INT8:
        q = _rne(tl.minimum(tl.maximum(v, -QMAX), QMAX)).to(tl.int8)
    elif INTERPRETED:
        q = fp8_grid_rne(tl.minimum(tl.maximum(v, -QMAX), QMAX)).to(tl.float8e4nv)
    else:
        tl.static_assert(QMAX == 448.0, "the GPU's fp8 conversion saturates at 448")
        q = v.to(tl.float8e4nv, fp_downcast_rounding="rtne")
    return q


@triton.jit
def quant_groups(v, QMAX: tl.constexpr, INT8: tl.constexpr):
    """Values v [ROWS, NG, G] (fp32) quantized per group of G: (q [ROWS, NG, G], scales [ROWS, NG]),
    each group's scale max|v| / QMAX (1 for an all-zero group)."""
    m = tl.max(tl.abs(v), axis=2)
    s = tl.where(m > 0.0, m / QMAX, 1.0)
    return to_quant(v / s[:, :, None], QMAX, INT8), s


@triton.jit
def to_pairs_order(v, R: tl.constexpr, C: tl.constexpr):
    """Rows v [R, C] (C a multiple of 8) with their columns in triton_moe_quant.PAIRS_ORDER:
    column 8j + 4a + b goes to 8j + 2b + a."""
    return tl.reshape(tl.permute(tl.reshape(v, [R, C // 8, 2, 4]), [0, 1, 3, 2]), [R, C])


@triton.jit
def _expert_of(ids_ptr, map_ptr, assign, HAS_MAP: tl.constexpr):
    """Local expert (-1: not local) of one assignment index known to be < T*k."""
    gid = tl.load(ids_ptr + assign)
    if HAS_MAP:
        gid = tl.load(map_ptr + gid)
    return gid


@triton.jit(do_not_specialize=["TK", "top_k", "E"])
def row_amax_kernel(
    x_ptr, amax_ptr, topk_w_ptr, ids_ptr, map_ptr, sorted_ptr, expert_end_ptr,
    n_rows, K, TK, top_k, E, stride_x,
    BK: tl.constexpr, ON_INPUT: tl.constexpr, HAS_MAP: tl.constexpr, SORTED: tl.constexpr, ROWS: tl.constexpr,
):
    """amax[r] = max |x[r, :]| over the rows that reach a local expert, 0 for the others.

    SORTED: rows of the activation buffer (valid: inside the experts' rows and not padding);
    else token rows (valid: some slot is local; the routed weight multiplies the row when
    ON_INPUT, k = 1). ROWS rows a program (of the n_rows).
    """
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    in_range = r < n_rows
    if SORTED:
        valid = in_range & (r < tl.load(expert_end_ptr + E - 1))
        valid = valid & (tl.load(sorted_ptr + r, mask=valid, other=TK) < TK)
    elif HAS_MAP:
        valid = r < 0
        for j in range(0, top_k):
            gid = tl.load(ids_ptr + r * top_k + j, mask=in_range, other=0)
            valid = valid | (tl.load(map_ptr + gid, mask=in_range, other=-1) >= 0)
    else:
        valid = in_range
    ks = tl.arange(0, BK)[None, :]
    row = x_ptr + r.to(tl.int64)[:, None] * stride_x
    amax = tl.zeros([ROWS, BK], dtype=tl.float32)
    k_end = tl.where(valid, K, 0)[:, None]  # an invalid row reads nothing and gives 0
    for k0 in range(0, K, BK):
        v = tl.load(row + k0 + ks, mask=ks + k0 < k_end, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(v))
    out = tl.max(amax, axis=1)
    if ON_INPUT:
        out = out * tl.abs(tl.load(topk_w_ptr + r, mask=in_range, other=0.0))
    tl.store(amax_ptr + r, out, mask=in_range)


@triton.jit
def _quant_token_slots(x_ptr, q_ptr, s_ptr, topk_w_ptr, src_ptr, ids_ptr, map_ptr, t, c, K, top_k, stride_x,
                       stride_q, BC: tl.constexpr, QMAX: tl.constexpr, INT8: tl.constexpr, ON_INPUT: tl.constexpr,
                       HAS_MAP: tl.constexpr):
    """GRAN 4 for columns [c * BC, (c + 1) * BC) of token t (see the module docstring). ON_INPUT
    (k = 1): the slot's routed weight multiplies the row first."""
    # The row is loaded first: its load need not wait for the slots' ids and scales (two
    # dependent loads), which would otherwise make each program three load latencies long.
    ks = c * BC + tl.arange(0, BC)
    ok = ks < K
    v = tl.load(x_ptr + t.to(tl.int64) * stride_x + ks, mask=ok, other=0.0).to(tl.float32)
    slots = tl.arange(0, MAX_SLOTS)
    assign = t * top_k + slots
    e = align.local_expert(ids_ptr, map_ptr, assign, slots < top_k, HAS_MAP)
    local = e >= 0
    scale = tl.load(s_ptr + tl.maximum(e, 0), mask=local, other=0.0)
    first = tl.min(tl.where(local, slots, MAX_SLOTS), axis=0)
    if first < MAX_SLOTS:
        s0 = tl.sum(tl.where(slots == first, scale, 0.0), axis=0)
        shared = tl.max(tl.where(local & (scale != s0), 1, 0), axis=0) == 0
        if c == 0:
            src = tl.where(shared, t * top_k + first, assign)
            tl.store(src_ptr + assign, src.to(tl.int32), mask=local)
        if ON_INPUT:
            v = v * tl.load(topk_w_ptr + t * top_k + first)
        if shared:
            tl.store(q_ptr + (t * top_k + first).to(tl.int64) * stride_q + ks, to_quant(v / s0, QMAX, INT8), mask=ok)
        else:
            for j in range(0, top_k):
                s_j = tl.sum(tl.where(slots == j, scale, 0.0), axis=0)
                if s_j > 0.0:  # local (static scales are > 0)
                    tl.store(q_ptr + (t * top_k + j).to(tl.int64) * stride_q + ks, to_quant(v / s_j, QMAX, INT8),
                             mask=ok)


@triton.jit
def _quant_chunk(x_ptr, q_ptr, s_ptr, topk_w_ptr, src_ptr, ids_ptr, map_ptr, r0, n_rows, c, K, top_k, stride_x,
                 stride_q, stride_s,
                 BC: tl.constexpr, G: tl.constexpr, GRAN: tl.constexpr, QMAX: tl.constexpr, INT8: tl.constexpr,
                 ON_INPUT: tl.constexpr, HAS_MAP: tl.constexpr, ROWS: tl.constexpr):
    """Quantize columns [c * BC, (c + 1) * BC) of rows r0 .. r0 + ROWS - 1 below n_rows (GRAN 3 and 5:
    BC / G groups of G columns; GRAN 2: whole rows, c = 0, in chunks of BC; GRAN 4: r0 is a token,
    ROWS = 1). See the module docstring."""
    if GRAN == 4:
        tl.static_assert(ROWS == 1, "GRAN 4 quantizes one token per program")
        _quant_token_slots(x_ptr, q_ptr, s_ptr, topk_w_ptr, src_ptr, ids_ptr, map_ptr, r0, c, K, top_k, stride_x,
                           stride_q, BC, QMAX, INT8, ON_INPUT, HAS_MAP)
    else:
        rr = r0 + tl.arange(0, ROWS)
        row_ok = rr < n_rows
        row = x_ptr + rr.to(tl.int64)[:, None] * stride_x  # [ROWS, 1]
        q_row = q_ptr + rr.to(tl.int64)[:, None] * stride_q
        w_r = tl.full([ROWS, 1], 1.0, tl.float32)
        if ON_INPUT:
            w_r = tl.load(topk_w_ptr + rr, mask=row_ok, other=0.0)[:, None]
        if GRAN == 5:
            cols = c * BC + tl.arange(0, BC // G)[:, None] * G + tl.arange(0, G)[None, :]  # [BC/G, G]
            ok = row_ok[:, None, None] & (cols < K)[None, :, :]
            v = tl.load(row[:, :, None] + cols[None, :, :], mask=ok, other=0.0)
            groups = c * (BC // G) + tl.arange(0, BC // G)
            tl.store(s_ptr + rr.to(tl.int64)[:, None] * stride_s + groups[None, :], tl.sum(v.to(tl.float32), axis=2),
                     mask=row_ok[:, None] & (groups * G < K)[None, :])
            ks = c * BC + tl.arange(0, BC)
            tl.store(q_row + ks[None, :], to_pairs_order(tl.reshape(v, [ROWS, BC]), ROWS, BC),
                     mask=row_ok[:, None] & (ks < K)[None, :])
        elif GRAN == 3:
            cols = c * BC + tl.arange(0, BC // G)[:, None] * G + tl.arange(0, G)[None, :]  # [BC/G, G]
            ok = row_ok[:, None, None] & (cols < K)[None, :, :]
            v = tl.load(row[:, :, None] + cols[None, :, :], mask=ok, other=0.0).to(tl.float32) * w_r[:, :, None]
            q, s = quant_groups(v, QMAX, INT8)  # [ROWS, BC/G, G], [ROWS, BC/G]
            groups = c * (BC // G) + tl.arange(0, BC // G)
            tl.store(s_ptr + rr.to(tl.int64)[:, None] * stride_s + groups[None, :], s,
                     mask=row_ok[:, None] & (groups * G < K)[None, :])
            tl.store(q_row[:, :, None] + cols[None, :, :], q, mask=ok)
        else:
            ks = tl.arange(0, BC)[None, :]
            if GRAN == 1:
                s = tl.load(s_ptr) + tl.zeros([ROWS, 1], tl.float32)
            else:
                amax = tl.zeros([ROWS, BC], dtype=tl.float32)
                for k0 in range(0, K, BC):
                    v = tl.load(row + k0 + ks, mask=row_ok[:, None] & (ks + k0 < K), other=0.0).to(tl.float32) * w_r
                    amax = tl.maximum(amax, tl.abs(v))
                m = tl.max(amax, axis=1)
                s = tl.where(m > 0.0, m / QMAX, 1.0)
                tl.store(s_ptr + rr.to(tl.int64) * stride_s, s, mask=row_ok)
                s = s[:, None]
            k_lo = c * BC
            k_hi = tl.minimum(K, k_lo + BC)
            if GRAN == 2:
                k_hi = K
            for k0 in range(k_lo, k_hi, BC):
                ok = row_ok[:, None] & (ks + k0 < K)
                v = tl.load(row + k0 + ks, mask=ok, other=0.0).to(tl.float32) * w_r
                tl.store(q_row + k0 + ks, to_quant(v / s, QMAX, INT8), mask=ok)


@triton.jit(do_not_specialize=["E", "top_k"])
def quant_rows_kernel(
    x_ptr, q_ptr, s_ptr, topk_w_ptr, src_ptr, expert_end_ptr, ids_ptr, map_ptr,
    n_rows, K, E, top_k, stride_x, stride_q, stride_s,
    BC: tl.constexpr, G: tl.constexpr, GRAN: tl.constexpr, QMAX: tl.constexpr, INT8: tl.constexpr,
    ON_INPUT: tl.constexpr, SORTED: tl.constexpr, HAS_MAP: tl.constexpr, PDL: tl.constexpr, ROWS: tl.constexpr,
):
    """q[r] = quantize(x[r]) for the n_rows rows; grid (row blocks of ROWS, column chunks) (see
    _quant_chunk). Several rows a program keep each program's loads large when rows are short
    (GEMM1's output of 768 columns: a program per row left the GPU waiting on tiny programs).

    SORTED: rows at or past the experts' last row (expert_end[E - 1]) are never read, so
    they are left alone. ON_INPUT: the routed weight of row r (k = 1) multiplies the row first.
    PDL: launched as a programmatic dependent (SM90+): wait for the previous kernel first and
    let the next one launch at once.
    """
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    r0 = tl.program_id(0) * ROWS
    if SORTED:
        n_rows = tl.minimum(n_rows, tl.load(expert_end_ptr + E - 1))
    if r0 < n_rows:
        _quant_chunk(x_ptr, q_ptr, s_ptr, topk_w_ptr, src_ptr, ids_ptr, map_ptr, r0, n_rows, tl.program_id(1), K,
                     top_k, stride_x, stride_q, stride_s, BC, G, GRAN, QMAX, INT8, ON_INPUT, HAS_MAP, ROWS)


@triton.jit(do_not_specialize=["TK", "top_k"])
def align_quant_kernel(
    ids_ptr, map_ptr, sorted_ptr, expert_end_ptr, hist_ptr, keys_ptr,
    x_ptr, q_ptr, s_ptr, topk_w_ptr, src_ptr,
    TK, E, K, top_k, stride_x, stride_q, stride_s, NA, NCH,
    BM: tl.constexpr, N: tl.constexpr, E_PAD: tl.constexpr, HAS_MAP: tl.constexpr, SMALL: tl.constexpr,
    BC: tl.constexpr, G: tl.constexpr, GRAN: tl.constexpr, QMAX: tl.constexpr, INT8: tl.constexpr,
    ON_INPUT: tl.constexpr, PDL: tl.constexpr,
):
    """The alignment's first step and the quantization of x in one launch (grid NA + rows * NCH).

    NA programs align (SMALL: expert a's part of the one-launch alignment of N >= TK assignments,
    NA = E, E_PAD = triton_align.expert_bins(E); else triton_align.align_chunk_kernel for chunk a
    of N assignments, NA chunks, E_PAD >= E + 1); the
    others quantize row j // NCH, column chunk j % NCH of x (GRAN 2-4; GRAN 4: token rows). The
    quantizing programs come first on the one-launch path (its E aligning programs are short),
    last on the chunked one (its chunks lead to the second launch).
    PDL: let the next kernel (a programmatic dependent, SM90+) launch at once.
    """
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    pid = tl.program_id(0)
    nq = tl.num_programs(0) - NA
    a = pid - nq if SMALL else pid
    if a >= 0 and a < NA:
        if SMALL:
            align.align_expert(ids_ptr, map_ptr, sorted_ptr, expert_end_ptr, a, TK, E, BM, N, E_PAD, HAS_MAP)
        else:
            align.align_chunk_kernel(ids_ptr, map_ptr, hist_ptr, keys_ptr, TK, N, E_PAD, HAS_MAP)
    else:
        j = pid if SMALL else pid - NA
        _quant_chunk(x_ptr, q_ptr, s_ptr, topk_w_ptr, src_ptr, ids_ptr, map_ptr, j // NCH, j // NCH + 1, j % NCH, K,
                     top_k, stride_x, stride_q, stride_s, BC, G, GRAN, QMAX, INT8, ON_INPUT, HAS_MAP, 1)


@triton.jit(do_not_specialize=["top_k"])
def sum_slots_kernel(
    y_ptr, out_ptr, ids_ptr, map_ptr, N, top_k, stride_ys, stride_y, stride_o,
    S: tl.constexpr, BN: tl.constexpr, HAS_MAP: tl.constexpr, PDL: tl.constexpr, STAGES: tl.constexpr = None,
):
    """out[t, n] = sum over slots j = 0..k-1, then splits s = 0..S-1 (in that order) of
    y[s, t*k+j, n], skipping non-local slots; the sum is fp32. Grid (T, column blocks).

    y [S, TK, N] (x's dtype, or fp32 partials when S > 1); out [T, N] (fp32 or x's dtype).
    PDL: launched as a programmatic dependent (SM90+): waits for GEMM2 first.
    STAGES: slot loads kept in flight (None: Triton's default, no pipelining).
    """
    if PDL:
        tl.extra.cuda.gdc_wait()
    t = tl.program_id(0)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    n_ok = n < N
    acc = tl.zeros([BN], dtype=tl.float32)
    for j in tl.range(0, top_k, num_stages=STAGES):
        assign = t * top_k + j
        e = _expert_of(ids_ptr, map_ptr, assign, HAS_MAP)
        row = y_ptr + assign.to(tl.int64) * stride_y + n
        read = n_ok & _slot_mask(n * 0 + e, HAS_MAP)
        for s in tl.static_range(S):
            acc += tl.where(e >= 0, tl.load(row + s * stride_ys, mask=read, other=0.0).to(tl.float32), 0.0)
    tl.store(out_ptr + t.to(tl.int64) * stride_o + n, acc.to(out_ptr.dtype.element_ty), mask=n_ok)

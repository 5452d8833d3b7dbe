"""Triton kernels of the fused experts: GEMM1 (w13, activation fused), GEMM2 (w2, routed
weight applied) and the fixed-order sum over k.

Two row layouts, chosen by the launcher from the shapes alone:
    sorted (DIRECT=False): rows come from triton_align: each BM-row block holds the
        assignments of one expert (padded with the sentinel T*k). GEMM1 writes the
        activation at the sorted row; GEMM2 writes each assignment's weighted output
        y[a, :] (x's dtype) and `sum_k_kernel` adds the k rows of a token in order j = 0..k-1.
    direct (DIRECT=True, for a handful of tokens): no sorting at all. GEMM1 runs one
        program column per assignment; GEMM2 runs one per token and walks its k experts
        inside the K loop, so the sum over k is fused, deterministic and needs no third
        launch. Both use a BM-row tile with one live row: tl.dot needs 16 rows, and the
        weights, not the arithmetic, are what costs at this size (triton_decode has the
        same two GEMMs on CUDA cores, without the padding).

Split reduction (SPLIT, GEMM2 on either layout): n_split programs share one output tile,
each over its own range of the reduction (slots x K blocks on the direct path, K blocks on
the sorted one). Each writes its fp32 partial to a scratch buffer, then counts itself in on
the tile's counter; the last to arrive adds the partials in split order (so the result does
not depend on who finishes first) and writes the tile. The counters are cleared by GEMM1,
which always runs first, so they need no state across calls or graph replays.
PDL: GEMM1 lets GEMM2 launch early (programmatic dependent launch, SM90+); GEMM2 waits for
GEMM1's output before it reads it.

Letters: T tokens, H hidden, I intermediate, E local experts, k slots per token,
TK = T * k assignments, R rows of the activation buffer.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .triton_align import local_expert

__all__ = ["gemm1_kernel", "gemm2_kernel", "sum_k_kernel", "sum_over_k", "SUM_K_ROW_MAX", "pow2", "zero_counters", "split_sum",
           "KEEP_IN_L2_BYTES", "store_policy",
           "split_iters", "direct_slots", "direct_w2_tile", "direct_w2_ahead", "MAX_EXPERTS", "MAX_TOP_K"]

# Local experts the sorted path supports (one vector of expert ends per program).
MAX_EXPERTS = 1024
# Slots per token the direct path supports (their ids and weights are held in registers).
MAX_TOP_K = 32


def _interpreted() -> bool:
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")


# Kernels run in Triton's CPU interpreter (read when the kernels are defined, as triton.jit does):
# inline PTX cannot run there, and its casts to fp8 round otherwise.
INTERPRETED: tl.constexpr = tl.constexpr(_interpreted())
_MAX_EXPERTS: tl.constexpr = tl.constexpr(MAX_EXPERTS)
_MAX_TOP_K: tl.constexpr = tl.constexpr(MAX_TOP_K)


@triton.jit
def _rcp(x):
    """1 / x in fp32: on a GPU one approximate-reciprocal instruction (within 1 ulp; 0 for an
    infinite x), where a division would take a correctly rounded sequence; exact in the interpreter."""
    if INTERPRETED:
        return 1.0 / x
    else:
        return tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True,
                                         pack=1)


@triton.jit
def _tanh_approx(x):
    """tanh(x) in fp32 by the GPU's one-instruction approximation (relative error about 2^-11)."""
    return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _sigmoid(x, FAST: tl.constexpr = False):
    """1 / (1 + exp(-x)): an exponential and an approximate reciprocal (within 1 ulp). FAST, for
    activations rounded to 8 bits next: 0.5 + 0.5 tanh(x / 2), one approximate instruction
    (absolute error about 2.5e-4, far below an fp8 or int8 step), half the special-function
    work of the epilogues that bound the 8-bit GEMM1s at large M; exact in the interpreter."""
    if FAST and not INTERPRETED:
        return 0.5 * _tanh_approx(0.5 * x) + 0.5
    return _rcp(1.0 + tl.exp(-x))


@triton.jit
def _silu_mul_scaled(g, u, s_in, s_out, FAST: tl.constexpr):
    """silu(s_in g) u s_out for scalars s_in, s_out: the scaled GEMM1s fold their dequantization
    and their output's static scale into these two (s_out = s_in / the output's scale for the
    static fp8 one). FAST (see _sigmoid): silu(v) = h + h tanh(h) with h = v / 2, three multiplies,
    one fused multiply-add and the tanh a value, against seven multiplies, the fused one and the
    tanh unfolded; the 8-bit GEMM1s at large M are bound by this epilogue, which is not overlapped
    with their products."""
    if FAST and not INTERPRETED:
        h = g * (0.5 * s_in)
        return (h * _tanh_approx(h) + h) * u * s_out
    v = g * s_in
    return v * _sigmoid(v) * u * s_out


@triton.jit
def _apply_act(g, u, ACT: tl.constexpr, alpha, limit, FAST: tl.constexpr = False):
    """Activation in fp32: gated ones combine gate g and up u; "_no_mul" ones use g only.
    FAST: the result is rounded to 8 bits next (see _sigmoid)."""
    if ACT == "silu":
        return g * _sigmoid(g, FAST) * u
    elif ACT == "gelu":
        return 0.5 * g * (1.0 + tl.erf(g * 0.7071067811865476)) * u
    elif ACT == "gelu_tanh":
        inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        return 0.5 * g * (1.0 + (2.0 * _sigmoid(2.0 * inner, FAST) - 1.0)) * u
    elif ACT == "swigluoai":
        gc = tl.minimum(g, limit)
        uc = tl.minimum(tl.maximum(u, -limit), limit)
        return gc * _sigmoid(alpha * gc, FAST) * (uc + 1.0)
    elif ACT == "swiglu_limit":
        gc = tl.minimum(g, limit)
        uc = tl.minimum(tl.maximum(u, -limit), limit)
        return gc * _sigmoid(gc, FAST) * uc
    elif ACT == "swiglustep":
        uc = tl.minimum(tl.maximum(u, -limit), limit)
        return tl.minimum(g * _sigmoid(g, FAST), limit) * uc
    elif ACT == "silu_no_mul":
        return g * _sigmoid(g, FAST)
    elif ACT == "gelu_no_mul":
        return 0.5 * g * (1.0 + tl.erf(g * 0.7071067811865476))
    else:  # relu2_no_mul
        r = tl.maximum(g, 0.0)
        return r * r


@triton.jit
def _gate_up_act(acc_g, acc_u, w_in, b_gate, b_up, ACT: tl.constexpr, alpha, limit, GATED: tl.constexpr,
                 ON_INPUT: tl.constexpr, HAS_BIAS: tl.constexpr, FAST: tl.constexpr = False):
    """GEMM1's output from its gate and up products (acc_u unused unless GATED): the routed weight
    w_in first when it goes on the input ((w x) W^T = w (x W^T)), then the bias, then ACT. w_in,
    b_gate and b_up broadcast against the products."""
    if ON_INPUT:
        acc_g = acc_g * w_in
        if GATED:
            acc_u = acc_u * w_in
    if HAS_BIAS:
        acc_g += b_gate
        if GATED:
            acc_u += b_up
    if GATED:
        return _apply_act(acc_g, acc_u, ACT, alpha, limit, FAST)
    return _apply_act(acc_g, acc_g, ACT, alpha, limit, FAST)


@triton.jit
def _expert_of(ids_ptr, map_ptr, assign, HAS_MAP: tl.constexpr):
    """Local expert (-1: not local) of one assignment index known to be < T*k."""
    gid = tl.load(ids_ptr + assign)
    if HAS_MAP:
        return tl.load(map_ptr + gid)
    return gid


@triton.jit
def _block_expert(expert_end_ptr, pid_m, E, BM: tl.constexpr):
    """The expert whose padded rows hold row block pid_m (E when past the last one)."""
    ar = tl.arange(0, _MAX_EXPERTS)
    ends = tl.load(expert_end_ptr + ar, mask=ar < E, other=2147483647)
    return tl.sum((ends <= pid_m * BM).to(tl.int32), axis=0)


@triton.jit
def zero_counters(cnt_ptr, n_cnt):
    """Clear this program's share of n_cnt int32 counters (every program of a 1-D grid calls it)."""
    offs = tl.arange(0, 128)
    for c0 in range(tl.program_id(0) * 128, n_cnt, tl.num_programs(0) * 128):
        tl.store(cnt_ptr + c0 + offs, 0, mask=c0 + offs < n_cnt)


@triton.jit
def split_sum(acc, part_ptr, cnt_ptr, tile, n_split, offs, mask, stride_split):
    """Deterministic sum of one output tile over the n_split programs sharing it (program_id(1)).

    Stores acc (fp32) at part_ptr + split * stride_split + offs, counts in on cnt_ptr[tile]
    and returns (whether this program arrived last, the sum over splits 0..n_split-1 in
    order: valid in the last program only).
    """
    split = tl.program_id(1).to(tl.int64)
    tl.store(part_ptr + split * stride_split + offs, acc, mask=mask)
    # Every thread's partial is stored before one thread counts the program in (release);
    # the last program's acquire makes all partials of the tile visible to it.
    tl.debug_barrier()
    arrived = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
    last = arrived == n_split - 1
    total = tl.zeros_like(acc)
    if last:
        ptrs = part_ptr + offs
        for _ in range(0, n_split):
            total += tl.load(ptrs, mask=mask, other=0.0, cache_modifier=".cg")
            ptrs += stride_split
    return last, total


@triton.jit
def _grouped(t, num_m, num_n, GROUP_M: tl.constexpr):
    """Work item t -> (row block, column block), GROUP_M row blocks side by side so the
    weight tiles they share stay in L2."""
    per_group = GROUP_M * num_n
    first_m = (t // per_group) * GROUP_M
    group_rows = tl.minimum(num_m - first_m, GROUP_M)
    m = first_m + (t % per_group) % group_rows
    n = (t % per_group) // group_rows
    return m, n


@triton.jit
def _tile_ids(NUM_M, N, BN: tl.constexpr, GROUP_M: tl.constexpr):
    """Program id -> (row block, column block) of NUM_M row blocks and N columns (_grouped)."""
    return _grouped(tl.program_id(0), NUM_M, tl.cdiv(N, BN), GROUP_M)


@triton.jit
def _gate_up_bias(b_ptr, e, cols, col_ok, N, stride_be, BN: tl.constexpr, HAS_BIAS: tl.constexpr,
                  GATED: tl.constexpr):
    """Expert e's GEMM1 bias at columns `cols`: (gate part, up part) in fp32, zeros without a bias.
    The GEMMs load it before their K loop, so their epilogues do not wait for it."""
    b_gate = tl.zeros([BN], dtype=tl.float32)
    b_up = b_gate
    if HAS_BIAS:
        b_base = b_ptr + e.to(tl.int64) * stride_be
        b_gate = tl.load(b_base + cols, mask=col_ok, other=0.0).to(tl.float32)
        if GATED:
            b_up = tl.load(b_base + N + cols, mask=col_ok, other=0.0).to(tl.float32)
    return b_gate, b_up


@triton.jit
def _gemm2_operands(b_ptr, e, cols, b_mask, stride_be, topk_w_ptr, assign, live, BM: tl.constexpr,
                    BN: tl.constexpr, HAS_BIAS: tl.constexpr, ON_INPUT: tl.constexpr):
    """Expert e's GEMM2 bias at columns `cols` (where b_mask) and the rows' routed weights (unless
    they went on the input), fp32, zeros where there are none. The GEMMs load them before their K
    loop, so their epilogues do not wait for them."""
    bias = tl.zeros([BN], dtype=tl.float32)
    if HAS_BIAS:
        bias = tl.load(b_ptr + e.to(tl.int64) * stride_be + cols, mask=b_mask, other=0.0).to(tl.float32)
    route_w = tl.zeros([BM], dtype=tl.float32)
    if not ON_INPUT:
        route_w = tl.load(topk_w_ptr + assign, mask=live, other=0.0)
    return bias, route_w


@triton.jit(do_not_specialize=["TK", "top_k", "NUM_M", "E", "n_cnt"])
def gemm1_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr,
    topk_w_ptr, ids_ptr, map_ptr, sorted_ptr, expert_end_ptr, cnt_ptr,
    N, K, TK, top_k, NUM_M, E, n_cnt,
    stride_xm, stride_we, stride_wn, stride_be, stride_om,
    alpha, limit,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    DIRECT: tl.constexpr, GATED: tl.constexpr, ACT: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_MAP: tl.constexpr, ON_INPUT: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr,
    OUT_POLICY: tl.constexpr = "",
):
    """act[row, n] = act(x[token] W13[e]^T + b13[e])[n] for n < N (= I).

    x [T, K=H]; w13 [E, 2N or N, K]; b13 [E, 2N or N]; out [R, N] in x's dtype.
    Clears GEMM2's n_cnt split counters at cnt_ptr (none: n_cnt = 0).  PDL: let GEMM2 launch early.
    OUT_POLICY: L2 eviction policy of the stores (store_policy).
    """
    zero_counters(cnt_ptr, n_cnt)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    pid_m, pid_n = _tile_ids(NUM_M, N, BN, GROUP_M)
    rows = tl.arange(0, BM)
    if DIRECT:
        # One live row: assignment pid_m. Non-local assignments need no activation row.
        e = _expert_of(ids_ptr, map_ptr, pid_m, HAS_MAP)
        if e < 0:
            return
        assign = pid_m + rows * 0
        live = rows == 0
        out_rows = assign
    else:
        e = _block_expert(expert_end_ptr, pid_m, E, BM)
        if e >= E:  # past the last expert's rows
            return
        assign = tl.load(sorted_ptr + pid_m * BM + rows)
        live = assign < TK
        out_rows = pid_m * BM + rows
    token = tl.where(live, assign // top_k, 0).to(tl.int64)
    cols = pid_n * BN + tl.arange(0, BN)
    col_ok = cols < N
    ks = tl.arange(0, BK)
    a_ptrs = x_ptr + token[:, None] * stride_xm + ks[None, :]
    w_base = w_ptr + e.to(tl.int64) * stride_we
    g_ptrs = w_base + cols[None, :].to(tl.int64) * stride_wn + ks[:, None]
    # The epilogue's operands are loaded before the K loop, so it does not wait for them.
    w_row = tl.zeros([BM], dtype=tl.float32)
    if ON_INPUT:
        w_row = tl.load(topk_w_ptr + assign, mask=live, other=0.0)
    b_gate, b_up = _gate_up_bias(b_ptr, e, cols, col_ok, N, stride_be, BN, HAS_BIAS, GATED)
    acc_g = tl.zeros([BM, BN], dtype=tl.float32)
    acc_u = acc_g  # unused unless GATED
    if GATED:
        acc_u = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        k_ok = ks + k0 < K
        a = tl.load(a_ptrs, mask=live[:, None] & k_ok[None, :], other=0.0)
        wg = tl.load(g_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if IEEE:
            acc_g = tl.dot(a, wg, acc_g, input_precision="ieee")
        else:
            acc_g = tl.dot(a, wg, acc_g)
        if GATED:
            wu = tl.load(g_ptrs + N * stride_wn, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            if IEEE:
                acc_u = tl.dot(a, wu, acc_u, input_precision="ieee")
            else:
                acc_u = tl.dot(a, wu, acc_u)
        a_ptrs += BK
        g_ptrs += BK
    h = _gate_up_act(acc_g, acc_u, w_row[:, None], b_gate[None, :], b_up[None, :], ACT, alpha, limit, GATED, ON_INPUT,
                     HAS_BIAS)
    o_ptrs = out_ptr + out_rows.to(tl.int64)[:, None] * stride_om + cols[None, :]
    o_mask = col_ok[None, :]
    if DIRECT:
        o_mask = o_mask & live[:, None]
    tl.store(o_ptrs, h.to(out_ptr.dtype.element_ty), mask=o_mask, eviction_policy=OUT_POLICY)


@triton.jit
def direct_w2_tile(w_cols, it, it_hi, num_k, slots, slot_e, ks, col_ok, K, stride_we, BK: tl.constexpr,
                   KMAJOR: tl.constexpr):
    """The direct GEMM2's weight tile of iteration `it` (slot it // num_k, K block it % num_k):
    [BK, BN] for tl.dot (KMAJOR; w_cols [1, BN]) or [BN, BK] on CUDA cores (w_cols [BN, 1]);
    zeros past it_hi and for a non-local slot."""
    j = it // num_k
    k0 = (it - j * num_k) * BK
    e = tl.sum(tl.where(slots == j, slot_e, 0), axis=0)
    k_ok = (ks + k0 < K) & (ks * 0 + e >= 0) & (ks * 0 + it < it_hi)
    w_e = w_cols + tl.maximum(e, 0).to(tl.int64) * stride_we + k0
    if KMAJOR:
        tile = tl.load(w_e + ks[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
    else:
        tile = tl.load(w_e + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
    return tile


@triton.jit
def direct_w2_ahead(w_cols, it_lo, it_hi, num_k, slots, slot_e, ks, col_ok, K, stride_we, BK: tl.constexpr,
                    BN: tl.constexpr, KMAJOR: tl.constexpr, PRE: tl.constexpr, PDL: tl.constexpr):
    """Load the weight tiles of the first PRE (0-2) iterations, then wait for GEMM1 (PDL): they
    depend on nothing GEMM1 writes, so they stream during its tail. Returns two tiles; those
    past PRE are placeholders the caller does not use."""
    if PRE >= 1:
        w0 = direct_w2_tile(w_cols, it_lo, it_hi, num_k, slots, slot_e, ks, col_ok, K, stride_we, BK, KMAJOR)
    elif KMAJOR:
        w0 = tl.zeros([BK, BN], dtype=w_cols.dtype.element_ty)
    else:
        w0 = tl.zeros([BN, BK], dtype=w_cols.dtype.element_ty)
    if PRE >= 2:
        w1 = direct_w2_tile(w_cols, it_lo + 1, it_hi, num_k, slots, slot_e, ks, col_ok, K, stride_we, BK, KMAJOR)
    else:
        w1 = w0
    if PDL:
        tl.extra.cuda.gdc_wait()
    return w0, w1


@triton.jit
def direct_slots(ids_ptr, map_ptr, topk_w_ptr, t, top_k, HAS_MAP: tl.constexpr, ON_INPUT: tl.constexpr):
    """(slots, their local experts, their routed weights: 1 when the weight went on the input) of
    token t, held in registers: every weight address of the direct GEMM2's loop is then known
    without a dependent load, so the loads stream on across expert boundaries."""
    slots = tl.arange(0, _MAX_TOP_K)
    slot_e = local_expert(ids_ptr, map_ptr, t * top_k + slots, slots < top_k, HAS_MAP)
    if ON_INPUT:
        slot_w = tl.where(slots < top_k, 1.0, 0.0)
    else:
        slot_w = tl.load(topk_w_ptr + t * top_k + slots, mask=slots < top_k, other=0.0)
    return slots, slot_e, slot_w


@triton.jit
def split_iters(top_k, num_k, n_split, SPLIT: tl.constexpr):
    """[lo, hi) of the direct GEMM2's (slot, K block) iterations this program takes: all top_k *
    num_k, or its share when SPLIT (program_id(1) of n_split)."""
    it_lo = 0
    it_hi = top_k * num_k
    if SPLIT:
        per = tl.cdiv(it_hi, n_split)
        it_lo = tl.program_id(1) * per
        it_hi = tl.minimum(it_lo + per, it_hi)
    return it_lo, it_hi


@triton.jit
def _direct_step2(acc, wt, a_row, live, it, it_hi, num_k, slots, slot_e, slot_w, ks, K, stride_am, BK: tl.constexpr,
                  ON_INPUT: tl.constexpr, IEEE: tl.constexpr):
    """acc + the (weighted) activation block of iteration `it` times wt, on tensor cores (row 0 live)."""
    j = it // num_k
    k0 = (it - j * num_k) * BK
    e = tl.sum(tl.where(slots == j, slot_e, 0), axis=0)
    k_ok = (ks + k0 < K) & (ks * 0 + e >= 0) & (ks * 0 + it < it_hi)
    a = tl.load(a_row + j.to(tl.int64) * stride_am + k0 + ks[None, :], mask=live[:, None] & k_ok[None, :], other=0.0)
    if not ON_INPUT:
        a = (a.to(tl.float32) * tl.sum(tl.where(slots == j, slot_w, 0.0), axis=0)).to(a.dtype)
    if IEEE:
        return tl.dot(a, wt, acc, input_precision="ieee")
    return tl.dot(a, wt, acc)


@triton.jit(do_not_specialize=["TK", "top_k", "NUM_M", "E", "n_split"])
def gemm2_kernel(
    a_ptr, w_ptr, b_ptr, out_ptr, part_ptr, cnt_ptr,
    topk_w_ptr, ids_ptr, map_ptr, sorted_ptr, expert_end_ptr,
    N, K, TK, top_k, NUM_M, E, n_split,
    stride_am, stride_we, stride_wn, stride_be, stride_om, stride_ps,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    DIRECT: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_MAP: tl.constexpr,
    ON_INPUT: tl.constexpr, IEEE: tl.constexpr, SPLIT: tl.constexpr, PDL: tl.constexpr, PRE: tl.constexpr = 0,
    OUT_POLICY: tl.constexpr = "",
):
    """Down projection with the routed weight (unless it went on the input).

    sorted: y[a, n] = w[a] * (act[row] W2[e]^T + b2[e])[n], y [TK, N=H] in x's dtype.
    direct: out[t, n] = sum_j w[t, j] * (act[t*k+j] W2[e_j]^T + b2[e_j])[n], out [T, H] (fp32 or x's dtype).
    act [R, K=I]; w2 [E, N, K]; b2 [E, N].
    SPLIT: program_id(1) is this program's share of n_split (see split_sum); partials
    [n_split, rows, N] fp32 at part_ptr (stride_ps per split), one counter per tile at cnt_ptr.
    PRE (direct only, 0-2): the weight tiles of the first PRE iterations are loaded before the
    program waits for GEMM1 (PDL).
    """
    pid_m, pid_n = _tile_ids(NUM_M, N, BN, GROUP_M)
    rows = tl.arange(0, BM)
    cols = pid_n * BN + tl.arange(0, BN)
    col_ok = cols < N
    ks = tl.arange(0, BK)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    if DIRECT:
        # Token pid_m; iteration it covers slot j = it // num_k, K-block it % num_k.
        live = rows == 0
        slots, slot_e, slot_w = direct_slots(ids_ptr, map_ptr, topk_w_ptr, pid_m, top_k, HAS_MAP, ON_INPUT)
        num_k = tl.cdiv(K, BK)
        it_lo, it_hi = split_iters(top_k, num_k, n_split, SPLIT)
        w_cols = w_ptr + cols[None, :].to(tl.int64) * stride_wn  # [1, BN]
        w_pre0, w_pre1 = direct_w2_ahead(w_cols, it_lo, it_hi, num_k, slots, slot_e, ks, col_ok, K, stride_we, BK,
                                         BN, True, PRE, PDL)
        a_row = a_ptr + (pid_m * top_k).to(tl.int64) * stride_am + rows[:, None] * 0  # [BM, 1], row 0 live
        if PRE >= 1:
            acc = _direct_step2(acc, w_pre0, a_row, live, it_lo, it_hi, num_k, slots, slot_e, slot_w, ks, K, stride_am,
                                BK, ON_INPUT, IEEE)
        if PRE >= 2:
            acc = _direct_step2(acc, w_pre1, a_row, live, it_lo + 1, it_hi, num_k, slots, slot_e, slot_w, ks, K,
                                stride_am, BK, ON_INPUT, IEEE)
        for it in range(it_lo + PRE, it_hi):
            wt = direct_w2_tile(w_cols, it, it_hi, num_k, slots, slot_e, ks, col_ok, K, stride_we, BK, True)
            acc = _direct_step2(acc, wt, a_row, live, it, it_hi, num_k, slots, slot_e, slot_w, ks, K, stride_am, BK,
                                ON_INPUT, IEEE)
        o_mask = live[:, None] & col_ok[None, :]
        if SPLIT:
            tile = pid_m * tl.cdiv(N, BN) + pid_n
            last, acc = split_sum(acc, part_ptr, cnt_ptr, tile, n_split,
                                  pid_m.to(tl.int64) * N + rows[:, None] * 0 + cols[None, :], o_mask, stride_ps)
            o_mask = tl.where(last, o_mask, False)
        if HAS_BIAS:
            for j in range(0, top_k):
                e = tl.sum(tl.where(slots == j, slot_e, 0), axis=0)
                bias = tl.load(b_ptr + tl.maximum(e, 0).to(tl.int64) * stride_be + cols,
                               mask=col_ok & (cols * 0 + e >= 0), other=0.0).to(tl.float32)
                acc += (bias * tl.sum(tl.where(slots == j, slot_w, 0.0), axis=0))[None, :]
        o_ptrs = out_ptr + pid_m.to(tl.int64) * stride_om + rows[:, None] * 0 + cols[None, :]
        tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=o_mask, eviction_policy=OUT_POLICY)
    else:
        e = _block_expert(expert_end_ptr, pid_m, E, BM)
        if e >= E:  # past the last expert's rows
            return
        assign = tl.load(sorted_ptr + pid_m * BM + rows)
        live = assign < TK
        if PDL:
            tl.extra.cuda.gdc_wait()
        k_lo = 0
        k_hi = K
        if SPLIT:
            per = tl.cdiv(tl.cdiv(K, BK), n_split) * BK
            k_lo = tl.program_id(1) * per
            k_hi = tl.minimum(k_lo + per, K)
        a_ptrs = a_ptr + (pid_m * BM + rows).to(tl.int64)[:, None] * stride_am + k_lo + ks[None, :]
        w_ptrs = w_ptr + e.to(tl.int64) * stride_we + cols[None, :].to(tl.int64) * stride_wn + k_lo + ks[:, None]
        bias, route_w = _gemm2_operands(b_ptr, e, cols, col_ok, stride_be, topk_w_ptr, assign, live, BM, BN, HAS_BIAS,
                                        ON_INPUT)
        for k0 in range(k_lo, k_hi, BK):
            k_ok = ks + k0 < k_hi
            a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
            wt = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            if IEEE:
                acc = tl.dot(a, wt, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, wt, acc)
            a_ptrs += BK
            w_ptrs += BK
        o_mask = live[:, None] & col_ok[None, :]
        if SPLIT:
            tile = pid_m * tl.cdiv(N, BN) + pid_n
            last, acc = split_sum(acc, part_ptr, cnt_ptr, tile, n_split,
                                  (pid_m * BM + rows).to(tl.int64)[:, None] * N + cols[None, :], o_mask, stride_ps)
            o_mask = tl.where(last, o_mask, False)
        if HAS_BIAS:
            acc += bias[None, :]
        if not ON_INPUT:
            acc = acc * route_w[:, None]
        o_ptrs = out_ptr + tl.where(live, assign, 0).to(tl.int64)[:, None] * stride_om + cols[None, :]
        tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=o_mask, eviction_policy=OUT_POLICY)


@triton.jit
def _slot_mask(e, HAS_MAP: tl.constexpr):
    """Which slots of local expert e (-1: none) the sum over k reads y's rows for. Without an
    expert map every slot is read, without waiting for its expert id (a slot without an
    expert, whose row was never written, is read and dropped): a slot then costs one round
    trip through L2, not two. With a map most slots may be another rank's, so only local
    slots are read."""
    if HAS_MAP:
        return e >= 0
    return tl.zeros_like(e) == 0


@triton.jit(do_not_specialize=["T", "top_k"])
def sum_k_kernel(
    y_ptr, out_ptr, ids_ptr, map_ptr, T, N, top_k, stride_y, stride_o,
    BT: tl.constexpr, BN: tl.constexpr, HAS_MAP: tl.constexpr, STAGES: tl.constexpr = None,
):
    """out[t, n] = sum over j = 0..k-1 (in order) of y[t*k+j, n], skipping non-local slots.

    y [TK, N] (x's dtype); out [T, N] (fp32 or x's dtype; the sum is fp32).
    STAGES: loads of the slot loop kept in flight (None: Triton's default, no pipelining).
    """
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    t_ok = t < T
    n_ok = n < N
    acc = tl.zeros([BT, BN], dtype=tl.float32)
    for j in tl.range(0, top_k, num_stages=STAGES):
        assign = t * top_k + j
        e = local_expert(ids_ptr, map_ptr, assign, t_ok, HAS_MAP)
        v = tl.load(y_ptr + tl.where(t_ok, assign, 0).to(tl.int64)[:, None] * stride_y + n[None, :],
                    mask=_slot_mask(e, HAS_MAP)[:, None] & n_ok[None, :], other=0.0)
        acc += tl.where((e >= 0)[:, None], v.to(tl.float32), 0.0)
    tl.store(out_ptr + t.to(tl.int64)[:, None] * stride_o + n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=t_ok[:, None] & n_ok[None, :])


# Up to this many tokens the sum over k runs one token row per program.
SUM_K_ROW_MAX = 256


# Rows a kernel writes for the next kernel of the call to read (activation rows, GEMM2's rows,
# partial rows) up to this size are stored with L2's evict-last policy: during a
# decode GEMM's weight stream, dirty lines evicted to memory cost about 0.6-0.9 us per MB written
# (read-write turnarounds), and kept in L2 they are also where the reader finds them
# (bench/NOTES-triton.md, "What a decode GEMM could stream"). Larger buffers (prefill) keep the
# default policy: they cannot stay, and the prefill GEMMs need L2 for their weight tiles.
KEEP_IN_L2_BYTES = 16 * 2**20


def store_policy(t: torch.Tensor) -> str:
    """The L2 eviction policy of a kernel's stores into t, which the call's next kernel reads
    (see KEEP_IN_L2_BYTES; the layer's output keeps the default: kept in L2 it measured slower)."""
    return "evict_last" if t.numel() * t.element_size() <= KEEP_IN_L2_BYTES else ""


def pow2(n: int, lo: int = 16) -> int:
    """The power of two at or above n, and at least lo (a block width)."""
    return max(lo, triton.next_power_of_2(n))


def sum_over_k(y: torch.Tensor, topk_ids: torch.Tensor, emap: torch.Tensor, has_map: bool,
               out_dtype: torch.dtype) -> torch.Tensor:
    """[T, H] in out_dtype: each token's k rows of y [T * k, H] added in slot order (sum_k_kernel;
    emap: expert_map, or any int32 tensor when has_map is False)."""
    T, k = topk_ids.shape
    H = y.shape[1]
    out = torch.empty(T, H, dtype=out_dtype, device=y.device)
    bn = min(1024, pow2(H))
    if T <= SUM_K_ROW_MAX:
        # Few tokens: a program per token row keeps enough programs, and pipelined slot loads
        # keep enough bytes in flight (one [4, 1024] tile per program left most SMs waiting).
        bt, stages = 1, 4
    else:
        # Three slot loads in flight: 3.0 -> 3.7 TB/s at 4096 tokens of H = 2048, 3.8 -> 4.35 at
        # DeepSeek-V3's 16384 (bench/sum_k_h200.py, bench/results/h200-sum-k.json).
        bt, stages = max(1, 4096 // bn), 3
    sum_k_kernel[(triton.cdiv(T, bt), triton.cdiv(H, bn))](
        y, out, topk_ids, emap, T, H, k, y.stride(0), out.stride(0),
        BT=bt, BN=bn, HAS_MAP=has_map, STAGES=stages, num_warps=4)
    return out

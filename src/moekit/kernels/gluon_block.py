"""Block-scaled fp8 experts on Hopper, in Gluon: each K block's promotion overlapped with the next product.

The "fp8_w8a8_block128" scheme (DeepSeek-V3's: weights in 128 x 128 blocks, activations in
1 x 128 groups, each with its fp32 scale) needs every K block's product scaled before it joins
the accumulator. Triton 3.6 waits for each warpgroup product before that multiply-add, which
keeps the tensor cores below half their fp8 rate (bench/NOTES-triton.md, "Block-scaled fp8 in
Triton 3.6"). Gluon makes the waits explicit; per K step of 128 (one scale block) a program

    issues the step's product into a fresh accumulator (asynchronous);
    waits until only that product is in flight, so the previous step's product is done;
    refills the freed shared-memory stage with a later step's TMA loads;
    promotes the previous product, acc += prev * a_s[rows, k] * w_s[block, k], on the CUDA
    cores while this step's product runs on the tensor cores.

Steps go in pairs with two accumulators, so a product in flight is never copied (a copy makes
ptxas wait for every product). One program per SM walks its (row tile, column tile) items as
one flat sequence of K steps through a ring of NUM_BUF stages, so an item's first loads are in
flight during the previous item's last product and epilogue. An item's expert comes from the
alignment's padded expert ends, read once per program.

Pipeline (launch_quant.fused_moe_quant, knob `gluon`; no host synchronisation):
    align (+ x quantized per 128 columns) -> gather_rows (x's rows in sorted order, for TMA)
    -> gemm1 (gate and up products, silu(gate) * up stored in x's dtype) -> quantize_rows
    -> gemm2 (routed weight applied, rows stored by assignment) -> sum over k.

Shapes: H and I multiples of 256 (K steps in pairs), I of 128; row tiles of 64 (4 warps) or 128
(8 warps) rows, the alignment's granule. Gluon kernels do not run under the Triton interpreter;
the CPU tests compile them for sm_90a (bench/sass_offline.py) and check their schedule.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from .tuning import on_hopper

try:  # Gluon's Hopper module (triton >= 3.5)
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    # TMA loads into shared memory: async_load from triton 3.7, async_copy_global_to_shared before
    _tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared
    GLUON_MISSING: Optional[str] = None
except ImportError as err:  # pragma: no cover - depends on the installed triton
    GLUON_MISSING = f"this triton ({triton.__version__}) has no Gluon Hopper module ({type(err).__name__}: {err})"

__all__ = ["ROW_TILES", "GLUON_MISSING", "default_rows", "refusal", "gather_rows", "gemm1", "gemm2"]

# Row tile -> warps (one 16-row slice of the tile a warp).
ROW_TILES = {64: 4, 128: 8}
GROUP_M = 8  # row tiles that take a column tile in turn (the weight block read once from DRAM for them)
NUM_BUF = 4  # shared-memory stages: 32 KB each (GEMM1: x block + gate and up blocks; GEMM2: 128-row blocks)
GEMM1_COLS = 64  # activation columns an item of GEMM1 (gate and up: 128 weight rows)
GEMM2_COLS = 128  # output columns an item of GEMM2 (one weight scale block)


def default_rows(T: int, E: int, k: int, H: int, I: int, scheme, device: Optional[str]) -> int:
    """The row tile of an untuned call of the 128 x 128 block scheme (0: the Triton tiles), by rows
    an expert: none below 32 (weight streaming, where the Triton decode tiles are as fast or
    faster), 64 from 32, 128 from 64 (bench/results/h200-gluon-block-ab-shapes.json and
    h200-gluon-block-ab-edges.json: five shapes, M = 64 to 16384). None off Hopper (device: the
    CUDA device's table name, None on CPU), or where the shapes do not fit the kernels."""
    if (not on_hopper(device) or GLUON_MISSING or H % 256 or I % 256
            or scheme.weight_granularity != "block" or tuple(scheme.weight_block) != (128, 128)
            or scheme.activation_granularity != "group"):
        return 0
    rows_per_expert = T * k / E
    return 0 if rows_per_expert < 32 else 64 if rows_per_expert < 64 else 128


def refusal(scheme, x_dtype: torch.dtype, device: torch.device, activation: str, has_bias: bool, on_input: bool,
            static: bool, H: int, I: int, rows: int) -> Optional[str]:
    """Why the Gluon kernels cannot run this call, as a sentence, or None."""
    if rows not in ROW_TILES:
        return f"the row tile must be one of {sorted(ROW_TILES)}, got {rows}"
    if not (scheme.weight_dtype == "fp8_e4m3" and scheme.weight_granularity == "block"
            and tuple(scheme.weight_block) == (128, 128) and scheme.activation_granularity == "group"
            and scheme.activation_group == 128) or static:
        return f"they run 128 x 128 fp8 weight blocks with dynamic 1 x 128 activation groups, got {scheme.name!r}"
    if x_dtype not in (torch.bfloat16, torch.float16):
        return f"x must be bfloat16 or float16, got {x_dtype}"
    if activation != "silu":
        return f"their GEMM1 epilogue is silu(gate) * up, got activation {activation!r}"
    if has_bias or on_input:
        return "they take no biases and no router weight on the input"
    if H % 256 or I % 256:
        return f"H and I must be multiples of 256 (K steps of 128 in pairs), got H={H}, I={I}"
    if GLUON_MISSING:
        return GLUON_MISSING
    if device.type != "cuda" or torch.cuda.get_device_capability(device)[0] != 9:
        got = device.type if device.type != "cuda" else f"compute capability {torch.cuda.get_device_capability(device)}"
        return f"they use Hopper's warpgroup products and TMA: they need compute capability 9.x, got {got}"
    return None


@triton.jit
def sorted_rows_kernel(sorted_ptr, expert_end_ptr, row_of_ptr, out_ptr, outs_ptr, E, TK, H, G, stride_o, stride_os,
                       BR: tl.constexpr, BH: tl.constexpr, BG: tl.constexpr):
    """Sorted rows [BR program_id(0), + BR): each live row's number to row_of[its assignment];
    padding rows (sentinel assignments) zeroed, with their scales; rows past the last expert's
    padded end left alone."""
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    inside = rows < tl.load(expert_end_ptr + E - 1)
    a = tl.load(sorted_ptr + rows, mask=inside, other=TK)
    tl.store(row_of_ptr + a, rows, mask=inside & (a < TK))
    pad = inside & (a >= TK)
    r64 = rows.to(tl.int64)
    cols = tl.arange(0, BH)
    for h0 in range(0, H, BH):
        c = h0 + cols
        tl.store(out_ptr + r64[:, None] * stride_o + c[None, :], tl.zeros([BR, BH], dtype=tl.uint8),
                 mask=pad[:, None] & (c < H)[None, :])
    g = tl.arange(0, BG)
    tl.store(outs_ptr + r64[:, None] * stride_os + g[None, :], tl.zeros([BR, BG], dtype=tl.float32),
             mask=pad[:, None] & (g < G)[None, :])


@triton.jit
def scatter_rows_kernel(a_ptr, as_ptr, out_ptr, outs_ptr, row_of_ptr, k, H, G, stride_a, stride_as, stride_o,
                        stride_os, K_PAD: tl.constexpr, BH: tl.constexpr, BG: tl.constexpr):
    """Token program_id(0)'s quantized row and scales, read once, to the sorted rows of its k
    assignments (row_of; -1: another rank's expert, not stored)."""
    t = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, K_PAD)
    dst = tl.load(row_of_ptr + t * k + j, mask=j < k, other=-1)
    live = dst >= 0
    d64 = dst.to(tl.int64)
    cols = tl.arange(0, BH)
    for h0 in range(0, H, BH):
        c = h0 + cols
        v = tl.load(a_ptr + t * stride_a + c, mask=c < H, other=0)
        tl.store(out_ptr + d64[:, None] * stride_o + c[None, :], tl.broadcast_to(v[None, :], [K_PAD, BH]),
                 mask=live[:, None] & (c < H)[None, :])
    g = tl.arange(0, BG)
    sv = tl.load(as_ptr + t * stride_as + g, mask=g < G, other=0.0)
    tl.store(outs_ptr + d64[:, None] * stride_os + g[None, :], tl.broadcast_to(sv[None, :], [K_PAD, BG]),
             mask=live[:, None] & (g < G)[None, :])


def gather_rows(a1: torch.Tensor, a1_s: torch.Tensor, sorted_ids: torch.Tensor, expert_end: torch.Tensor, k: int,
                R: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """x's quantized rows a1 [T, H] and scales a1_s [T, H / 128] in the alignment's sorted order
    ([R, H], [R, H / 128]; zeros on padding rows, rows past the last expert's padded end left
    unwritten): GEMM1's A operand by TMA, which cannot gather rows on Hopper.

    Two launches: each sorted row's number to its assignment (and the padding rows zeroed), then
    one program a token that reads its row once and writes it to its k sorted rows: DeepSeek-V3
    at 16384 tokens 350-360 us on an H200, where one program a sorted row, reading each token's
    row k times, took 486-500 (bench/NOTES-triton.md, "x's rows scattered by token")."""
    T, H = a1.shape
    E = expert_end.shape[0]
    out = torch.empty(R, H, dtype=a1.dtype, device=a1.device)
    outs = torch.empty(R, a1_s.shape[1], dtype=torch.float32, device=a1.device)
    if R:
        G = a1_s.shape[1]
        BG, BH = triton.next_power_of_2(G), min(1024, triton.next_power_of_2(H))
        row_of = torch.full((T * k,), -1, dtype=torch.int32, device=a1.device)
        BR = 16
        sorted_rows_kernel[(triton.cdiv(R, BR),)](sorted_ids, expert_end, row_of, out.view(torch.uint8), outs, E,
                                                  T * k, H, G, out.stride(0), outs.stride(0), BR=BR,
                                                  BH=BH, BG=BG, num_warps=4)
        if T:
            scatter_rows_kernel[(T,)](a1.view(torch.uint8), a1_s, out.view(torch.uint8), outs, row_of, k, H, G,
                                      a1.stride(0), a1_s.stride(0), out.stride(0), outs.stride(0),
                                      K_PAD=triton.next_power_of_2(k), BH=BH, BG=BG, num_warps=4)
    return out, outs


if GLUON_MISSING is None:

    @gluon.jit
    def _add(a, b):
        return a + b

    @gluon.jit
    def _schedule(expert_end_ptr, E, BM: gl.constexpr, E_PAD: gl.constexpr, LANES: gl.constexpr):
        """Per expert lane: row tiles ending there (cumulative), the row base of its tiles, its
        padded end row; and the number of row tiles."""
        lanes = gl.arange(0, E_PAD, layout=LANES)
        ends = gl.load(expert_end_ptr + lanes, mask=lanes < E, other=0)
        starts = gl.load(expert_end_ptr + lanes - 1, mask=(lanes >= 1) & (lanes < E), other=0)
        tiles = (ends - starts + BM - 1) // BM
        tile_end = gl.associative_scan(tiles, 0, _add)
        return tile_end, starts - (tile_end - tiles) * BM, ends, gl.sum(tiles, axis=0)

    @gluon.jit
    def _program(expert_end_ptr, E, N, K, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, E_PAD: gl.constexpr,
                 LANES: gl.constexpr):
        """This program's place in the persistent grid and its work: (pid, programs, the expert
        schedule of _schedule, row tiles, column tiles, K steps an item, this program's steps)."""
        pid = gl.program_id(0)
        programs = gl.num_programs(0)
        tile_end, row_base, ends, num_m = _schedule(expert_end_ptr, E, BM, E_PAD, LANES)
        num_n = N // BN
        KT = K // BK
        steps = gl.maximum(gl.cdiv(num_m * num_n - pid, programs), 0) * KT
        return pid, programs, tile_end, row_base, ends, num_m, num_n, KT, steps

    @gluon.jit
    def _ring_barriers(NUM_BUF: gl.constexpr):
        """One mbarrier a stage of the ring: its TMA loads landed."""
        bars = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(NUM_BUF):
            mbarrier.init(bars.index(i), count=1)
        return bars

    @gluon.jit
    def _item(q, pid, programs, num_m, num_n, tile_end, row_base, ends,
              BM: gl.constexpr, GROUP_M: gl.constexpr, E_PAD: gl.constexpr, LANES: gl.constexpr):
        """This program's q-th item: (expert, first row, rows, column tile); row tiles grouped by
        GROUP_M for L2 reuse of the weight blocks."""
        t = pid + q * programs
        per_group = GROUP_M * num_n
        first_m = (t // per_group) * GROUP_M
        group_rows = gl.maximum(gl.minimum(num_m - first_m, GROUP_M), 1)  # >= 1 past the last item too
        m = first_m + (t % per_group) % group_rows
        nt = (t % per_group) // group_rows
        e = gl.sum((tile_end <= m).to(gl.int32), axis=0)
        sel = gl.arange(0, E_PAD, layout=LANES) == e
        row0 = gl.sum(gl.where(sel, row_base, 0), axis=0) + m * BM
        rows = gl.minimum(gl.sum(gl.where(sel, ends, 0), axis=0) - row0, BM)
        return e, row0, rows, nt

    @gluon.jit
    def _load_step(s, a_row, w_row, w2_row, KT, a_desc, w_desc, a_bufs, w_bufs, w2_bufs, bars, BK: gl.constexpr,
                   NUM_BUF: gl.constexpr, TWO: gl.constexpr, pred):
        """TMA loads of step s (K step s % KT of the item at a_row / w_row, and w2_row when TWO
        weight blocks) into stage s % NUM_BUF."""
        k0 = (s % KT) * BK
        stage = s % NUM_BUF
        bar = bars.index(stage)
        if TWO:
            mbarrier.expect(bar, a_desc.block_type.nbytes + 2 * w_desc.block_type.nbytes, pred=pred)
        else:
            mbarrier.expect(bar, a_desc.block_type.nbytes + w_desc.block_type.nbytes, pred=pred)
        _tma_load(a_desc, [a_row, k0], bar, a_bufs.index(stage), pred)
        _tma_load(w_desc, [w_row, k0], bar, w_bufs.index(stage), pred)
        if TWO:
            _tma_load(w_desc, [w2_row, k0], bar, w2_bufs.index(stage), pred)

    @gluon.jit
    def _issue(s, a_bufs, w_bufs, bars, zero, NUM_BUF: gl.constexpr):
        """Wait for step s's operands and issue its product into a fresh accumulator (asynchronous)."""
        stage = s % NUM_BUF
        mbarrier.wait(bars.index(stage), (s // NUM_BUF) & 1)
        return warpgroup_mma(a_bufs.index(stage), w_bufs.index(stage).permute((1, 0)), zero, use_acc=False,
                             is_async=True)

    @gluon.jit
    def _issue_second(s, a_bufs, w_bufs, zero, NUM_BUF: gl.constexpr):
        """The second product of step s (its operands already waited for by _issue)."""
        stage = s % NUM_BUF
        return warpgroup_mma(a_bufs.index(stage), w_bufs.index(stage).permute((1, 0)), zero, use_acc=False,
                             is_async=True)

    @gluon.jit
    def _refill(nxt, steps, KT, p_a, p_w, pid, programs, num_m, num_n, tile_end, row_base, ends, w_rows, up_off,
                a_desc, w_desc, a_bufs, w_bufs, w2_bufs, bars, BM: gl.constexpr, BN: gl.constexpr,
                BK: gl.constexpr, GROUP_M: gl.constexpr, NUM_BUF: gl.constexpr, E_PAD: gl.constexpr,
                LANES: gl.constexpr, TWO: gl.constexpr):
        """Loads of step nxt into its stage (freed by the product just waited for); the producer's
        item rows, recomputed when nxt enters an item. An item's weight rows start at
        e * w_rows + column tile * BN (and + up_off for the second block)."""
        if nxt % KT == 0:
            e, row0, rows, nt = _item(nxt // KT, pid, programs, num_m, num_n, tile_end, row_base, ends, BM,
                                      GROUP_M, E_PAD, LANES)
            p_a = row0
            p_w = e * w_rows + nt * BN
        _load_step(nxt, p_a, p_w, p_w + up_off, KT, a_desc, w_desc, a_bufs, w_bufs, w2_bufs, bars, BK, NUM_BUF,
                   TWO, nxt < steps)
        return p_a, p_w

    @gluon.jit
    def _row_scales(as_ptr, row0, kk, stride_as, BM: gl.constexpr, ROWS: gl.constexpr):
        """[BM] activation scales of K block kk for the item's rows (rows past the item's exist in
        the sorted rows and are never stored)."""
        r = row0 + gl.arange(0, BM, layout=ROWS)
        return gl.load(as_ptr + r.to(gl.int64) * stride_as + kk)

    @gluon.jit
    def block_gemm1_kernel(a_desc, w_desc, as_ptr, ws_ptr, act_ptr, expert_end_ptr,
                           N, K, E, stride_as, stride_we, stride_wn, stride_act,
                           BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, GROUP_M: gl.constexpr,
                           NUM_BUF: gl.constexpr, E_PAD: gl.constexpr, num_warps: gl.constexpr):
        """act[row, n] = silu(gate) * up over the sorted rows, gate / up = sum over K blocks kk of
        (a1[row] . w13[e, n or N + n])[kk] * a1_s[row, kk] * w13_s[e, n / 128 or (N + n) / 128, kk];
        BN = 64 activation columns an item (a gate and an up block of 64 weight rows)."""
        LANES: gl.constexpr = gl.BlockedLayout([E_PAD // 32], [32], [num_warps], [0])
        ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                      instr_shape=[16, BN, 32])
        ROWS: gl.constexpr = gl.SliceLayout(1, ACC)
        STORE: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // BN, BN // 8], [num_warps, 1], [1, 0])
        pid, programs, tile_end, row_base, ends, num_m, num_n, KT, steps = _program(expert_end_ptr, E, N, K, BM, BN,
                                                                                    BK, E_PAD, LANES)

        a_bufs = gl.allocate_shared_memory(a_desc.dtype, [NUM_BUF, BM, BK], a_desc.layout)
        g_bufs = gl.allocate_shared_memory(w_desc.dtype, [NUM_BUF, BN, BK], w_desc.layout)
        u_bufs = gl.allocate_shared_memory(w_desc.dtype, [NUM_BUF, BN, BK], w_desc.layout)
        bars = _ring_barriers(NUM_BUF)
        p_a = 0
        p_w = 0
        for i in gl.static_range(NUM_BUF - 1):
            p_a, p_w = _refill(i, steps, KT, p_a, p_w, pid, programs, num_m, num_n, tile_end, row_base, ends, 2 * N,
                               N, a_desc, w_desc, a_bufs, g_bufs, u_bufs, bars, BM, BN, BK, GROUP_M, NUM_BUF, E_PAD,
                               LANES, True)
        c_e, c_row, c_rows, c_nt = _item(0, pid, programs, num_m, num_n, tile_end, row_base, ends, BM, GROUP_M,
                                         E_PAD, LANES)

        zero = gl.zeros([BM, BN], gl.float32, ACC)
        acc_g = zero
        acc_u = zero
        t1g = zero
        t1u = zero
        s1g = gl.zeros([BM], gl.float32, ROWS)
        s1u = s1g
        for s in range(0, steps, 2):
            kk = s % KT
            t0g = _issue(s, a_bufs, g_bufs, bars, zero, NUM_BUF)
            t0u = _issue_second(s, a_bufs, u_bufs, zero, NUM_BUF)
            t1g, t1u, t0g, t0u = warpgroup_mma_wait(2, deps=(t1g, t1u, t0g, t0u))  # step s - 1 done
            p_a, p_w = _refill(s + NUM_BUF - 1, steps, KT, p_a, p_w, pid, programs, num_m, num_n, tile_end,
                               row_base, ends, 2 * N, N, a_desc, w_desc, a_bufs, g_bufs, u_bufs, bars, BM, BN, BK,
                               GROUP_M, NUM_BUF, E_PAD, LANES, True)
            if kk > 0:  # promote step s - 1 while step s multiplies
                acc_g = acc_g + t1g * gl.expand_dims(s1g, 1)
                acc_u = acc_u + t1u * gl.expand_dims(s1u, 1)
            s0 = _row_scales(as_ptr, c_row, kk, stride_as, BM, ROWS)
            w_s = ws_ptr + c_e * stride_we + kk
            s0g = s0 * gl.load(w_s + ((c_nt * BN) // 128) * stride_wn)
            s0u = s0 * gl.load(w_s + ((N + c_nt * BN) // 128) * stride_wn)
            t1g = _issue(s + 1, a_bufs, g_bufs, bars, zero, NUM_BUF)
            t1u = _issue_second(s + 1, a_bufs, u_bufs, zero, NUM_BUF)
            t0g, t0u, t1g, t1u = warpgroup_mma_wait(2, deps=(t0g, t0u, t1g, t1u))  # step s done
            p_a, p_w = _refill(s + NUM_BUF, steps, KT, p_a, p_w, pid, programs, num_m, num_n, tile_end, row_base,
                               ends, 2 * N, N, a_desc, w_desc, a_bufs, g_bufs, u_bufs, bars, BM, BN, BK, GROUP_M,
                               NUM_BUF, E_PAD, LANES, True)
            acc_g = acc_g + t0g * gl.expand_dims(s0g, 1)
            acc_u = acc_u + t0u * gl.expand_dims(s0u, 1)
            s1 = _row_scales(as_ptr, c_row, kk + 1, stride_as, BM, ROWS)
            s1g = s1 * gl.load(w_s + 1 + ((c_nt * BN) // 128) * stride_wn)
            s1u = s1 * gl.load(w_s + 1 + ((N + c_nt * BN) // 128) * stride_wn)
            if kk + 2 == KT:  # the item's last step: finish it, apply the activation, store its rows
                t1g, t1u = warpgroup_mma_wait(0, deps=(t1g, t1u))
                acc_g = acc_g + t1g * gl.expand_dims(s1g, 1)
                acc_u = acc_u + t1u * gl.expand_dims(s1u, 1)
                h = acc_g / (1.0 + gl.exp(-acc_g)) * acc_u
                out = gl.convert_layout(h.to(act_ptr.dtype.element_ty), STORE)
                rs = gl.arange(0, BM, layout=gl.SliceLayout(1, STORE))
                cs = c_nt * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, STORE))
                ptrs = act_ptr + gl.expand_dims((c_row + rs).to(gl.int64) * stride_act, 1) + gl.expand_dims(cs, 0)
                gl.store(ptrs, out, mask=gl.expand_dims(rs < c_rows, 1) & gl.expand_dims(cs < N, 0))
                acc_g = zero
                acc_u = zero
                c_e, c_row, c_rows, c_nt = _item(s // KT + 1, pid, programs, num_m, num_n, tile_end, row_base, ends,
                                                 BM, GROUP_M, E_PAD, LANES)
        for i in gl.static_range(NUM_BUF):
            mbarrier.invalidate(bars.index(i))

    @gluon.jit
    def block_gemm2_kernel(a_desc, w_desc, as_ptr, ws_ptr, y_ptr, topk_w_ptr, sorted_ptr, expert_end_ptr,
                           N, K, TK, E, stride_as, stride_we, stride_wn, stride_ym,
                           BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, GROUP_M: gl.constexpr,
                           NUM_BUF: gl.constexpr, E_PAD: gl.constexpr, num_warps: gl.constexpr):
        """y[a, n] = w[a] * sum over K blocks kk of (a2[row] . w2[e, n])[kk] * a2_s[row, kk] *
        w2_s[e, n / 128, kk], stored at each sorted row's assignment a (BN = 128)."""
        LANES: gl.constexpr = gl.BlockedLayout([E_PAD // 32], [32], [num_warps], [0])
        ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                      instr_shape=[16, BN, 32])
        ROWS: gl.constexpr = gl.SliceLayout(1, ACC)
        STORE: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // BN, BN // 8], [num_warps, 1], [1, 0])
        pid, programs, tile_end, row_base, ends, num_m, num_n, KT, steps = _program(expert_end_ptr, E, N, K, BM, BN,
                                                                                    BK, E_PAD, LANES)

        a_bufs = gl.allocate_shared_memory(a_desc.dtype, [NUM_BUF, BM, BK], a_desc.layout)
        w_bufs = gl.allocate_shared_memory(w_desc.dtype, [NUM_BUF, BN, BK], w_desc.layout)
        bars = _ring_barriers(NUM_BUF)
        p_a = 0
        p_w = 0
        for i in gl.static_range(NUM_BUF - 1):
            p_a, p_w = _refill(i, steps, KT, p_a, p_w, pid, programs, num_m, num_n, tile_end, row_base, ends, N, 0,
                               a_desc, w_desc, a_bufs, w_bufs, w_bufs, bars, BM, BN, BK, GROUP_M, NUM_BUF, E_PAD,
                               LANES, False)
        c_e, c_row, c_rows, c_nt = _item(0, pid, programs, num_m, num_n, tile_end, row_base, ends, BM, GROUP_M,
                                         E_PAD, LANES)

        zero = gl.zeros([BM, BN], gl.float32, ACC)
        acc = zero
        t1 = zero
        s1 = gl.zeros([BM], gl.float32, ROWS)
        for s in range(0, steps, 2):
            kk = s % KT
            t0 = _issue(s, a_bufs, w_bufs, bars, zero, NUM_BUF)
            t1, t0 = warpgroup_mma_wait(1, deps=(t1, t0))  # step s - 1 done
            p_a, p_w = _refill(s + NUM_BUF - 1, steps, KT, p_a, p_w, pid, programs, num_m, num_n, tile_end,
                               row_base, ends, N, 0, a_desc, w_desc, a_bufs, w_bufs, w_bufs, bars, BM, BN, BK,
                               GROUP_M, NUM_BUF, E_PAD, LANES, False)
            if kk > 0:  # promote step s - 1 while step s multiplies
                acc = acc + t1 * gl.expand_dims(s1, 1)
            w_s = ws_ptr + c_e * stride_we + c_nt * stride_wn + kk
            s0 = _row_scales(as_ptr, c_row, kk, stride_as, BM, ROWS) * gl.load(w_s)
            t1 = _issue(s + 1, a_bufs, w_bufs, bars, zero, NUM_BUF)
            t0, t1 = warpgroup_mma_wait(1, deps=(t0, t1))  # step s done
            p_a, p_w = _refill(s + NUM_BUF, steps, KT, p_a, p_w, pid, programs, num_m, num_n, tile_end, row_base,
                               ends, N, 0, a_desc, w_desc, a_bufs, w_bufs, w_bufs, bars, BM, BN, BK, GROUP_M, NUM_BUF,
                               E_PAD, LANES, False)
            acc = acc + t0 * gl.expand_dims(s0, 1)
            s1 = _row_scales(as_ptr, c_row, kk + 1, stride_as, BM, ROWS) * gl.load(w_s + 1)
            if kk + 2 == KT:  # the item's last step: finish it, apply the routed weights, store y rows
                t1 = warpgroup_mma_wait(0, deps=(t1,))
                acc = acc + t1 * gl.expand_dims(s1, 1)
                out = gl.convert_layout(acc, STORE)
                rs = gl.arange(0, BM, layout=gl.SliceLayout(1, STORE))
                cs = c_nt * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, STORE))
                assign = gl.load(sorted_ptr + c_row + rs, mask=rs < c_rows, other=TK)
                live = assign < TK
                route_w = gl.load(topk_w_ptr + assign, mask=live, other=0.0)
                out = (out * gl.expand_dims(route_w, 1)).to(y_ptr.dtype.element_ty)
                y_ptrs = y_ptr + gl.expand_dims(gl.where(live, assign, 0).to(gl.int64) * stride_ym, 1) \
                    + gl.expand_dims(cs, 0)
                gl.store(y_ptrs, out, mask=gl.expand_dims(live, 1) & gl.expand_dims(cs < N, 0))
                acc = zero
                c_e, c_row, c_rows, c_nt = _item(s // KT + 1, pid, programs, num_m, num_n, tile_end, row_base, ends,
                                                 BM, GROUP_M, E_PAD, LANES)
        for i in gl.static_range(NUM_BUF):
            mbarrier.invalidate(bars.index(i))


def _descriptor(t: torch.Tensor, block):
    return TensorDescriptor(t, list(t.shape), [t.stride(0), 1], list(block),
                            gl.NVMMASharedLayout.get_default_for(list(block), gl.float8e4nv))


def _grid(R: int, rows: int, E: int, col_tiles: int, programs: Optional[int], device) -> Tuple[int]:
    """One program per SM, at most one per item (an upper bound of the items from shapes)."""
    if programs is None:
        programs = torch.cuda.get_device_properties(device).multi_processor_count
    return (max(1, min((triton.cdiv(R, rows) + E) * col_tiles, programs)),)


def _e_pad(E: int) -> int:
    return max(32, triton.next_power_of_2(E))


def gemm1(a1s: torch.Tensor, a1s_s: torch.Tensor, w13: torch.Tensor, w13_s: torch.Tensor, act: torch.Tensor,
          expert_end: torch.Tensor, rows: int, programs: Optional[int] = None) -> None:
    """act [R, I] (x's dtype) = silu(gate) * up of the sorted rows a1s [R, H] fp8 (scales a1s_s
    [R, H / 128]) through w13 [E, 2I, H] fp8 (scales w13_s [E, 2I / 128, H / 128]); rows past the
    last expert's padded end are left unwritten."""
    R, H = a1s.shape
    E, I2, _ = w13.shape
    a_desc = _descriptor(a1s, (rows, 128))
    w_desc = _descriptor(w13.view(E * I2, H), (GEMM1_COLS, 128))
    grid = _grid(R, rows, E, I2 // 2 // GEMM1_COLS, programs, a1s.device)
    args = (a_desc, w_desc, a1s_s, w13_s, act, expert_end, I2 // 2, H, E, a1s_s.stride(0), w13_s.stride(0),
            w13_s.stride(1), act.stride(0))
    block_gemm1_kernel[grid](*args, BM=rows, BN=GEMM1_COLS, BK=128, GROUP_M=GROUP_M,
                             NUM_BUF=NUM_BUF, E_PAD=_e_pad(E), num_warps=ROW_TILES[rows])


def gemm2(a2: torch.Tensor, a2_s: torch.Tensor, w2: torch.Tensor, w2_s: torch.Tensor, y: torch.Tensor,
          topk_weights: torch.Tensor, sorted_ids: torch.Tensor, expert_end: torch.Tensor, rows: int,
          programs: Optional[int] = None) -> None:
    """y [T * k, H] (x's dtype) at each sorted row's assignment: the row a2 [R, I] fp8 (scales a2_s
    [R, I / 128]) through w2 [E, H, I] fp8 (scales w2_s [E, H / 128, I / 128]) times its routed
    weight; rows of assignments without a local expert are left unwritten."""
    R, I = a2.shape
    E, H, _ = w2.shape
    a_desc = _descriptor(a2, (rows, 128))
    w_desc = _descriptor(w2.view(E * H, I), (GEMM2_COLS, 128))
    grid = _grid(R, rows, E, H // GEMM2_COLS, programs, a2.device)
    args = (a_desc, w_desc, a2_s, w2_s, y, topk_weights, sorted_ids, expert_end, H, I, y.shape[0], E, a2_s.stride(0),
            w2_s.stride(0), w2_s.stride(1), y.stride(0))
    block_gemm2_kernel[grid](*args, BM=rows, BN=GEMM2_COLS, BK=128, GROUP_M=GROUP_M,
                             NUM_BUF=NUM_BUF, E_PAD=_e_pad(E), num_warps=ROW_TILES[rows])

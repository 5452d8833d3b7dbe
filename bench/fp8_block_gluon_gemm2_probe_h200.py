"""The block-scaled fp8 GEMM2 of the layer on the Gluon schedule of fp8_block_gluon_probe_h200.py.

The dense probe kept one product in flight while it promoted the previous one and beat
Triton's promoted products by 1.25x at DeepSeek-V3's shapes (bench/NOTES-triton.md). This is
the same K loop over the layer's sorted rows: GEMM2 of the "fp8_w8a8_block128" scheme,

    y[a, :] = w[a] * sum over K blocks kb of (a2[row] . w2[e]^T)[kb] * a2_s[row, kb] * w2_s[e, n / 128, kb],

for the rows of expert e's tiles (moekit's alignment), a2 [R, I] fp8 with a scale per row and
128 columns (moekit's quantize_rows), w2 [E, H, I] fp8 with a scale per 128 x 128 block
(moekit's quantize_experts), y [T * k, H] bf16 stored at each row's assignment. One program per
SM walks its (row tile, column tile) items as one flat sequence of K steps through a ring of
NUM_BUF stages; an item's expert comes from the padded expert ends (the schedule of the Gluon
GEMM2 at commit 98e72fb, validated on the H200 then).

    PYTHONPATH=src python bench/fp8_block_gluon_gemm2_probe_h200.py [--out FILE]   # on the H200
    PYTHONPATH=src python bench/fp8_block_gluon_gemm2_probe_h200.py --sass DIR      # compile here
    TRITON_INTERPRET=1 PYTHONPATH=src python bench/fp8_block_gluon_gemm2_probe_h200.py --check

On the H200: each point's y against an fp32 dequantized reference (per expert, in torch), run to
run bits, and its time next to the shipped GEMM2 (gemm2_quant_kernel) of the same point profiled
through the layer (profile_h200.py). --sass compiles for sm_90a without a GPU.
"""

import argparse
import json
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from moekit.benchmarks.gpu import routing_sets, shape_by_name  # noqa: E402

import fp8_block_gluon_probe_h200 as dense  # noqa: E402 (its Gluon imports, TMA steps and product issue)

GLUON = dense.GLUON
if GLUON is None:
    from fp8_block_gluon_probe_h200 import (  # noqa: E402
        TensorDescriptor, _issue, _load_step, gl, gluon, mbarrier, warpgroup_mma_wait,
    )

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
    def _item(q, pid, programs, num_m, num_n, tile_end, row_base, ends,
              BM: gl.constexpr, GROUP_M: gl.constexpr, E_PAD: gl.constexpr, LANES: gl.constexpr):
        """This program's q-th item: (expert, first row, rows, column tile)."""
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
    def _refill(nxt, steps, KT, p_a, p_w, pid, programs, num_m, num_n, tile_end, row_base, ends, N,
                a_desc, w_desc, a_bufs, w_bufs, bars, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr,
                GROUP_M: gl.constexpr, NUM_BUF: gl.constexpr, E_PAD: gl.constexpr, LANES: gl.constexpr):
        """Loads of step nxt into its stage (freed by the product just waited for); the producer's
        item rows, recomputed when nxt enters an item."""
        if nxt % KT == 0:
            e, row0, rows, nt = _item(nxt // KT, pid, programs, num_m, num_n, tile_end, row_base, ends, BM,
                                      GROUP_M, E_PAD, LANES)
            p_a = row0
            p_w = e * N + nt * BN
        _load_step(nxt, p_a, p_w, KT, a_desc, w_desc, a_bufs, w_bufs, bars, BK, NUM_BUF, nxt < steps)
        return p_a, p_w

    @gluon.jit
    def _step_scale(as_ptr, ws_ptr, row0, e, nt, kk, stride_as, stride_we, stride_wn,
                    BM: gl.constexpr, ROWS: gl.constexpr):
        """[BM] scales of K block kk for the item's rows: a2_s[row, kk] * w2_s[e, nt, kk] (BN = 128).
        Rows past the tile's are read (the rows of R exist) and never stored."""
        r = row0 + gl.arange(0, BM, layout=ROWS)
        return gl.load(as_ptr + r.to(gl.int64) * stride_as + kk) * gl.load(ws_ptr + e * stride_we + nt * stride_wn + kk)

    @gluon.jit
    def block_gemm2_kernel(a_desc, w_desc, as_ptr, ws_ptr, y_ptr, topk_w_ptr, sorted_ptr, expert_end_ptr,
                           N, K, TK, E, stride_as, stride_we, stride_wn, stride_ym,
                           BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, GROUP_M: gl.constexpr,
                           NUM_BUF: gl.constexpr, E_PAD: gl.constexpr, num_warps: gl.constexpr):
        LANES: gl.constexpr = gl.BlockedLayout([E_PAD // 32], [32], [num_warps], [0])
        ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                      instr_shape=[16, BN, 32])
        ROWS: gl.constexpr = gl.SliceLayout(1, ACC)
        STORE: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // BN, BN // 8], [num_warps, 1], [1, 0])
        pid = gl.program_id(0)
        programs = gl.num_programs(0)
        tile_end, row_base, ends, num_m = _schedule(expert_end_ptr, E, BM, E_PAD, LANES)
        num_n = gl.cdiv(N, BN)
        KT = gl.cdiv(K, BK)
        steps = gl.maximum(gl.cdiv(num_m * num_n - pid, programs), 0) * KT

        a_bufs = gl.allocate_shared_memory(a_desc.dtype, [NUM_BUF, BM, BK], a_desc.layout)
        w_bufs = gl.allocate_shared_memory(w_desc.dtype, [NUM_BUF, BN, BK], w_desc.layout)
        bars = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(NUM_BUF):
            mbarrier.init(bars.index(i), count=1)
        p_a = 0
        p_w = 0
        for i in gl.static_range(NUM_BUF - 1):
            p_a, p_w = _refill(i, steps, KT, p_a, p_w, pid, programs, num_m, num_n, tile_end, row_base, ends, N,
                               a_desc, w_desc, a_bufs, w_bufs, bars, BM, BN, BK, GROUP_M, NUM_BUF, E_PAD, LANES)
        c_e, c_row, c_rows, c_nt = _item(0, pid, programs, num_m, num_n, tile_end, row_base, ends, BM, GROUP_M,
                                         E_PAD, LANES)

        zero = gl.zeros([BM, BN], gl.float32, ACC)
        acc = zero
        t1 = zero
        s1 = gl.zeros([BM], gl.float32, ROWS)
        # Steps in pairs with two accumulators, as the dense probe (KT even: a pair never
        # straddles two items, and no product in flight is copied).
        for s in range(0, steps, 2):
            kk = s % KT
            t0 = _issue(s, a_bufs, w_bufs, bars, zero, NUM_BUF)
            t1, t0 = warpgroup_mma_wait(1, deps=(t1, t0))
            p_a, p_w = _refill(s + NUM_BUF - 1, steps, KT, p_a, p_w, pid, programs, num_m, num_n, tile_end,
                               row_base, ends, N, a_desc, w_desc, a_bufs, w_bufs, bars, BM, BN, BK, GROUP_M,
                               NUM_BUF, E_PAD, LANES)
            if kk > 0:
                acc = acc + t1 * gl.expand_dims(s1, 1)
            s0 = _step_scale(as_ptr, ws_ptr, c_row, c_e, c_nt, kk, stride_as, stride_we, stride_wn, BM, ROWS)
            t1 = _issue(s + 1, a_bufs, w_bufs, bars, zero, NUM_BUF)
            t0, t1 = warpgroup_mma_wait(1, deps=(t0, t1))
            p_a, p_w = _refill(s + NUM_BUF, steps, KT, p_a, p_w, pid, programs, num_m, num_n, tile_end, row_base,
                               ends, N, a_desc, w_desc, a_bufs, w_bufs, bars, BM, BN, BK, GROUP_M, NUM_BUF, E_PAD,
                               LANES)
            acc = acc + t0 * gl.expand_dims(s0, 1)
            s1 = _step_scale(as_ptr, ws_ptr, c_row, c_e, c_nt, kk + 1, stride_as, stride_we, stride_wn, BM, ROWS)
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


def gemm2(a2, a2_s, w2, w2_s, topk_weights, sorted_ids, expert_end, TK, BM, warps, num_buf, programs):
    """y [TK, H] bf16 of the layer's GEMM2 (rows of assignments without an expert are not written)."""
    R, I = a2.shape
    E, H, _ = w2.shape
    if BM != 16 * warps or I % 256 or H % 128:
        raise ValueError(f"the probe takes BM = 16 * warps, I a multiple of 256 (K steps in pairs) and H of 128, "
                         f"got BM={BM}, warps={warps}, I={I}, H={H}")
    fp8 = gl.float8e4nv
    a_desc = TensorDescriptor(a2, [R, I], [a2.stride(0), 1], [BM, 128],
                              gl.NVMMASharedLayout.get_default_for([BM, 128], fp8))
    w_desc = TensorDescriptor(w2.view(E * H, I), [E * H, I], [I, 1], [128, 128],
                              gl.NVMMASharedLayout.get_default_for([128, 128], fp8))
    y = torch.empty(TK, H, dtype=torch.bfloat16, device=a2.device)
    items = (triton.cdiv(R, BM) + E) * (H // 128)
    grid = (max(1, min(items, programs)),)
    block_gemm2_kernel[grid](a_desc, w_desc, a2_s, w2_s, y, topk_weights, sorted_ids, expert_end,
                             H, I, TK, E, a2_s.stride(0), w2_s.stride(0), w2_s.stride(1), y.stride(0),
                             BM=BM, BN=128, BK=128, GROUP_M=8, NUM_BUF=num_buf,
                             E_PAD=max(32, triton.next_power_of_2(E)), num_warps=warps)
    return y


def problem(name, M, device):
    """The layer's GEMM2 operands at a point: sorted rows of random routing (moekit's alignment in
    128-row blocks), act quantized per row and 128 columns, w2 per 128 x 128 block."""
    from moekit.kernels.launch import moe_align  # noqa: PLC0415
    from moekit.kernels.quant_rows import quantize_rows  # noqa: PLC0415
    from moekit.quant import get_scheme, quantize_experts  # noqa: PLC0415

    _, E, k, H, I = shape_by_name(name)
    scheme = get_scheme("fp8_w8a8_block128")
    _, w, ids = routing_sets(M, E, k, H, 1, torch.bfloat16, device)[0]
    al = moe_align(ids, None, E, 128)
    R = al.max_blocks * al.block_m
    act = torch.randn(R, I, device=device).to(torch.bfloat16)
    a2, a2_s = quantize_rows(act, scheme, expert_end=al.expert_end)
    q = quantize_experts(torch.randn(E, 2 * 128, H, device=device) * H ** -0.5,
                         torch.randn(E, H, I, device=device) * I ** -0.5, scheme)
    return dict(a2=a2, a2_s=a2_s, w2=q.w2, w2_s=q.scales["w2_scale"], w=w, ids=ids, al=al, E=E, k=k, H=H, I=I)


def reference(p):
    """y [TK, H] fp32 from dequantized operands, expert by expert (rows of no expert stay 0)."""
    al, a2, w2 = p["al"], p["a2"], p["w2"]
    TK, H = p["ids"].numel(), p["H"]
    a = a2.float() * p["a2_s"].repeat_interleave(128, 1)
    ws = p["w2_s"].repeat_interleave(128, 1).repeat_interleave(128, 2)
    y = torch.zeros(TK, H, device=a2.device)
    ends = [0] + al.expert_end.tolist()
    rows_ids = al.sorted_ids.long()
    for e in range(p["E"]):
        r = torch.arange(ends[e], ends[e + 1], device=a2.device)
        assign = rows_ids[r]
        live = assign < TK
        if live.any():
            prod = a[r[live]] @ (w2[e].float() * ws[e]).T
            y[assign[live]] = prod * p["w"].reshape(-1)[assign[live]][:, None]
    return y


def check():
    """On CPU (TRITON_INTERPRET=1 for moekit's alignment and row quantization): reference() on a
    tiny problem against a row-by-row dequantized product, and every assignment's row written."""
    global shape_by_name
    real = shape_by_name
    shape_by_name = lambda name: (name, 4, 2, 256, 256)  # noqa: E731 (E, k, H, I)
    try:
        p = problem("tiny", 40, torch.device("cpu"))
    finally:
        shape_by_name = real
    ref = reference(p)
    a = p["a2"].float() * p["a2_s"].repeat_interleave(128, 1)
    ws = p["w2_s"].repeat_interleave(128, 1).repeat_interleave(128, 2)
    TK = p["ids"].numel()
    rows = p["al"].sorted_ids.long()
    y = torch.zeros_like(ref)
    for row in range(int(p["al"].expert_end[-1])):
        a_i = int(rows[row])
        if a_i < TK:
            e = int(p["ids"].reshape(-1)[a_i])
            y[a_i] = (a[row] @ (p["w2"][e].float() * ws[e]).T) * p["w"].reshape(-1)[a_i]
    err = (y - ref).abs().max().item()
    print(f"reference: max diff {err:.2e}, rows written {int((ref.abs().sum(1) > 0).sum())} of {TK}")
    assert err < 1e-4 and bool((ref.abs().sum(1) > 0).all())


TILES = [(128, 8, 4), (128, 8, 3), (64, 4, 4)]  # BM, warps, stages
POINTS = ("deepseek-v3:4096", "deepseek-v3:16384", "qwen3-30b-a3b:16384")


def offline(out_dir):
    """Each tile compiled for sm_90a here (the dense probe's sass_report), at DeepSeek-V3's GEMM2 at
    M = 16384 (the operands' shapes and strides; nothing runs)."""
    E, H, I, R, TK = 256, 7168, 2048, 65536, 131072
    a2 = torch.empty(R, I, dtype=torch.float8_e4m3fn)
    w2 = torch.empty(E, H, I, dtype=torch.float8_e4m3fn)
    args = (a2, torch.empty(R, I // 128), w2, torch.empty(E, H // 128, I // 128), torch.empty(TK),
            torch.empty(R, dtype=torch.int32), torch.empty(E, dtype=torch.int32), TK)
    report = {f"{bm} w{warps} s{stages}": dense.sass_report(
        lambda: gemm2(*args, bm, warps, stages, 132),
        os.path.join(out_dir, f"block_gemm2_{bm}_w{warps}_s{stages}.sass"))
        for bm, warps, stages in TILES}
    with open(os.path.join(out_dir, "block_gemm2_offline.json"), "w") as f:
        json.dump(report, f, indent=1)
    return report


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "fp8_block_gluon_gemm2.json"))
    ap.add_argument("--points", default=",".join(POINTS))
    ap.add_argument("--sass", metavar="DIR", help="only compile the kernel for sm_90a here (no GPU)")
    ap.add_argument("--check", action="store_true", help="check the reference on CPU (TRITON_INTERPRET=1)")
    args = ap.parse_args()
    if args.check:
        check()
        return
    if GLUON is not None:
        raise SystemExit(f"this triton has no Gluon Hopper module: {GLUON}")
    if args.sass:
        print(json.dumps(offline(args.sass), indent=1))
        return
    import profile_h200  # noqa: PLC0415 (the shipped GEMM2's time through the layer)

    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    results = []
    for spec in args.points.split(","):
        name, M = spec.split(":")[0], int(spec.split(":")[1])
        p = problem(name, M, dev)
        ref = reference(p)
        TK = p["ids"].numel()
        flops = 2.0 * TK * p["H"] * p["I"]
        shipped = profile_h200.profile_point(f"{name}:fp8_w8a8_block128:{M}")
        gemm2_us = next((kr["us_per_call"] for kr in shipped["kernels"] if "gemm2" in kr["kernel"]), None)
        results.append(dict(point=spec, kernel="shipped gemm2_quant_kernel (profiled in the layer)", us=gemm2_us,
                            tflops=flops / gemm2_us / 1e6 if gemm2_us else None))
        print(json.dumps(results[-1]), flush=True)
        for bm, warps, stages in TILES:
            call = (lambda bm=bm, warps=warps, stages=stages: gemm2(
                p["a2"], p["a2_s"], p["w2"], p["w2_s"], p["w"], p["al"].sorted_ids, p["al"].expert_end, TK, bm,
                warps, stages, sms))
            results.append(dense.measure(dict(point=spec, kernel=f"gluon BM={bm} warps={warps} stages={stages}"),
                                         call, ref, flops))
        del p, ref
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(dev), torch=torch.__version__, triton=triton.__version__,
                       results=results), f, indent=1)


if __name__ == "__main__":
    sys.exit(main())

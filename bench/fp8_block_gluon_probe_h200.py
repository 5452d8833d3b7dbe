"""Block-scaled fp8 in Gluon with the promotion overlapped: can it beat Triton's 560 TFLOP/s?

fp8_gemm_probe_h200.py found Triton 3.6 keeps less than half the fp8 rate for 128 x 128 weight
blocks and 1 x 128 activation groups (DeepSeek-V3's scheme): it waits for every warpgroup
product before promoting it into the fp32 accumulator (`acc += dot(a, b) * scales`), so the
tensor cores idle while the CUDA cores scale. Here the same dense GEMM (C = A B^T, A [M, K],
B [N, K] fp8, scales a_s [M, K / 128], b_s [N / 128, K / 128]) is written in Gluon, where the
waits are explicit. Per K step of 128 (one scale block):

    issue the step's product into a fresh accumulator (asynchronous);
    wait until only that product is in flight (so the previous step's product is done);
    refill the previous step's shared-memory stage with a later step's TMA loads;
    promote the previous product: acc += prev * (a_s[rows, k] * b_s[block, k]), on the CUDA
    cores while this step's product runs on the tensor cores.

Steps go in pairs with two accumulators, so no product in flight is ever copied: a first
version carried `prev = cur` across steps, and ptxas then waited for every product right
after issuing it (QGMMA; WARPGROUP.DEPBAR.LE gsb0, 0x0 in its offline SASS).

One program per SM walks its tiles' K steps as one flat sequence through a ring of NUM_BUF
stages (the layout of the Gluon GEMM2 of commit 98e72fb), so the next tile's first loads are in
flight during a tile's last product and its epilogue. BN = 128 keeps one weight scale per
(tile, K step). Each result is checked against an fp32 dequantized product; timed next to
the Triton kernel of fp8_gemm_probe_h200.py (promoted, and unscaled fp8 for the ceiling).

    PYTHONPATH=src python bench/fp8_block_gluon_probe_h200.py [--out FILE]   # on the H200
    PYTHONPATH=src python bench/fp8_block_gluon_probe_h200.py --sass DIR      # compile for sm_90a here

Gluon does not run under the interpreter: CI compiles the kernel for sm_90a (--sass) and checks
that its products stay in flight while the previous ones are promoted.
"""

import argparse
import json
import os
import re
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fp8_gemm_probe_h200 as tl_probe  # noqa: E402 (the Triton kernel, operands and reference)
from moekit.benchmarks.gpu import eager_time_us  # noqa: E402

from moekit.kernels import gluon_block  # noqa: E402 (Gluon's Hopper names, the TMA step and the product issue)

GLUON = gluon_block.GLUON_MISSING
if GLUON is None:
    from moekit.kernels.gluon_block import (  # noqa: E402
        TensorDescriptor, _issue, _load_step, _ring_barriers, gl, gluon, mbarrier, warpgroup_mma_wait,
    )


if GLUON is None:

    @gluon.jit
    def _coords(q, pid, programs, num_m, num_n, BM: gl.constexpr, BN: gl.constexpr, GROUP_M: gl.constexpr):
        """First row of A and of B of this program's q-th tile (grouped for L2, as the Triton probe)."""
        t = pid + q * programs
        per_group = GROUP_M * num_n
        first_m = (t // per_group) * GROUP_M
        rows_g = gl.maximum(gl.minimum(num_m - first_m, GROUP_M), 1)
        return (first_m + (t % per_group) % rows_g) * BM, ((t % per_group) // rows_g) * BN

    @gluon.jit
    def _refill(nxt, steps, KT, p_a, p_b, pid, programs, num_m, num_n, a_desc, b_desc, a_bufs, b_bufs, bars,
                BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, GROUP_M: gl.constexpr, NUM_BUF: gl.constexpr):
        """Loads of step nxt into its stage (freed by the product just waited for); the producer's
        tile coordinates, recomputed when nxt enters a tile."""
        if nxt % KT == 0:
            p_a, p_b = _coords(nxt // KT, pid, programs, num_m, num_n, BM, BN, GROUP_M)
        _load_step(nxt, p_a, p_b, 0, KT, a_desc, b_desc, a_bufs, b_bufs, b_bufs, bars, BK, NUM_BUF, False,
                   nxt < steps)
        return p_a, p_b

    @gluon.jit
    def _step_scale(as_ptr, bs_ptr, a_row, b_row, kk, M, KT, BM: gl.constexpr, ROWS: gl.constexpr):
        """[BM] scales of K step kk for the tile's rows: a_s[row, kk] * b_s[b_row / 128, kk]."""
        r = a_row + gl.arange(0, BM, layout=ROWS)
        a_s = gl.load(as_ptr + r * KT + kk, mask=r < M, other=0.0)
        return a_s * gl.load(bs_ptr + (b_row // 128) * KT + kk)

    @gluon.jit
    def block_fp8_kernel(a_desc, b_desc, c_ptr, as_ptr, bs_ptr, M, N, K,
                         BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, GROUP_M: gl.constexpr,
                         NUM_BUF: gl.constexpr, num_warps: gl.constexpr):
        ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                      instr_shape=[16, BN, 32])
        ROWS: gl.constexpr = gl.SliceLayout(1, ACC)
        STORE: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // BN, BN // 8], [num_warps, 1], [1, 0])
        pid = gl.program_id(0)
        programs = gl.num_programs(0)
        num_m = gl.cdiv(M, BM)
        num_n = gl.cdiv(N, BN)
        KT = gl.cdiv(K, BK)
        steps = gl.cdiv(num_m * num_n - pid, programs) * KT

        a_bufs = gl.allocate_shared_memory(a_desc.dtype, [NUM_BUF, BM, BK], a_desc.layout)
        b_bufs = gl.allocate_shared_memory(b_desc.dtype, [NUM_BUF, BN, BK], b_desc.layout)
        bars = _ring_barriers(NUM_BUF)
        for i in gl.static_range(NUM_BUF - 1):
            a_row, b_row = _coords(i // KT, pid, programs, num_m, num_n, BM, BN, GROUP_M)
            _load_step(i, a_row, b_row, 0, KT, a_desc, b_desc, a_bufs, b_bufs, b_bufs, bars, BK, NUM_BUF, False,
                       i < steps)
        # the producer's tile, recomputed when it crosses into the next tile
        p_a, p_b = _coords((NUM_BUF - 1) // KT, pid, programs, num_m, num_n, BM, BN, GROUP_M)
        c_a, c_b = _coords(0, pid, programs, num_m, num_n, BM, BN, GROUP_M)  # the tile being multiplied

        zero = gl.zeros([BM, BN], gl.float32, ACC)
        acc = zero
        t1 = zero
        s1 = gl.zeros([BM], gl.float32, ROWS)
        # Steps in pairs, the products of a pair in two accumulators (t0, t1), so a product in
        # flight is never copied (reading its registers would make ptxas serialize the MMAs).
        # KT is even: a pair never straddles two tiles.
        for s in range(0, steps, 2):
            kk = s % KT
            t0 = _issue(s, a_bufs, b_bufs, bars, zero, NUM_BUF)
            t1, t0 = warpgroup_mma_wait(1, deps=(t1, t0))  # step s - 1 done, its stage free
            p_a, p_b = _refill(s + NUM_BUF - 1, steps, KT, p_a, p_b, pid, programs, num_m, num_n, a_desc, b_desc,
                               a_bufs, b_bufs, bars, BM, BN, BK, GROUP_M, NUM_BUF)
            if kk > 0:  # promote step s - 1 while step s multiplies
                acc = acc + t1 * gl.expand_dims(s1, 1)
            s0 = _step_scale(as_ptr, bs_ptr, c_a, c_b, kk, M, KT, BM, ROWS)
            t1 = _issue(s + 1, a_bufs, b_bufs, bars, zero, NUM_BUF)
            t0, t1 = warpgroup_mma_wait(1, deps=(t0, t1))  # step s done
            p_a, p_b = _refill(s + NUM_BUF, steps, KT, p_a, p_b, pid, programs, num_m, num_n, a_desc, b_desc,
                               a_bufs, b_bufs, bars, BM, BN, BK, GROUP_M, NUM_BUF)
            acc = acc + t0 * gl.expand_dims(s0, 1)
            s1 = _step_scale(as_ptr, bs_ptr, c_a, c_b, kk + 1, M, KT, BM, ROWS)
            if kk + 2 == KT:  # the tile's last step: finish it and store
                t1 = warpgroup_mma_wait(0, deps=(t1,))
                acc = acc + t1 * gl.expand_dims(s1, 1)
                out = gl.convert_layout(acc.to(c_ptr.dtype.element_ty), STORE)
                rs = c_a + gl.arange(0, BM, layout=gl.SliceLayout(1, STORE))
                cs = c_b + gl.arange(0, BN, layout=gl.SliceLayout(0, STORE))
                ptrs = c_ptr + gl.expand_dims(rs.to(gl.int64) * N, 1) + gl.expand_dims(cs, 0)
                gl.store(ptrs, out, mask=gl.expand_dims(rs < M, 1) & gl.expand_dims(cs < N, 0))
                acc = zero
                c_a, c_b = _coords(s // KT + 1, pid, programs, num_m, num_n, BM, BN, GROUP_M)
        for i in gl.static_range(NUM_BUF):
            mbarrier.invalidate(bars.index(i))


def run_gluon(a, b, a_s, b_s, bm, bn, warps, num_buf, programs):
    """C = (a * a_s) (b * b_s)^T in bf16 through block_fp8_kernel (BK = 128, one scale block)."""
    M, K = a.shape
    N = b.shape[0]
    if bn != 128 or bm != 16 * warps or K % 256:
        raise ValueError(f"the probe takes BN = 128 (one weight scale a tile and K step), BM = 16 * warps and K a "
                         f"multiple of 256 (K steps in pairs), got BN={bn}, BM={bm}, warps={warps}, K={K}")
    fp8 = gl.float8e4nv
    a_desc = TensorDescriptor(a, [M, K], [K, 1], [bm, 128], gl.NVMMASharedLayout.get_default_for([bm, 128], fp8))
    b_desc = TensorDescriptor(b, [N, K], [K, 1], [bn, 128], gl.NVMMASharedLayout.get_default_for([bn, 128], fp8))
    c = torch.empty(M, N, dtype=torch.bfloat16, device=a.device)
    grid = (max(1, min(programs, triton.cdiv(M, bm) * triton.cdiv(N, bn))),)
    block_fp8_kernel[grid](a_desc, b_desc, c, a_s, b_s, M, N, K, BM=bm, BN=bn, BK=128, GROUP_M=8, NUM_BUF=num_buf,
                           num_warps=warps)
    return c


GLUON_TILES = [(128, 128, 8, 4), (128, 128, 8, 3), (64, 128, 4, 4), (64, 128, 4, 6)]  # BM, BN, warps, stages
TRITON_TILES = [(128, 128, 128, 8, 4, False), (128, 256, 128, 8, 3, False)]  # the Triton probe's best fp8 tiles


def sass_report(launch, sass_path: str) -> dict:
    """Compile what launch() launches for sm_90a here, without a GPU (bench/sass_offline.py), and
    report its registers, spills and shared memory, and how its products are waited for:
    `overlapped` counts the waits that leave product groups in flight (WARPGROUP.DEPBAR.LE gsb0,
    0x1 or more), `serialized` the waits for all of them."""
    from sass_offline import compile_only, describe  # noqa: PLC0415

    with compile_only(90) as compiled:
        launch()
    d = describe(compiled[-1][1], sass_path)
    with open(sass_path) as f:
        sass = f.read()
    return dict(registers=d["registers"], local_bytes=d["local_bytes"], shared_bytes=d["shared_bytes"],
                overlapped=len(re.findall(r"WARPGROUP\.DEPBAR\.LE gsb0, 0x[1-9]", sass)),
                serialized=sass.count("WARPGROUP.DEPBAR.LE gsb0, 0x0"), products=sass.count("QGMMA"))


def measure(rec: dict, call, ref: torch.Tensor, flops: float) -> dict:
    """rec with call()'s error against ref, its run-to-run bits, median us and TFLOP/s (or the error
    that stopped it), printed as a JSON line."""
    try:
        c = call()
        rec["rel_err"] = ((c.float() - ref).norm() / ref.norm()).item()
        rec["run_to_run_bits"] = bool(torch.equal(c, call()))
        rec["us"] = eager_time_us(lambda *_: call(), [()], replays=10)
        rec["tflops"] = flops / rec["us"] / 1e6
    except Exception as exc:  # noqa: BLE001 (a kernel the compiler refuses is a result)
        rec["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    print(json.dumps(rec), flush=True)
    return rec


def offline(out_dir: str) -> dict:
    """Each Gluon tile compiled for sm_90a here (sass_report), on DeepSeek-V3's GEMM1 shape."""
    M, N, K = tl_probe.SHAPES["dsv3-gemm1"]
    a = torch.empty(M, K, dtype=torch.float8_e4m3fn)
    b = torch.empty(N, K, dtype=torch.float8_e4m3fn)
    a_s, b_s = torch.empty(M, K // 128), torch.empty(N // 128, K // 128)
    report = {f"{bm}x{bn} w{warps} s{stages}": sass_report(
        lambda: run_gluon(a, b, a_s, b_s, bm, bn, warps, stages, 132),
        os.path.join(out_dir, f"block_fp8_{bm}x{bn}_w{warps}_s{stages}.sass"))
        for bm, bn, warps, stages in GLUON_TILES}
    with open(os.path.join(out_dir, "block_fp8_offline.json"), "w") as f:
        json.dump(report, f, indent=1)
    return report


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "fp8_block_gluon.json"))
    ap.add_argument("--shapes", default=",".join(tl_probe.SHAPES))
    ap.add_argument("--sass", metavar="DIR", help="only compile the Gluon kernels for sm_90a here (no GPU)")
    args = ap.parse_args()
    if GLUON is not None:
        raise SystemExit(f"this triton has no Gluon Hopper module: {GLUON}")
    if args.sass:
        print(json.dumps(offline(args.sass), indent=1))
        return
    dev = torch.device("cuda")
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device=dev))
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    fp8 = torch.float8_e4m3fn
    results = []
    for name in args.shapes.split(","):
        M, N, K = tl_probe.SHAPES[name]
        flops = 2.0 * M * N * K
        a, b, a_s, b_s = tl_probe.operands(M, N, K, 2, fp8, dev)
        ref = tl_probe.reference(a, b, a_s, b_s, 2)
        a0, b0, a0_s, b0_s = tl_probe.operands(M, N, K, 0, fp8, dev)
        calls = [(f"gluon promoted {t}", lambda t=t: run_gluon(a, b, a_s, b_s, *t, sms), ref) for t in GLUON_TILES]
        calls += [(f"triton promoted {t}", lambda t=t: tl_probe.run(a, b, a_s, b_s, 2, *t, sms), ref)
                  for t in TRITON_TILES]
        ref0 = tl_probe.reference(a0, b0, a0_s, b0_s, 0)
        calls += [(f"triton fp8 unscaled {t}", lambda t=t: tl_probe.run(a0, b0, a0_s, b0_s, 0, *t, sms), ref0)
                  for t in TRITON_TILES]
        for label, call, r in calls:
            results.append(measure(dict(shape=name, M=M, N=N, K=K, kernel=label), call, r, flops))
        del a, b, a0, b0, ref, ref0
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(dev), torch=torch.__version__, triton=triton.__version__,
                       results=results), f, indent=1)


if __name__ == "__main__":
    sys.exit(main())

"""Probe: cuBLASLt called directly (kernels/cublaslt.py) for the block scheme's GEMM1 products,
against torch._scaled_mm, on an H200.

1. bits: the direct product against torch._scaled_mm (same operands, at offsets of larger
   buffers as in the layer) for several row counts and shapes, and the error against the fp32
   product of the dequantized operands;
2. host: host time of 256 launches (one an expert of DeepSeek-V3's GEMM1, 512 rows each) through
   torch and directly, and their GPU time;
3. algorithms: the heuristic's first 8 algorithms at row counts around the 512-row wave step,
   each timed over 64 experts;
4. layer: the block scheme's call at DeepSeek-V3 M = 8192 / 12288 / 16384, eagerly, alternating:
   GEMM1 on Gluon, on cuBLAS through torch, on cuBLAS directly, and the bf16 kernel;
5. sweep: the direct path's (PIECE_ROWS, SM_COUNT, STREAMS, CHUNK) at each M;
6. batched (only with --parts batched): the 256 experts' products as one strided batch at a
   fixed row capacity.

    PYTHONPATH=src python bench/cublaslt_block_probe_h200.py --out $OUT/h200-cublaslt-block-probe.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time

import torch

from moekit.benchmarks.gpu import _quant_call, eager_time_us, quantized_weights, routing_sets, shape_by_name
from moekit.experts.api import fused_experts
from moekit.kernels import cublas_block, cublaslt
from moekit.kernels.launch_quant import quant_tiles
from moekit.kernels.quant_rows import modes_of
from moekit.kernels.tuning import device_name
from moekit.quant import get_scheme


def _operands(m_total, N, K, E, gen):
    a = (torch.randn(m_total, K, device="cuda", generator=gen) * 2).to(torch.float8_e4m3fn)
    sa = torch.rand(m_total * (K // 128), device="cuda", generator=gen) + 0.5
    w = (torch.randn(E, N, K, device="cuda", generator=gen) * 2).to(torch.float8_e4m3fn)
    sw = torch.rand(E, N // 128, K // 128, device="cuda", generator=gen) * 0.01 + 0.001
    return a, sa, w, sw


def bits(doc, gen):
    rows = []
    for N, K in ((4096, 7168), (7168, 2048), (1024, 512), (3072, 1024)):
        for m in (4, 8, 12, 128, 500, 512, 516, 600, 1024):
            off = 36  # rows before this product's segment in the buffers
            a, sa, w, sw = _operands(off + m + 8, N, K, 2, gen)
            G = K // 128
            eng = cublaslt.engine(torch.device("cuda"), N, K, torch.bfloat16)
            out_d = torch.full((off + m + 8, N), float("nan"), device="cuda", dtype=torch.bfloat16)
            eng(m, a.data_ptr() + off * K, sa.data_ptr() + off * G * 4, w[1].data_ptr(), sw[1].data_ptr(),
                out_d.data_ptr() + off * N * 2, torch.cuda.current_stream().cuda_stream, 0)
            s_view = sa[off * G:(off + m) * G].view(G, m).t()
            ref_t = torch._scaled_mm(a[off:off + m], w[1].t(), s_view, sw[1].t(), out_dtype=torch.bfloat16)
            deq_a = a[off:off + m].float() * s_view.repeat_interleave(128, 1)
            deq_w = w[1].float() * sw[1].repeat_interleave(128, 0).repeat_interleave(128, 1)
            exact = deq_a @ deq_w.t()
            got = out_d[off:off + m].float()
            row = {"N": N, "K": K, "m": m, "equal_to_torch": bool(torch.equal(out_d[off:off + m], ref_t)),
                   "max_abs_diff_vs_torch": float((got - ref_t.float()).abs().max()),
                   "rel_err_vs_fp32": float((got - exact).norm() / exact.norm()),
                   "untouched_before": bool(out_d[:off].isnan().all()),
                   "untouched_after": bool(out_d[off + m:].isnan().all())}
            rows.append(row)
            print("bits", row, flush=True)
    doc["bits"] = rows


def host(doc, gen):
    N, K, E, m = 4096, 7168, 256, 512
    a, sa, w, sw = _operands(E * m, N, K, E, gen)
    G = K // 128
    out = torch.empty(E * m, N, device="cuda", dtype=torch.bfloat16)
    eng = cublaslt.engine(torch.device("cuda"), N, K, torch.bfloat16)
    stream = torch.cuda.current_stream().cuda_stream
    a_parts, o_parts = a.split(m), out.split(m)
    s_parts = [p.view(G, m).t() for p in sa.split(m * G)]

    def via_torch():
        for e in range(E):
            torch.ops.aten._scaled_mm.out(a_parts[e], w[e].t(), s_parts[e], sw[e].t(), out_dtype=torch.bfloat16,
                                          out=o_parts[e])

    def direct():
        a0, s0, o0, w0, sw0 = a.data_ptr(), sa.data_ptr(), out.data_ptr(), w.data_ptr(), sw.data_ptr()
        for e in range(E):
            eng(m, a0 + e * m * K, s0 + e * m * G * 4, w0 + e * N * K, sw0 + e * (N // 128) * G * 4,
                o0 + e * m * N * 2, stream, 0)

    res = {}
    for name, fn in (("torch", via_torch), ("direct", direct)) * 3:
        fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        ev0.record()
        fn()
        ev1.record()
        host_us = (time.perf_counter() - t0) * 1e6
        torch.cuda.synchronize()
        res.setdefault(name, []).append({"host_us_per_launch": host_us / E, "gpu_ms": ev0.elapsed_time(ev1),
                                         "tflops": 2 * E * m * N * K / (ev0.elapsed_time(ev1) * 1e-3) / 1e12})
    doc["host"] = res
    print("host", json.dumps(res), flush=True)
    o_d = out.clone()
    via_torch()
    doc["host_equal_bits"] = bool(torch.equal(o_d, out))


def algorithms(doc, gen):
    N, K, E = 4096, 7168, 64
    res = []
    for m in (512, 528, 576, 640, 1024):
        a, sa, w, sw = _operands(E * m, N, K, E, gen)
        G = K // 128
        out = torch.empty(E * m, N, device="cuda", dtype=torch.bfloat16)
        for ws_bytes in (0, 32 << 20):
            eng = cublaslt.engine(torch.device("cuda"), N, K, torch.bfloat16, workspace_bytes=ws_bytes)
            wsbuf = torch.empty(max(ws_bytes, 1), dtype=torch.uint8, device="cuda")
            found, _, _ = eng.algorithms(m, sa.data_ptr(), sw.data_ptr(), 8)
            stream = torch.cuda.current_stream().cuda_stream
            for i, r in enumerate(found):
                def run(r=r):
                    for e in range(E):
                        eng(m, a.data_ptr() + e * m * K, sa.data_ptr() + e * m * G * 4, w.data_ptr() + e * N * K,
                            sw.data_ptr() + e * (N // 128) * G * 4, out.data_ptr() + e * m * N * 2, stream,
                            wsbuf.data_ptr(), result=r)
                try:
                    us = eager_time_us(run, [()], replays=3) / E
                    row = {"m": m, "workspace": ws_bytes, "rank": i, "waves": r.waves, "ws_size": r.workspace_size,
                           "us_per_product": us, "tflops": 2 * m * N * K / (us * 1e-6) / 1e12}
                except RuntimeError as err:
                    row = {"m": m, "workspace": ws_bytes, "rank": i, "error": str(err)}
                res.append(row)
                print("algo", row, flush=True)
        del a, w, out
    doc["algorithms"] = res


def batched(doc, gen):
    """Whether cuBLASLt runs the recipe as one strided batch (experts at a fixed row capacity C,
    the scales of each batch member packed one after another), and how fast: DeepSeek-V3's GEMM1,
    256 experts, C = 576 and 512, against the products one by one."""
    import ctypes
    N, K, E = 4096, 7168, 256
    G = K // 128
    res = []
    for C in (512, 576):
        a, sa, w, sw = _operands(E * C, N, K, E, gen)
        out = torch.zeros(E * C, N, device="cuda", dtype=torch.bfloat16)
        eng = cublaslt.BlockScaledFp8(cublaslt._LIB["lib"], N, K, torch.bfloat16, 0)
        lib = eng.lib
        b, d = ctypes.c_void_p(), ctypes.c_void_p()
        lib.cublasLtMatrixLayoutCreate(ctypes.byref(b), 28, K, C, K)
        lib.cublasLtMatrixLayoutCreate(ctypes.byref(d), 14, N, C, N)
        set_attr = lib.cublasLtMatrixLayoutSetAttribute
        set_attr.argtypes, set_attr.restype = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t], ctypes.c_int
        st = []
        for layout, stride in ((eng.a_layout, N * K), (b, C * K), (d, C * N)):
            cnt, off = ctypes.c_int32(E), ctypes.c_int64(stride)
            st.append(set_attr(layout, 5, ctypes.byref(cnt), 4))
            st.append(set_attr(layout, 6, ctypes.byref(off), 8))
        row = {"C": C, "set_status": st}
        try:
            eng._set_scales(sa.data_ptr(), sw.data_ptr())
            results = (cublaslt._HeuristicResult * 4)()
            n = ctypes.c_int(0)
            hs = lib.cublasLtMatmulAlgoGetHeuristic(eng.handle, eng.desc, eng.a_layout, b, d, d, eng.pref, 4, results,
                                                    ctypes.byref(n))
            row.update(heuristic_status=hs, algos=n.value)
            if hs == 0 and n.value:
                stream = torch.cuda.current_stream().cuda_stream

                def run():
                    rc = lib.cublasLtMatmul(eng.handle, eng.desc, ctypes.byref(eng.alpha), w.data_ptr(), eng.a_layout,
                                            a.data_ptr(), b, ctypes.byref(eng.beta), out.data_ptr(), d, out.data_ptr(), d,
                                            ctypes.byref(results[0].algo), None, 0, stream)
                    if rc:
                        raise RuntimeError(f"matmul status {rc}")
                run()
                torch.cuda.synchronize()
                errs = []
                for e in (0, 1, 77, E - 1):
                    ref = torch._scaled_mm(a[e * C:(e + 1) * C], w[e].t(), sa[e * C * G:(e + 1) * C * G].view(G, C).t(),
                                           sw[e].t(), out_dtype=torch.bfloat16)
                    errs.append({"e": e, "equal": bool(torch.equal(ref, out[e * C:(e + 1) * C])),
                                 "max_diff": float((ref.float() - out[e * C:(e + 1) * C].float()).abs().max())})
                row["checks"] = errs
                us = eager_time_us(run, [()], replays=5)
                row.update(us=us, tflops=2 * E * C * N * K / (us * 1e-6) / 1e12)
        except Exception as err:  # noqa: BLE001
            row["error"] = f"{type(err).__name__}: {err}"
        res.append(row)
        print("batched", row, flush=True)
        del a, w, out
    doc["batched"] = res


# (PIECE_ROWS, SM_COUNT, STREAMS, CHUNK) of the direct path, timed after the alternating rounds
SWEEP = ((0, 0, 1, 256), (0, 0, 4, 4), (0, 66, 2, 4), (0, 66, 4, 4), (0, 44, 3, 4), (0, 44, 6, 2), (0, 33, 4, 4),
         (0, 33, 8, 2), (0, 100, 4, 4), (0, 120, 4, 4))


def layer(doc, Ms, rounds, gen):
    _, E, k, H, I = shape_by_name("deepseek-v3")
    sch = get_scheme("fp8_w8a8_block128")
    wts = quantized_weights(sch.name, E, H, I, False, "cuda")
    bf16 = (torch.randn(E, 2 * I, H, device="cuda", dtype=torch.bfloat16) * H ** -0.5,
            torch.randn(E, H, I, device="cuda", dtype=torch.bfloat16) * I ** -0.5)
    doc["layer"], doc["streams"] = [], []
    for M in Ms:
        sets = routing_sets(M, E, k, H, 2, torch.bfloat16, "cuda")
        cfg, knobs = quant_tiles(M, E, k, H, I, torch.bfloat16, device_name(), sch, modes_of(sch))

        def quant(mode, direct):
            kn = dataclasses.replace(knobs, cublas1=mode)

            def fn(x, w, i):
                cublas_block.USE_DIRECT = direct
                return _quant_call(wts, x, w, i, cfg, kn)
            return fn
        fns = {"gluon": quant("off", True), "cublas_torch": quant("on", False), "cublas_direct": quant("on", True),
               "bf16": lambda x, w, i: fused_experts(x, bf16[0], bf16[1], w, i, backend="triton")}
        with torch.inference_mode():
            outs = {n: fns[n](*sets[0]) for n in ("cublas_torch", "cublas_direct")}
            same = bool(torch.equal(outs["cublas_torch"], outs["cublas_direct"]))
            times = {n: [] for n in fns}
            for _ in range(rounds):
                for n, fn in fns.items():
                    times[n].append(eager_time_us(fn, sets, replays=3))
            hosts = {}
            for n in ("cublas_torch", "cublas_direct"):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                fns[n](*sets[0])
                hosts[n] = (time.perf_counter() - t0) * 1e6
                torch.cuda.synchronize()
        med = {n: statistics.median(v) for n, v in times.items()}
        row = {"M": M, "us": med, "rounds_us": times, "host_us_a_call": hosts, "direct_equals_torch_bits": same,
               "bf16_over": {n: med["bf16"] / med[n] for n in ("gluon", "cublas_torch", "cublas_direct")}}
        doc["layer"].append(row)
        print("layer", json.dumps(row), flush=True)
        for piece, sms, streams, chunk in SWEEP:
            cublas_block.PIECE_ROWS, cublas_block.STREAMS, cublas_block.CHUNK = piece, streams, chunk
            cublas_block.SM_COUNT = sms
            cublas_block._STREAMS.clear()
            with torch.inference_mode():
                ts = [eager_time_us(fns["cublas_direct"], sets, replays=3) for _ in range(3)]
            row = {"M": M, "piece_rows": piece, "sm_count": sms, "streams": streams, "chunk": chunk, "us": statistics.median(ts),
                   "rounds": ts, "bf16_over": med["bf16"] / statistics.median(ts)}
            doc["streams"].append(row)
            print("sweep", row, flush=True)
        cublas_block.PIECE_ROWS, cublas_block.STREAMS, cublas_block.CHUNK = 0, 4, 4
        cublas_block.SM_COUNT = 0
        cublas_block._STREAMS.clear()
        del sets
    cublas_block.USE_DIRECT = True


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    p.add_argument("--M", type=int, nargs="+", default=[12288, 16384])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--parts", nargs="+", default=["bits", "host", "algorithms", "layer"])
    args = p.parse_args()
    doc = {"torch": torch.__version__, "cuda": torch.version.cuda, "device": torch.cuda.get_device_name(),
           "refusal": cublaslt.refusal()}
    print(doc, flush=True)
    if doc["refusal"] is None:
        lib = cublaslt._LIB["lib"]
        doc["cublaslt_version"] = int(lib.cublasLtGetVersion())
        doc["grouped_layout_symbol"] = hasattr(lib, "cublasLtGroupedMatrixLayoutCreate")
    gen = torch.Generator(device="cuda").manual_seed(0)

    def save():
        if args.out:
            with open(args.out, "w") as f:
                json.dump(doc, f, indent=1, default=str)
    for part in args.parts:
        t0 = time.time()
        try:
            if part == "layer":
                layer(doc, args.M, args.rounds, gen)
            else:
                globals()[part](doc, gen)
        except Exception as err:  # noqa: BLE001 - one failing part is recorded, the others still run
            doc[f"{part}_error"] = f"{type(err).__name__}: {err}"
            print(f"{part} failed: {err}", flush=True)
        doc[f"{part}_seconds"] = time.time() - t0
        save()
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())

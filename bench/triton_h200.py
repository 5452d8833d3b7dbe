"""The Triton experts on one H200: tune the five PERF.md shapes, then benchmark against peers.

    PYTHONPATH=src python bench/triton_h200.py tune --out DIR [--budget S] [--workers N]
    MOEKIT_TUNED_CONFIG_DIR=DIR PYTHONPATH=src python bench/triton_h200.py bench --out FILE.json
    PYTHONPATH=src python bench/triton_h200.py align

`tune` writes one E=..,N=..,device_name=...json per shape into DIR (ship them in
src/moekit/kernels/configs/) and DIR/tune_log.json; `bench` writes the results JSON that
bench/results/h200-triton-experts.json holds; `align` times the two alignment variants.

M = 1 depends on where the weights land in physical memory (bench/results/h200-m1-state.json:
up to 10 % after the process freed a large block); PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
in the environment removes that spread, and `bench` records the setting it ran under.
"""

import argparse
import json
import os
import statistics
import sys
import time

import torch

from moekit.benchmarks.gpu import GPU_MS, GPU_SHAPES, graph_time_us, precompile, run_gpu_bench
from moekit.cli.tune import plan_shape, search_shape, write_configs
from moekit.kernels.launch import moe_align
from moekit.kernels.tuning import device_name, get_config, use_direct

TUNE_MS = (1, 16, 64, 256, 1024, 4096, 16384)


def measured_ceilings() -> dict:
    """A device-to-device copy (bytes read + written) and an 8192^3 bf16 GEMM on random data."""
    src = torch.randn(2**30 // 2, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    out = {}
    for name, fn, work in (("copy_bytes_per_s", lambda: dst.copy_(src), 2 * src.numel() * 2),
                           ("bf16_gemm_flops", lambda: a @ b, 2 * 8192**3)):
        for _ in range(3):
            fn()
        times = []
        for _ in range(10):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            e.synchronize()
            times.append(s.elapsed_time(e) * 1e-3)
        out[name] = work / statistics.median(times)
    return out


def tune(args) -> None:
    dtype = torch.bfloat16
    plans, jobs = {}, []
    for name, E, k, H, I in GPU_SHAPES:
        plans[name], shape_jobs = plan_shape(E, k, H, I, dtype, TUNE_MS)
        jobs += shape_jobs
    t0 = time.time()
    failures = precompile(jobs, args.workers)
    print(f"compiled {len(jobs)} jobs in {time.time() - t0:.0f} s, {len(failures)} failed", flush=True)
    for f in failures[:5]:
        print("  failed:", f, flush=True)
    log = {"device": torch.cuda.get_device_name(), "compile_s": time.time() - t0, "failures": failures, "shapes": {}}
    for name, E, k, H, I in GPU_SHAPES:
        t1 = time.time()
        table, info = search_shape(E, k, H, I, dtype, plans[name], budget_s=args.budget)
        path = write_configs(table, E, I, device_name(), dtype, args.out)
        log["shapes"][name] = {str(M): dict(info[M], config=table[M].to_json()) for M in table}
        for M in sorted(info):
            i = info[M]
            print(f"{name:14s} M={M:6d} {i['us']:9.1f} us (heuristic {i['default_us']:9.1f}, {i['tried']} tried)",
                  flush=True)
        print(f"{name}: {time.time() - t1:.0f} s -> {path}", flush=True)
        with open(os.path.join(args.out, "tune_log.json"), "w", encoding="utf-8") as fh:
            json.dump(log, fh, indent=1)


def bench(args) -> None:
    ceilings = measured_ceilings()
    print(f"measured: copy {ceilings['copy_bytes_per_s'] / 1e12:.2f} TB/s, "
          f"bf16 GEMM {ceilings['bf16_gemm_flops'] / 1e12:.0f} TFLOP/s", flush=True)
    shapes = [s for s in GPU_SHAPES if not args.shapes or s[0] in args.shapes.split(",")]
    Ms = [int(m) for m in args.ms.split(",")] if args.ms else GPU_MS
    jobs = [(H, I, "bfloat16", "silu", use_direct(M, k, E),
             get_config(M, E, k, H, I, torch.bfloat16, device_name()).to_json())
            for _, E, k, H, I in shapes for M in Ms]
    t0 = time.time()
    failures = precompile(jobs, args.workers)
    print(f"compiled {len(jobs)} jobs in {time.time() - t0:.0f} s, {len(failures)} failed", *failures[:5],
          sep="\n", flush=True)
    result = run_gpu_bench(shapes, Ms, None, progress=lambda line: print(line, flush=True))
    result["measured_ceilings"] = ceilings
    result["alloc_conf"] = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    result["tuned_config_dir"] = os.environ.get("MOEKIT_TUNED_CONFIG_DIR")
    with open(args.out, "w", encoding="utf-8") as fh:
        json.dump(result, fh, indent=1)
    print("\nshape           M      triton_us  %floor  vs_moekit_gmm  vs_torch_gmm  vs_hf_gmm  rel_err")
    for r in result["records"]:
        t = r["impls"].get("moekit_triton", {})
        print(f"{r['shape']:14s} {r['M']:6d} {t.get('us', float('nan')):10.1f} {t.get('pct_of_floor', float('nan')):6.1f}"
              f" {r.get('speedup_vs_moekit_grouped_mm', float('nan')):13.2f} {r.get('speedup_vs_torch_grouped_gemm', float('nan')):13.2f}"
              f" {r.get('speedup_vs_hf_grouped_mm', float('nan')):10.2f}  {r.get('rel_err_vs_reference', float('nan')):.1e}")


def align(args) -> None:
    for E, k in ((8, 2), (128, 8), (256, 8)):
        for T in (16, 64, 128, 256, 1024, 4096, 16384):
            ids = [torch.stack([torch.randperm(E, device="cuda")[:k] for _ in range(T)]).int() for _ in range(4)]
            row = []
            for small_max in (10**9, 0):
                if small_max and T * k > 4096:
                    row.append(float("nan"))
                    continue
                us = graph_time_us(lambda i: moe_align(i, None, E, 16, small_max=small_max), [(i,) for i in ids])
                row.append(us)
            print(f"align E={E:3d} k={k} T={T:6d} TK={T * k:7d}: one program {row[0]:8.1f} us, chunked {row[1]:8.1f} us",
                  flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("tune")
    t.add_argument("--out", required=True)
    t.add_argument("--budget", type=float, default=None)
    t.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 2))
    t.set_defaults(func=tune)
    b = sub.add_parser("bench")
    b.add_argument("--out", required=True)
    b.add_argument("--shapes", default="")
    b.add_argument("--ms", default="")
    b.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 2))
    b.set_defaults(func=bench)
    a = sub.add_parser("align")
    a.set_defaults(func=align)
    args = p.parse_args()
    with torch.inference_mode():
        args.func(args)
    sys.stdout.flush()


if __name__ == "__main__":
    main()

"""Calls of the Triton experts for Nsight Compute: each point is built and warmed up (compiled,
autotuned tables read) outside the profiled range, then one call per point runs between
cudaProfilerStart and cudaProfilerStop, with an NVTX range named after the point.

    ncu --clock-control none --profile-from-start off --nvtx --print-nvtx-rename kernel \\
        --section SpeedOfLight ... python bench/ncu_points_h200.py \\
        --points qwen3-30b-a3b:fp8_w8a8:256:static,mixtral-8x7b:bf16:256 [--read-gb 1]

A point is shape:scheme:M[:static] as in profile_h200.py ("bf16" for unquantized weights).
--read-gb also profiles torch's sum over a buffer of that many GB: what a plain read of DRAM
reaches under the same profiler settings, the yardstick for the GEMMs' DRAM throughput.
"""

import argparse

import torch

from moekit.benchmarks.gpu import _quant_call, quantized_weights, routing_sets, shape_by_name
from moekit.experts.api import fused_experts


def build_point(spec: str):
    parts = spec.split(":")
    name, scheme, M = parts[0], parts[1], int(parts[2])
    static = len(parts) > 3 and parts[3] == "static"
    _, E, k, H, I = shape_by_name(name)
    if scheme == "bf16":
        w13 = torch.randn(E, 2 * I, H, device="cuda", dtype=torch.bfloat16) * H ** -0.5
        w2 = torch.randn(E, H, I, device="cuda", dtype=torch.bfloat16) * I ** -0.5
        fn = lambda x, w, i: fused_experts(x, w13, w2, w, i, backend="triton")  # noqa: E731
    else:
        wts = quantized_weights(scheme, E, H, I, static, "cuda")
        fn = lambda x, w, i: _quant_call(wts, x, w, i)  # noqa: E731
    return fn, routing_sets(M, E, k, H, 2, torch.bfloat16, "cuda")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--points", required=True, help="comma-separated shape:scheme:M[:static]")
    p.add_argument("--read-gb", type=float, default=0.0)
    args = p.parse_args()
    cudart = torch.cuda.cudart()
    with torch.inference_mode():
        for spec in args.points.split(","):
            fn, sets = build_point(spec)
            fn(*sets[0])  # compile and warm up outside the profiled range
            torch.cuda.synchronize()
            cudart.cudaProfilerStart()
            torch.cuda.nvtx.range_push(spec)
            fn(*sets[1])
            torch.cuda.nvtx.range_pop()
            torch.cuda.synchronize()
            cudart.cudaProfilerStop()
            del fn, sets
            torch.cuda.empty_cache()
            print(f"profiled {spec}", flush=True)
        if args.read_gb > 0:
            buf = torch.ones(int(args.read_gb * 2 ** 30) // 4, device="cuda", dtype=torch.float32)
            buf.sum()
            torch.cuda.synchronize()
            cudart.cudaProfilerStart()
            torch.cuda.nvtx.range_push(f"read {args.read_gb} GB")
            buf.sum()
            torch.cuda.nvtx.range_pop()
            torch.cuda.synchronize()
            cudart.cudaProfilerStop()
            print("profiled the read", flush=True)


if __name__ == "__main__":
    main()

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

from moekit.benchmarks.gpu import point_call


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--points", required=True, help="comma-separated shape:scheme:M[:static]")
    p.add_argument("--read-gb", type=float, default=0.0)
    args = p.parse_args()
    cudart = torch.cuda.cudart()
    with torch.inference_mode():
        for spec in args.points.split(","):
            fn, sets, _, _, _ = point_call(spec, 2)
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

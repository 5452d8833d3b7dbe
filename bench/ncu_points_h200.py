"""Calls of the Triton experts for Nsight Compute: each point is built and warmed up (compiled,
autotuned tables read) outside the profiled range, then one call per point runs between
cudaProfilerStart and cudaProfilerStop, with an NVTX range named after the point.

    ncu --clock-control none --profile-from-start off --nvtx --print-nvtx-rename kernel \\
        --section SpeedOfLight ... python bench/ncu_points_h200.py \\
        --points qwen3-30b-a3b:fp8_w8a8:256:static,mixtral-8x7b:bf16:256 [--read-gb 1]

A point is shape:scheme:M[:static] as in profile_h200.py ("bf16" for unquantized weights), or
probe:w13|w2:EXPERTS[:NAME=VALUE+...]: weight_layout_probe_h200's stripped-down decode GEMM over
Qwen3-30B-A3B's fp8 w13 or w2 for that many experts (its stream_kernel flags, e.g.
probe:w2:82:STORE=1+MASK_A=True, and BM, BN, BK, WARPS, STAGES: the tile, 16 x 64 x 128 with 4
warps and 4 stages by default), to set beside the shipped kernels' counters.
--read-gb also profiles torch's sum over a buffer of that many GB: what a plain read of DRAM
reaches under the same profiler settings, the yardstick for the GEMMs' DRAM throughput.
"""

import argparse

import torch

from moekit.benchmarks.gpu import point_call


def probe_call(spec: str):
    """(fn of no arguments, its argument sets: one empty) of a probe:... point (see the module doc)."""
    from weight_layout_probe_h200 import stream_kernel  # noqa: PLC0415 (a sibling script)

    _, which, n, *more = spec.split(":")
    N, K = {"w13": (1536, 2048), "w2": (2048, 768)}[which]
    E, used = 128, int(n)
    flags = dict(SWAP=True, TWO=False, GROUP=1, MASK_A=False, STORE=0)
    tile = dict(BM=16, BN=64, BK=128, WARPS=4, STAGES=4)
    for item in (more[0].split("+") if more else []):
        name, value = item.split("=")
        (tile if name in tile else flags)[name] = int(value) if value.isdigit() else value == "True"
    BM, BN = tile["BM"], tile["BN"]
    w = (torch.randn(E, N, K, device="cuda") * 0.1).to(torch.float8_e4m3fn)
    a = (torch.randn(BM, K, device="cuda") * 0.1).to(torch.float8_e4m3fn)
    experts = torch.randperm(E, device="cuda")[:used].to(torch.int32)
    grid = used * (N // BN // (2 if flags["TWO"] else 1))
    out = torch.empty(grid, device="cuda")
    y = torch.empty(grid * BM, BN, dtype=torch.bfloat16, device="cuda")

    def fn():
        stream_kernel[(grid,)](a, w, experts, out, y, N, K, used, BM=BM, BN=BN, BK=tile["BK"], TILED=False,
                               num_warps=tile["WARPS"], num_stages=tile["STAGES"], **flags)
    return fn, [(), ()]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--points", required=True, help="comma-separated shape:scheme:M[:static] or probe:... points")
    p.add_argument("--read-gb", type=float, default=0.0)
    args = p.parse_args()
    cudart = torch.cuda.cudart()
    with torch.inference_mode():
        for spec in args.points.split(","):
            fn, sets = probe_call(spec) if spec.startswith("probe:") else point_call(spec, 2)[:2]
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

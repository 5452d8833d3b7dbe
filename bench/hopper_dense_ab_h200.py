"""moekit's 16-bit CUDA experts kernels (kernels/hopper_block.py dense_experts) against the shipped
bf16 Triton call, in one process.

For each point "shape:M": the shipped call (fused_experts, backend "triton") and the CUDA pipeline
(alignment, x gathered in sorted order, GEMM1, GEMM2, sum over k) ; outputs against the shipped call's (relative
error), CUDA-graph times interleaved over --rounds with fresh routing per replay, then one
profiled eager pass of each variant (kernel times per call).

    PYTHONPATH=src python bench/hopper_dense_ab_h200.py --point qwen3-30b-a3b:4096 [--point ...]
        [--rounds 3] [--out FILE]
"""

import statistics
import time

import torch

from moekit.benchmarks.gpu import AB_TIMING, ab_arg_parser, ab_time_us, routing_sets, shape_by_name, write_ab_result
from moekit.experts.api import fused_experts
from moekit.benchmarks.floors import layer_flops
from moekit.kernels import hopper_block
from profile_h200 import _kernel_rows, profile_calls


def _kernels(fn, sets) -> list:
    return [(r["kernel"][:100], r["us_per_call"]) for r in _kernel_rows(profile_calls(fn, sets), len(sets))]


def main() -> None:
    p = ab_arg_parser(__doc__, "hopper_dense_ab.json")
    p.add_argument("--point", action="append", required=True, help="shape:M (repeatable)")
    args = p.parse_args()
    t0 = time.perf_counter()
    print("hopper_block:", hopper_block.status(), f"({time.perf_counter() - t0:.1f} s)", flush=True)
    rows = []
    for point in args.point:
        name, M = point.split(":")[0], int(point.split(":")[1])
        _, E, k, H, I = shape_by_name(name)
        sets = routing_sets(M, E, k, H, 4 if M >= 4096 else 8, torch.bfloat16, "cuda")
        w13 = torch.randn(E, 2 * I, H, device="cuda", dtype=torch.bfloat16) * H ** -0.5
        w2 = torch.randn(E, H, I, device="cuda", dtype=torch.bfloat16) * I ** -0.5
        calls = {"triton": lambda x, w, i: fused_experts(x, w13, w2, w, i, backend="triton")}
        calls["cuda"] = lambda x, w, i: hopper_block.dense_experts(x, w13, w2, w, i)
        flop = layer_flops(M, k, H, I)
        row = {"point": point, "variants": {label: {"rounds_us": []} for label in calls}}
        ref = [calls["triton"](*s) for s in sets]
        for label, fn in list(calls.items())[1:]:
            try:
                outs = [fn(*s) for s in sets]
                torch.cuda.synchronize()
                v = row["variants"][label]
                v["rel_err_vs_triton"] = max(((o.float() - r.float()).norm() / r.float().norm()).item()
                                             for o, r in zip(outs, ref))
                v["run_to_run_bits"] = all(torch.equal(o, fn(*s)) for o, s in zip(outs, sets))
                v["grids"] = [hopper_block.load().moekit_block_last_grid(m) for m in (1, 2)]
                print(f"{point} {label}: rel err vs triton {v['rel_err_vs_triton']:.2e}, run to run "
                      f"{v['run_to_run_bits']}", flush=True)
            except Exception as exc:  # noqa: BLE001 (a variant that cannot run is a result)
                row["variants"][label] = {"failed": f"{type(exc).__name__}: {exc}"[:800]}
                print(f"{point} {label} failed: {row['variants'][label]['failed']}", flush=True)
        for _ in range(args.rounds):
            for label, fn in calls.items():
                v = row["variants"][label]
                if "failed" not in v:
                    v["rounds_us"].append(ab_time_us(fn, sets, True, replays=5))
        base = statistics.median(row["variants"]["triton"]["rounds_us"])
        for label, v in row["variants"].items():
            if "failed" in v:
                continue
            v["us"] = statistics.median(v["rounds_us"])
            v["tflops"] = flop / v["us"] / 1e6
            v["kernels_us"] = _kernels(calls[label], sets[:2])
            print(f"{point:22s} {label:14s} {v['us']:10.1f} us {v['tflops']:7.1f} TFLOP/s  x{base / v['us']:.3f} "
                  "vs triton", flush=True)
            for kname, us in v["kernels_us"][:6]:
                print(f"      {us:10.1f} us  {kname}", flush=True)
        rows.append(row)
        del calls, sets, w13, w2
        torch.cuda.empty_cache()
    write_ab_result(args.out, "hopper-dense-ab", True, AB_TIMING, rows=rows)


if __name__ == "__main__":
    main()

"""What uniform random routing costs the Triton experts against routing that gives every expert
the same number of rows, at the points where targets are missed (one H200).

    PYTHONPATH=src python bench/balance_probe_h200.py --points mixtral-8x7b:bf16:256,qwen3-30b-a3b:bf16:4096
        [--rounds 3] [--out FILE]

A point is shape:scheme:M[:static] as in profile_h200.py. For each point two routings go
through the same call (the shipped tables): "uniform" (softmax top-k of random logits, as
the benchmark draws them) and "balanced" (token t takes experts (t k + j) mod E under a
random relabelling of the experts per call, so each expert gets exactly M k / E rows; M k
must be a multiple of E). Both are timed in CUDA graphs in alternation, several calls per
graph with fresh routing each, and each kernel's device time is read off torch.profiler
over eager calls. The difference says how much of a call goes to the rows an expert's
count leaves in padded or half-used tiles (and to uneven waves), as opposed to the
kernels' pace on whole tiles.

`--device cpu` is a dry run under TRITON_INTERPRET=1 on a tiny bf16 shape.
"""

import json
import os
import statistics

import torch

from moekit.benchmarks.floors import floor_seconds
from moekit.benchmarks.gpu import (PERF_TABLE_CEILINGS, ab_arg_parser, ab_device, ab_time_us, point_call,
                                   quant_floor_terms, write_ab_result)
from profile_h200 import _kernel_rows, profile_calls


def balanced_sets(M: int, E: int, k: int, H: int, n: int, dtype, device, gen=None) -> list:
    """n (x [M, H], weights [M, k] fp32, ids [M, k] int32) where every expert has exactly M k / E
    assignments, the experts relabelled at random per set and the tokens shuffled."""
    if (M * k) % E:
        raise ValueError(f"balanced routing needs M * k to be a multiple of E, got M={M}, k={k}, E={E}")
    base = (torch.arange(M, device=device)[:, None] * k + torch.arange(k, device=device)[None, :]) % E
    sets = []
    for _ in range(n):
        relabel = torch.randperm(E, device=device, generator=gen)
        ids = relabel[base][torch.randperm(M, device=device, generator=gen)].to(torch.int32)
        w = torch.softmax(torch.randn(M, k, device=device, generator=gen), dim=1)
        sets.append((torch.randn(M, H, device=device, generator=gen).to(dtype), w, ids))
    return sets


def kernel_us(fn, sets) -> dict:
    """Device microseconds per call of each kernel over eager calls of fn on sets, largest first."""
    return {r["kernel"][:100]: r["us_per_call"] for r in _kernel_rows(profile_calls(fn, sets), len(sets))}


def probe(spec: str, rounds: int, cuda: bool, calls: int) -> dict:
    if cuda:
        fn, uniform, (E, k, H, I), scheme = point_call(spec, calls)
    else:
        fn, uniform, (E, k, H, I), scheme = _cpu_point(calls)
    M = uniform[0][0].shape[0]
    device = uniform[0][0].device
    balanced = balanced_sets(M, E, k, H, calls, uniform[0][0].dtype, device)
    counts = torch.bincount(uniform[0][2].flatten().long(), minlength=E)
    bpw, fscale = (2.0, 1.0) if scheme == "bf16" else quant_floor_terms(scheme)
    floor = floor_seconds(M, E, k, H, I, bpw, PERF_TABLE_CEILINGS, fscale) * 1e6
    times = {"uniform": [], "balanced": []}
    with torch.inference_mode():
        for _ in range(rounds):
            for name, sets in (("uniform", uniform), ("balanced", balanced)):
                times[name].append(ab_time_us(fn, sets, cuda))
        kernels = {name: kernel_us(fn, sets) for name, sets in (("uniform", uniform), ("balanced", balanced))} \
            if cuda else {}
    row = {"point": spec, "rows_per_expert": M * k / E, "uniform_counts_min_max": [int(counts.min()), int(counts.max())],
           "floor_us": floor}
    for name, ts in times.items():
        us = statistics.median(ts)
        row[name] = {"us": us, "rounds_us": ts, "pct_of_floor": 100 * floor / us, "kernels_us": kernels.get(name, {})}
    row["uniform_over_balanced"] = row["uniform"]["us"] / row["balanced"]["us"]
    print(f"== {spec}: {M * k / E:.1f} rows an expert (uniform draw {row['uniform_counts_min_max']}); "
          f"uniform {row['uniform']['us']:.1f} us ({row['uniform']['pct_of_floor']:.1f} %), balanced "
          f"{row['balanced']['us']:.1f} us ({row['balanced']['pct_of_floor']:.1f} %), x{row['uniform_over_balanced']:.3f}",
          flush=True)
    for name in times:
        for kname, us in list(row[name]["kernels_us"].items())[:5]:
            print(f"   {name:9s} {us:9.1f} us  {kname}", flush=True)
    return row


def _cpu_point(calls: int):
    """The dry run's point: a tiny bf16-like shape in fp32 through the shipped path's launcher."""
    from moekit.benchmarks.gpu import routing_sets  # noqa: PLC0415
    from moekit.kernels.launch import fused_moe  # noqa: PLC0415

    E, k, H, I = 8, 2, 64, 32
    w13 = torch.randn(E, 2 * I, H) * H ** -0.5
    w2 = torch.randn(E, H, I) * I ** -0.5
    fn = lambda x, w, i: fused_moe(x, w13, w2, None, None, w, i, None, "silu", out_dtype=x.dtype)  # noqa: E731
    return fn, routing_sets(16, E, k, H, calls, torch.float32, "cpu"), (E, k, H, I), "bf16"


def main() -> None:
    p = ab_arg_parser(__doc__, "h200-balance-probe.json")
    p.add_argument("--points", default="mixtral-8x7b:bf16:256")
    p.add_argument("--calls", type=int, default=8, help="calls per graph, each with its own routing")
    args = p.parse_args()
    cuda, _ = ab_device(args)
    rows = [probe(s, args.rounds, cuda, args.calls) for s in (args.points.split(",") if cuda else ["cpu"])]
    write_ab_result(args.out, "balance_probe", cuda, "CUDA graphs of --calls calls with fresh routing, "
                    "uniform and balanced in alternation, medians of --rounds; kernels by torch.profiler "
                    "over eager calls", points=rows)


if __name__ == "__main__":
    main()

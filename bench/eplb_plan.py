"""EPLB policy: planning time and balancedness.

Planning time: `rebalance_experts` (vectorised over layers) against the same policy as a
plain per-layer Python loop (`rebalance_experts_loop`), same process, same loads, for the
DeepSeek-V3 shape: 61 layers x 256 experts -> 288 slots on 4 nodes x 8 GPUs, with 8 expert
groups (hierarchical policy) and without groups (global policy). Median of --reps runs,
with torch's default thread count and with one thread (the policy's tensors are small; on
a shared machine a second intra-op thread mostly adds waiting).

Balancedness (mean / max load per GPU, overall = sum of means / sum of maxima) on
log-normal (sigma 1.0) and Zipf (alpha 1.0) loads, several seeds: EP32 with 32 redundant
experts and EP8 with 0 and 32, before (contiguous blocks, no replicas) and after.

    python bench/eplb_plan.py --out bench/results/eplb-plan-cpu.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import time

import torch

from moekit.benchmarks.cpu import cpu_model
from moekit.cli.eplb import synthetic_load
from moekit.eplb.policy import (balancedness, gpu_loads, rebalance_experts, rebalance_experts_loop,
                                static_gpu_loads)

LAYERS, EXPERTS, SLOTS, NODES, GPUS = 61, 256, 288, 4, 32

# (name, P, N, G, redundant)
SETUPS = [
    ("EP32, 32 redundant, global (G=1)", 32, 4, 1, 32),
    ("EP32, 32 redundant, hierarchical (G=8, N=4)", 32, 4, 8, 32),
    ("EP8, no redundant", 8, 1, 1, 0),
    ("EP8, 32 redundant", 8, 1, 1, 32),
]


def _median_time(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def time_plans(reps: int, loop_reps: int):
    """Median plan times with torch's default thread count and with one thread."""
    load = synthetic_load("lognormal", LAYERS, EXPERTS, 1_000_000, sigma=1.0, seed=0)
    default_threads = torch.get_num_threads()
    rows = []
    for threads in sorted({default_threads, 1}, reverse=True):
        torch.set_num_threads(threads)
        for groups in (8, 1):
            fast = lambda: rebalance_experts(load, SLOTS, groups, NODES, GPUS)  # noqa: E731
            loop = lambda: rebalance_experts_loop(load, SLOTS, groups, NODES, GPUS)  # noqa: E731
            fast()  # warm-up
            same = torch.equal(fast()[0], loop()[0])
            t_fast, t_loop = _median_time(fast, reps), _median_time(loop, loop_reps)
            rows.append({"threads": threads, "groups": groups,
                         "policy": "hierarchical" if groups % NODES == 0 else "global",
                         "vectorised_s": round(t_fast, 5), "python_loop_s": round(t_loop, 5),
                         "speedup": round(t_loop / t_fast, 1), "same_placement": same})
    torch.set_num_threads(default_threads)
    return rows


def balance(seeds):
    rows = []
    for dist, shape in (("lognormal", {"sigma": 1.0}), ("zipf", {"alpha": 1.0})):
        for name, P, N, G, red in SETUPS:
            before, after = [], []
            for seed in seeds:
                load = synthetic_load(dist, LAYERS, EXPERTS, 1_000_000, seed=seed, **shape)
                phy2log = rebalance_experts(load, EXPERTS + red, G, N, P)[0]
                before.append(balancedness(static_gpu_loads(load, P))[1])
                after.append(balancedness(gpu_loads(load, phy2log, P))[1])
            rows.append({"loads": dist, **shape, "setup": name, "gpus": P, "nodes": N, "groups": G,
                         "redundant": red, "seeds": list(seeds),
                         "before_mean": round(statistics.mean(before), 4),
                         "after_mean": round(statistics.mean(after), 4), "after_min": round(min(after), 4)})
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=21, help="timed runs of the vectorised policy (median)")
    p.add_argument("--loop-reps", type=int, default=5, help="timed runs of the Python loop (median)")
    p.add_argument("--seeds", type=int, default=5, help="load seeds for balancedness")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    timing = time_plans(args.reps, args.loop_reps)
    for r in timing:
        print(f"plan {LAYERS}x{EXPERTS}->{SLOTS}, {NODES} nodes x {GPUS // NODES} GPUs, G={r['groups']}, "
              f"{r['threads']} thread(s) "
              f"({r['policy']}): {r['vectorised_s'] * 1e3:.2f} ms vectorised, {r['python_loop_s'] * 1e3:.1f} ms "
              f"loop ({r['speedup']}x), same placement: {r['same_placement']}")
    bal = balance(range(args.seeds))
    for r in bal:
        print(f"{r['loads']:9s} {r['setup']:45s} before {r['before_mean']:.4f}  after {r['after_mean']:.4f} "
              f"(min over seeds {r['after_min']:.4f})")
    if args.out:
        result = {
            "benchmark": "eplb_plan",
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": cpu_model(),
            "cpu_threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "python": platform.python_version(),
            "command": "python bench/eplb_plan.py " + " ".join(sys.argv[1:] if argv is None else argv),
            "note": "the machine's 2 cores were shared with other jobs; times are medians",
            "plan_time": timing,
            "balancedness": bal,
        }
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

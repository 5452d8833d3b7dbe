"""The decode regime of the Triton experts (M = 1..256) on one H200, in one call: the GPU tests,
a sweep of the decode knobs (kernels.tuning: SPLIT_K, GEMV, PDL) with `moekit tune`'s search,
a compact table and the tuned JSON files.

    PYTHONPATH=src python bench/triton_decode_h200.py [--out DIR] [--workers N] [--budget S]
        [--deadline S] [--shapes a,b] [--ms 1,16,64,256] [--no-tests | --pytest "ARGS"]

Steps: `pytest -m gpu tests/kernels -q` runs in a child process while every candidate compiles in
parallel processes; then, per shape and M, the tuner's search (kernels.tuning.search_space with the
decode knobs, then late_variants) with the shipped entry as one more candidate; the winner is
checked against `reference` (a failing one gives way to the next fastest); shipped entry and
winner are timed again side by side (more calls, more replays); the sum over k is timed with its
old and new tiling. Writes DIR/decode_results.json (every timing) and
DIR/configs/E=..,N=..,device_name=NVIDIA_H200.json: the shipped table with the measured M entries
replaced where the winner was at least 1% faster, ready for src/moekit/kernels/configs/. DIR defaults to
$OUT, else ./decode_out. Points left when the deadline passes keep their shipped entries.
`--device cpu` is a dry run of the whole script under TRITON_INTERPRET=1 on tiny fp32 shapes.
"""

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time

import torch

from moekit.benchmarks.floors import floor_seconds
from moekit.benchmarks.gpu import GPU_SHAPES, PERF_TABLE_CEILINGS, graph_time_us, precompile, routing_sets
from moekit.cli.tune import plan_shape, search_shape, write_configs
from moekit.experts.base import ExpertWeights
from moekit.experts.reference import reference_experts
from moekit.kernels import triton_moe as moe
from moekit.kernels.launch import fused_moe
from moekit.kernels.tuning import (
    SHIPPED_DIR, MoEConfig, config_file_name, default_config, late_variants, parse_configs, use_direct,
)

MS = (1, 16, 64, 256)
# Shapes with missed targets first, so a tight deadline cuts the one already at its floor.
ORDER = ("qwen3-30b-a3b", "olmoe-1b-7b", "mixtral-8x7b", "gpt-oss-20b", "deepseek-v3")
DEVICE_NAME = "NVIDIA_H200"
TOL = {torch.bfloat16: 1e-2, torch.float32: 1e-5}  # PERF.md
# Dry-run shapes for --device cpu (name, E, k, H, I).
TINY_SHAPES = (("tiny-a", 4, 2, 32, 16), ("tiny-b", 8, 2, 48, 32))


def label(cfg: MoEConfig) -> str:
    """A short name of a config: GEMM1 / GEMM2 kind, tiles, warps, stages and knobs."""
    if cfg.prefill is not None:
        return f"prefill{json.dumps(cfg.prefill.to_json(), sort_keys=True)}"

    def one(t):
        kind = "gemv" if t.GEMV else f"dot{t.BLOCK_SIZE_M}"
        knobs = (f" /{t.SPLIT_K}" if t.SPLIT_K > 1 else "") + (" pdl" if t.PDL else "")
        return f"{kind} {t.BLOCK_SIZE_N}x{t.BLOCK_SIZE_K} w{t.num_warps}s{t.num_stages}{knobs}"

    return f"{one(cfg.gemm1)} | {one(cfg.gemm2)}"


def family(cfg: MoEConfig) -> str:
    """The knobs a config uses: 'plain' (none), else e.g. 'gemv1+gemv2+split+pdl'."""
    if cfg.prefill is not None:
        return "prefill"
    parts = [p for p, on in (("gemv1", cfg.gemm1.GEMV), ("gemv2", cfg.gemm2.GEMV), ("split", cfg.gemm2.SPLIT_K > 1),
                              ("pdl", cfg.gemm2.PDL)) if on]
    return "+".join(parts) or "plain"


def shipped_table(E: int, I: int) -> dict:
    path = os.path.join(SHIPPED_DIR, config_file_name(E, I, DEVICE_NAME))
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as fh:
        return parse_configs(fh.read(), path)


def shipped_entry(table: dict, M: int, E: int, k: int, H: int, I: int, dtype) -> MoEConfig:
    if table:
        return table[min(table, key=lambda m: (abs(m - M), m))]
    return default_config(M, E, k, H, I, torch.finfo(dtype).bits // 8)


def time_us(fn, sets, replays: int) -> float:
    """graph_time_us on a GPU; a plain median of calls on the CPU (dry run only)."""
    if sets[0][0].is_cuda:
        return graph_time_us(fn, sets, replays)
    times = []
    for _ in range(replays):
        t0 = time.perf_counter()
        for args in sets:
            fn(*args)
        times.append((time.perf_counter() - t0) * 1e6 / len(sets))
    return statistics.median(times)


def verified(order, w13, w2, sets, dtype):
    """The first config of `order` whose output matches `reference` (and the errors seen)."""
    x, w, ids = sets[0]
    ref = reference_experts(x, ExpertWeights(w13, w2), w, ids).double()
    errors = {}
    for cfg in order:
        try:
            out = fused_moe(x, w13, w2, None, None, w, ids, None, "silu", config=cfg, out_dtype=x.dtype).double()
            err = float((out - ref).norm() / ref.norm()) if torch.isfinite(out).all() else float("inf")
        except Exception as exc:  # noqa: BLE001 - a config that fails is recorded and passed over
            err = f"{type(exc).__name__}: {str(exc)[:200]}"
        errors[label(cfg)] = err
        if isinstance(err, float) and err <= TOL[dtype]:
            return cfg, err, errors
    raise RuntimeError(f"no candidate matched reference: {errors}")


def sum_k_times(shapes, Ms, dtype, dev) -> list:
    """The sum over k alone: its tiling above SUM_K_ROW_MAX tokens ([4096 / BN, BN] tiles, slots
    one after another) against the one used up to it (one token row, 4 slot loads in flight)."""
    rows = []
    for name, E, k, H, I in shapes:
        for M in Ms:
            if M == 1:
                continue
            ys = [(torch.randn(M * k, H, device=dev, dtype=dtype), routing_sets(M, E, k, H, 1, dtype, dev)[0][2])
                  for _ in range(8 if dev.type == "cuda" else 1)]
            out = torch.empty(M, H, device=dev, dtype=dtype)
            bn = min(1024, triton_pow2(H))
            res = {"shape": name, "M": M}
            for tag, bt, stages in (("old", max(1, 4096 // bn), None), ("new", 1, 4)):
                def run(y, ids, bt=bt, stages=stages):
                    moe.sum_k_kernel[((M + bt - 1) // bt, (H + bn - 1) // bn)](
                        y, out, ids, ids, M, H, k, y.stride(0), out.stride(0), BT=bt, BN=bn, HAS_MAP=False,
                        STAGES=stages, num_warps=4)
                res[f"{tag}_us"] = time_us(run, ys, 5)
            rows.append(res)
            print(f"sum_k {name:14s} M={M:4d}: {res['old_us']:6.1f} us -> {res['new_us']:6.1f} us", flush=True)
    return rows


def triton_pow2(n: int) -> int:
    return 1 << max(4, (n - 1).bit_length())


def thin(plans: dict, n: int) -> dict:
    """At most n evenly spread candidates per list (the dry run's interpreter is slow)."""
    def pick(xs):
        return xs if len(xs) <= n else [xs[i * len(xs) // n] for i in range(n)]
    return {M: (d, pick(s1), {bm: pick(c) for bm, c in g2.items()}) for M, (d, s1, g2) in plans.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.environ.get("OUT") or "decode_out")
    p.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 4))
    p.add_argument("--budget", type=float, default=12.0, help="seconds of search timing per shape and M")
    p.add_argument("--deadline", type=float, default=300.0, help="seconds for the whole run")
    p.add_argument("--shapes", default="")
    p.add_argument("--ms", default=",".join(map(str, MS)))
    p.add_argument("--no-tests", action="store_true")
    p.add_argument("--pytest", default="-m gpu tests/kernels -q", help="arguments of the GPU test run")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    args = p.parse_args()
    t_start = time.monotonic()
    dry = args.device == "cpu"
    if dry and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("--device cpu needs TRITON_INTERPRET=1")
    dtype = torch.float32 if dry else torch.bfloat16
    dev = torch.device(args.device)
    shapes = TINY_SHAPES if dry else sorted(GPU_SHAPES, key=lambda s: ORDER.index(s[0]))
    if args.shapes:
        shapes = [s for s in shapes if s[0] in args.shapes.split(",")]
    Ms = [int(m) for m in args.ms.split(",")]
    os.makedirs(os.path.join(args.out, "configs"), exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    result = {"benchmark": "experts-gpu-decode", "date": now,
              "device": torch.cuda.get_device_name() if not dry else "cpu (interpreter dry run)",
              "torch": torch.__version__, "command": " ".join(sys.argv),
              "timing": "CUDA graph of 8 calls with distinct softmax top-k routing, replayed 5x; median us per call; "
                        "search timings: 4 calls, 3 replays",
              "floors": "PERF.md table: max(FLOPs / 790e12, weight bytes / 4.3e12)", "points": [], "sum_k": []}

    # 1. GPU tests in a child process, while the candidates compile.
    tests = None
    if not args.no_tests and not dry:
        log = open(os.path.join(args.out, "pytest_gpu.log"), "w", encoding="utf-8")  # noqa: SIM115
        tests = subprocess.Popen([sys.executable, "-m", "pytest", *args.pytest.split(), "-p", "no:cacheprovider"],
                                 stdout=log, stderr=subprocess.STDOUT)
    plans, jobs, tables = {}, [], {}
    for name, E, k, H, I in shapes:
        plans[name], shape_jobs = plan_shape(E, k, H, I, dtype, Ms)
        tables[name] = shipped_table(E, I)
        for M, (default, stage1, g2s) in plans[name].items():
            stage1.insert(0, shipped_entry(tables[name], M, E, k, H, I, dtype))  # the shipped entry competes too
        if dry:
            plans[name] = thin(plans[name], 3)
            shape_jobs = []
        jobs += shape_jobs
        for M, (_, stage1, _) in plans[name].items():
            if not dry:
                jobs += [(H, I, "bfloat16", "silu", use_direct(M, k, E), c.to_json())
                         for c in [stage1[0]] + late_variants(stage1[0], M, E, k)]
    t0 = time.monotonic()
    failures = precompile(jobs, args.workers) if jobs else []
    print(f"compiled {len(jobs)} jobs in {time.monotonic() - t0:.0f} s, {len(failures)} failed", flush=True)
    for f in failures[:5]:
        print("  failed:", f[:300], flush=True)
    result["compile"] = {"jobs": len(jobs), "seconds": time.monotonic() - t0, "failures": failures[:50]}
    if tests is not None:
        try:
            tests.wait(timeout=max(30.0, args.deadline / 2 - (time.monotonic() - t_start)))
        except subprocess.TimeoutExpired:
            tests.kill()
            tests.wait()
            print(f"pytest {args.pytest}: killed at half the deadline (see pytest_gpu.log)", flush=True)
        log.close()
        with open(log.name, encoding="utf-8") as fh:
            lines = fh.read().splitlines()
        summary = [ln for ln in lines if ln.startswith("FAILED") or ln.startswith("ERROR")] + lines[-1:]
        print(f"pytest {args.pytest}:", *summary, sep="\n  ", flush=True)
        result["gpu_tests"] = {"returncode": tests.returncode, "summary": summary}

    # 2. Search, verify, time side by side, per shape and M.
    for i, (name, E, k, H, I) in enumerate(shapes):
        left = args.deadline - (time.monotonic() - t_start)
        if left < 20:
            result["points"] += [{"shape": name, "M": M, "skipped": "out of time"} for M in Ms]
            print(f"{name}: skipped (out of time)", flush=True)
            continue
        # Search timing gets at most half of what is left per shape and M (the rest: verify, re-time).
        budget = min(args.budget, left / (2 * (len(shapes) - i) * len(Ms)))
        _, info = search_shape(E, k, H, I, dtype, plans[name], budget_s=budget, device=args.device)
        w13 = torch.randn(E, 2 * I, H, device=dev, dtype=dtype) * H ** -0.5
        w2 = torch.randn(E, H, I, device=dev, dtype=dtype) * I ** -0.5
        for M in Ms:
            try:
                row = measure(name, E, k, H, I, M, plans[name][M][1][0], info[M], w13, w2, dtype, dev, dry)
            except Exception as exc:  # noqa: BLE001 - one point that fails is recorded, not fatal
                row = {"shape": name, "M": M, "error": f"{type(exc).__name__}: {str(exc)[:500]}"}
                print(f"{name:14s} M={M:4d} failed: {row['error']}", flush=True)
            result["points"].append(row)
            if "error" not in row and row["winner_us"] < 0.99 * row["shipped_us"]:  # 1%: beyond the noise
                tables[name][M] = MoEConfig.from_json(row["winner"])
        path = write_configs(tables[name], E, I, DEVICE_NAME, dtype, os.path.join(args.out, "configs")) \
            if tables[name] else None
        result.setdefault("configs", []).append(path)
        del w13, w2
        if not dry:
            torch.cuda.empty_cache()
        with open(os.path.join(args.out, "decode_results.json"), "w", encoding="utf-8") as fh:
            json.dump(result, fh, indent=1, default=str)

    # 3. The sum over k alone, old and new tiling.
    if args.deadline - (time.monotonic() - t_start) > 10:
        result["sum_k"] = sum_k_times(shapes, [m for m in Ms if m > 1], dtype, dev)
    with open(os.path.join(args.out, "decode_results.json"), "w", encoding="utf-8") as fh:
        json.dump(result, fh, indent=1, default=str)

    print("\nshape           M   floor_us  shipped_us %fl  new_us %fl   x     best plain-knob us  winner")
    for r in result["points"]:
        if "skipped" in r or "error" in r:
            print(f"{r['shape']:14s} {r['M']:4d}  {r.get('skipped') or r['error'][:80]}")
            continue
        plain = r["best_by_family"].get("plain", {}).get("us", float("nan"))
        print(f"{r['shape']:14s} {r['M']:4d} {r['floor_us']:9.1f} {r['shipped_us']:9.1f} {r['shipped_pct_floor']:5.1f}"
              f" {r['winner_us']:8.1f} {r['winner_pct_floor']:5.1f} {r['shipped_us'] / r['winner_us']:5.2f}"
              f" {plain:11.1f}"
              f"  {r['winner_label']}")
    print(f"\nwrote {args.out}/decode_results.json and {len(result.get('configs', []))} files in {args.out}/configs "
          f"({time.monotonic() - t_start:.0f} s)")


def measure(name, E, k, H, I, M, shipped, info, w13, w2, dtype, dev, dry) -> dict:
    """One point: the search's fastest config that matches `reference`, then it and the shipped
    entry timed side by side (the dry run verifies the candidates in reverse, knob variants first)."""
    by_us = sorted(((us, MoEConfig.from_json(json.loads(key))) for key, us in info["timings"].items()),
                   key=lambda t: t[0])
    order = [c for _, c in by_us]
    sets = routing_sets(M, E, k, H, 1 if dry else 8, dtype, dev)
    winner, err, errors = verified(order[::-1] if dry else order, w13, w2, sets, dtype)
    call = lambda cfg: (lambda x, w, i: fused_moe(x, w13, w2, None, None, w, i, None, "silu",  # noqa: E731
                                                     config=cfg, out_dtype=x.dtype))
    replays = 1 if dry else 5
    old_us = min(time_us(call(shipped), sets, replays) for _ in range(2))
    new_us = min(time_us(call(winner), sets, replays) for _ in range(2))
    floor_us = floor_seconds(M, E, k, H, I, 2, PERF_TABLE_CEILINGS) * 1e6
    fams = {}
    for us, cfg in by_us:
        fams.setdefault(family(cfg), (us, label(cfg)))
    row = {"shape": name, "E": E, "k": k, "H": H, "I": I, "M": M, "floor_us": floor_us,
           "shipped": shipped.to_json(), "shipped_us": old_us, "shipped_pct_floor": 100 * floor_us / old_us,
           "winner": winner.to_json(), "winner_label": label(winner), "winner_us": new_us,
           "winner_pct_floor": 100 * floor_us / new_us, "rel_err_vs_reference": err,
           "search_us": info["us"], "tried": info["tried"],
           "best_by_family": {f: {"us": us, "config": lab} for f, (us, lab) in fams.items()},
           "rejected": {lab: e for lab, e in errors.items() if lab != label(winner)},
           "timings": {label(c): us for us, c in by_us}}
    print(f"{name:14s} M={M:4d} floor {floor_us:8.1f} us  shipped {old_us:8.1f} ({row['shipped_pct_floor']:5.1f}%)"
          f"  new {new_us:8.1f} ({row['winner_pct_floor']:5.1f}%)  [{family(winner)}] {label(winner)}", flush=True)
    return row


if __name__ == "__main__":
    with torch.inference_mode():
        main()

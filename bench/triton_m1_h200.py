"""Direct-path (M = 1) variants of the Triton experts, timed one by one with errors shown.

    PYTHONPATH=src python bench/triton_m1_h200.py [--shapes qwen3-30b-a3b,olmoe-1b-7b] [--out FILE]
    PYTHONPATH=src python bench/triton_m1_h200.py --fused [--shapes ...]   (gemm1.FUSED, against the shipped entry)
    PYTHONPATH=src python bench/triton_m1_h200.py --pre [--shapes ...]     (gemm2.PRE over CUDA-core GEMM2 tiles)

For each shape: GEMM1 on tensor cores or CUDA cores (GEMV) over a few tiles, GEMM2 split over
{1, 2, 4, 8, 16} programs per output tile, with and without PDL; every candidate is checked
against `reference` once and timed in a CUDA graph (fresh routing per call). Prints the best
ten and every failure with its message; writes all timings as JSON.
"""

import argparse
import itertools
import json
import os
import sys

import torch
from dataclasses import replace

from moekit.benchmarks.gpu import graph_time_us, precompile, routing_sets, shape_by_name
from moekit.experts.base import ExpertWeights
from moekit.experts.reference import reference_experts
from moekit.kernels.launch import fused_moe
from moekit.kernels.tuning import SHIPPED_DIR, MoEConfig, TileConfig, config_file_name, device_name, get_config


def fused_candidates():
    """(GEMM1 tiles of the fused kernel, GEMM2 knobs: w2 row block, its stages, PDL)."""
    # Column blocks up to 256 (one program per SM or fewer for the widest experts), up to 16 warps
    # (more loads in flight per SM: the CUDA-core loops stage nothing in shared memory); at most
    # 64 weights of a gate (and an up) tile per thread.
    g1s = [TileConfig(16, bc, bk, 1, w, s, GEMV=1, FUSED=1) for bc, bk, w, s in itertools.product(
        (32, 64, 128, 256), (32, 64, 128, 256), (4, 8, 16), (2, 3, 4))
        if bc * bk <= 64 * 32 * w and (bk >= 64 or bc == 256)]
    g2s = [TileConfig(16, bh, 128, 1, 4, s, PDL=pdl) for bh, s, pdl in itertools.product((16, 32, 64, 128), (2, 3, 4), (0, 1))]
    return g1s, g2s


FUSED_BASE_G2 = TileConfig(16, 64, 128, 1, 4, 3, PDL=1)


def pre_candidates():
    """CUDA-core GEMM2 tiles under PDL with 0, 1 or 2 weight tiles loaded before the wait."""
    return [TileConfig(16, bn, bk, 1, w, 4, SPLIT_K=sp, GEMV=1, PDL=1, PRE=pre) for bn, bk, w, sp, pre in
            itertools.product((16, 32, 64), (128, 256), (4, 8), (2, 4, 8), (0, 2)) if bn * bk <= 64 * 32 * w]


def candidates(wide: bool = False):
    if wide:  # GEMM1 on CUDA cores over warps and pipeline depths too
        g1s = [TileConfig(16, bn, bk, 1, w, s, GEMV=1) for bn, bk, w, s in itertools.product(
            (16, 32, 64), (64, 128, 256, 512), (4, 8, 16), (3, 4, 5, 6)) if bn * bk <= 64 * 32 * w]
        g1s += [TileConfig(16, bn, bk, 1, 4, s) for bn, bk, s in itertools.product((16, 32, 64), (64, 128, 256), (3, 4, 5))]
        return g1s, []
    g1s = [TileConfig(16, bn, bk, 1, w, 4, GEMV=gv) for gv, bn, bk, w in itertools.product(
        (0, 1), (16, 32, 64), (128, 256), (4, 8)) if not (gv == 0 and w == 8)]
    g2s = [TileConfig(16, bn, bk, 1, 4, 4, SPLIT_K=sp, GEMV=gv, PDL=pdl) for gv, bn, bk, sp, pdl in
           itertools.product((0, 1), (16, 32, 64), (128, 256), (1, 2, 4, 8, 16), (0, 1))]
    return g1s, g2s


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="qwen3-30b-a3b,olmoe-1b-7b")
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "m1_results.json"))
    p.add_argument("--g1-keep", type=int, default=3, help="GEMM1 tiles kept for the GEMM2 sweep")
    p.add_argument("--wide-g1", action="store_true",
                   help="sweep GEMM1 widely against the three best GEMM2 tiles of the shipped table's M=1 entry "
                        "and of --g2-from (a results JSON of an earlier run)")
    p.add_argument("--g2-from", default="")
    p.add_argument("--fused", action="store_true",
                   help="sweep the fused direct kernel (GEMM1 tiles against a base w2 loop, then the w2 loop "
                        "and PDL for the --g1-keep best); the shipped M=1 entry is timed alongside")
    p.add_argument("--pre", action="store_true",
                   help="time CUDA-core GEMM2 tiles with PRE 0/1/2 after the shipped M=1 GEMM1 (three rounds, "
                        "the shipped entry in each)")
    p.add_argument("--write-configs", default="", help="folder: the shipped tables with each shape's M=1 winner")
    args = p.parse_args()
    result = {}
    g1s, g2s = fused_candidates() if args.fused else candidates(args.wide_g1)
    if args.pre:
        g1s, g2s = [], pre_candidates()
    if args.wide_g1:
        earlier = json.load(open(args.g2_from)) if args.g2_from else {}
    if args.pre:
        jobs = []
        for name in args.shapes.split(","):
            _, E, k, H, I = shape_by_name(name)
            g1 = get_config(1, E, k, H, I, torch.bfloat16, device_name()).gemm1
            jobs += [(64, 64, "bfloat16", "silu", True, MoEConfig(g1, replace(g2, SPLIT_K=2)).to_json()) for g2 in g2s]
    elif args.fused:
        jobs = [(64, 64, "bfloat16", "silu", True, MoEConfig(g1, FUSED_BASE_G2).to_json()) for g1 in g1s]
        jobs += [(64, 64, "bfloat16", "silu", True, MoEConfig(g1s[0], g2).to_json()) for g2 in g2s]
    else:
        jobs = [(64, 64, "bfloat16", "silu", True, MoEConfig(g1, g2s[0] if g2s else TileConfig(16, 16, 256, 1, 4, 4)).to_json())
            for g1 in g1s] + [(64, 64, "bfloat16", "silu", True, MoEConfig(g1s[0], g2).to_json())
                              for g2 in g2s if g2.SPLIT_K <= 2]
    failures = precompile(jobs, max(1, (os.cpu_count() or 2) - 2))
    print(f"compiled {len(jobs)} jobs, {len(failures)} failed", *failures[:5], sep="\n", flush=True)
    for name in args.shapes.split(","):
        _, E, k, H, I = shape_by_name(name)
        w13 = torch.randn(E, 2 * I, H, device="cuda", dtype=torch.bfloat16) * H ** -0.5
        w2 = torch.randn(E, H, I, device="cuda", dtype=torch.bfloat16) * I ** -0.5
        sets = routing_sets(1, E, k, H, 8, torch.bfloat16, "cuda")
        x, w, ids = sets[0]
        ref = reference_experts(x.float(), ExpertWeights(w13.float(), w2.float()), w, ids)
        times, errors = {}, {}

        def run(cfg):
            key = json.dumps(cfg.to_json(), sort_keys=True)
            try:
                out = fused_moe(x, w13, w2, None, None, w, ids, None, "silu", config=cfg, direct=True).float()
                err = float((out - ref).norm() / ref.norm())
                if not err < 2e-2:
                    raise AssertionError(f"rel err {err:.2e}")
                times[key] = graph_time_us(lambda a, b, c: fused_moe(a, w13, w2, None, None, b, c, None, "silu",
                                                                    config=cfg, direct=True), sets, replays=5)
            except Exception as e:  # noqa: BLE001 - reported
                times[key] = float("inf")
                errors[key] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            return times[key]

        shipped = get_config(1, E, k, H, I, torch.bfloat16, device_name())
        shipped_us = run(shipped)
        if args.pre:  # three rounds: each time is the best of its rounds, the shipped entry's too
            rounds = {}
            for _ in range(3):
                for cfg in [shipped] + [MoEConfig(shipped.gemm1, g2) for g2 in g2s]:
                    key = json.dumps(cfg.to_json(), sort_keys=True)
                    rounds[key] = min(rounds.get(key, float("inf")), run(cfg))
            times.update(rounds)
            shipped_us = times[json.dumps(shipped.to_json(), sort_keys=True)]
        elif args.fused:
            g1_rank = sorted(g1s, key=lambda g1: run(MoEConfig(g1, FUSED_BASE_G2)))[:args.g1_keep]
            more = [(64, 64, "bfloat16", "silu", True, MoEConfig(g1, g2).to_json()) for g1 in g1_rank for g2 in g2s]
            precompile(more, max(1, (os.cpu_count() or 2) - 2))  # the w2 loop's knobs are constexprs too
            for g1 in g1_rank:
                for g2 in g2s:
                    run(MoEConfig(g1, g2))
        elif args.wide_g1:
            tops = [MoEConfig.from_json(json.loads(key)) for key, _ in earlier.get(name, {}).get("best", [])[:3]]
            tops.append(get_config(1, E, k, H, I, torch.bfloat16, device_name()))
            for g2 in dict.fromkeys(c.gemm2 for c in tops):
                for g1 in g1s:
                    run(MoEConfig(g1, g2))
        else:
            base_g2 = TileConfig(16, 16, 256, 1, 4, 4)
            g1_rank = sorted(g1s, key=lambda g1: run(MoEConfig(g1, base_g2)))[:args.g1_keep]
            for g1 in g1_rank:
                for g2 in g2s:
                    run(MoEConfig(g1, g2))
        best = sorted(times.items(), key=lambda kv: kv[1])
        print(f"== {name} M=1: {len(times)} tried, {len(errors)} failed; shipped entry {shipped_us:.1f} us; best:")
        for key, us in best[:10]:
            print(f"   {us:7.1f} us  {key}")
        seen_err = set()
        for key, msg in errors.items():
            if msg not in seen_err:
                seen_err.add(msg)
                print(f"   FAIL {msg} <- {key}")
        sys.stdout.flush()
        result[name] = {"best": best[:20], "errors": errors, "shipped": [json.dumps(shipped.to_json(), sort_keys=True),
                                                                          shipped_us]}
        if args.write_configs:
            os.makedirs(args.write_configs, exist_ok=True)
            fname = config_file_name(E, I, device_name())
            with open(os.path.join(SHIPPED_DIR, fname)) as fh:
                table = json.load(fh)
            table["1"] = json.loads(best[0][0])
            with open(os.path.join(args.write_configs, fname), "w") as fh:
                json.dump(table, fh, indent=1)
        del w13, w2
        torch.cuda.empty_cache()
    with open(args.out, "w") as fh:
        json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()

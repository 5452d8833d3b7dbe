"""Tile variants around shipped prefill entries, each timed against the entry in one process, on one H200.

For each point (shape:M): the shipped entry (A) and variants of its GEMM1 tiles with its GEMM2,
then variants of GEMM2's tiles with the best GEMM1; the prefill knobs stay. Every config is
compiled first in parallel processes, then checked against `reference` (bf16 bound) on the
point's own routing, then timed against A in CUDA graphs, interleaved, fresh routing per call.
Variants Triton or the launcher refuse are recorded and skipped. With --write-tables, a winner
at least --min-gain faster than A replaces the M entry of the shipped table in this tree
(src/moekit/kernels/configs/), so a bench that follows in the same command runs it.

    PYTHONPATH=src python bench/tile_ab_h200.py --points olmoe-1b-7b:256 [--out FILE] [--write-tables]

`--device cpu` is a dry run under TRITON_INTERPRET=1 on a tiny shape (wall-clock times).
"""

import argparse
import dataclasses
import json
import os
import statistics
import sys

import torch

from moekit.benchmarks.gpu import GPU_SHAPES, ab_time_us, precompile, routing_sets
from moekit.experts.base import ExpertWeights
from moekit.experts.reference import reference_experts
from moekit.kernels.launch import fused_moe
from moekit.kernels.tuning import (SHIPPED_DIR, MoEConfig, PrefillConfig, TileConfig, _fits, config_file_name,
                                   get_config)

# (BLOCK_SIZE_N, BLOCK_SIZE_K, num_warps, num_stages) around the shipped tiles
GEMM1_VARIANTS = ((128, 64, 4, 3), (128, 64, 4, 4), (128, 64, 4, 5), (64, 64, 4, 4), (64, 64, 4, 6),
                  (64, 128, 4, 4), (128, 128, 4, 3), (256, 64, 8, 3), (128, 64, 8, 4))
GEMM2_VARIANTS = ((256, 64, 4, 4), (256, 64, 4, 3), (128, 64, 4, 4), (128, 64, 4, 6), (128, 128, 4, 3),
                  (256, 128, 8, 3), (256, 64, 8, 4), (64, 128, 4, 4))


def _variants(t: TileConfig, table, b_tiles):
    out = []
    for bn, bk, warps, stages in table:
        v = TileConfig(t.BLOCK_SIZE_M, bn, bk, t.GROUP_SIZE_M, warps, stages)
        if v != t and _fits(v, 2, b_tiles):
            out.append(v)
    return out




def _ab(run, a, b, sets, rounds, cuda):
    ta, tb = [], []
    for _ in range(rounds):
        ta.append(ab_time_us(lambda *s: run(a, *s), sets, cuda))
        tb.append(ab_time_us(lambda *s: run(b, *s), sets, cuda))
    return statistics.median(ta), statistics.median(tb), ta, tb


def point(shape, M, cuda, dev, rounds, workers):
    name, E, k, H, I = shape
    dtype = torch.bfloat16 if cuda else torch.float32
    base = get_config(M, E, k, H, I, dtype, "NVIDIA_H200" if cuda else None)
    if not cuda:  # the dry run's tiny prefill entry
        base = MoEConfig(TileConfig(64, 32, 32, 8, 4, 2), TileConfig(64, 32, 32, 8, 4, 2),
                         PrefillConfig(2, 1, 1, flatten=1, act_tma=1, gu1=1))
    if base.prefill is None:
        return {"point": f"{name} M={M}", "skipped": "the shipped entry is not a prefill one"}
    g1s = _variants(base.gemm1, GEMM1_VARIANTS, 2)  # gate and up: two accumulators
    g2s = _variants(base.gemm2, GEMM2_VARIANTS, 1)
    if cuda:
        jobs = [(H, I, "bfloat16", "silu", False, c.to_json()) for c in
                [base] + [dataclasses.replace(base, gemm1=g) for g in g1s] +
                [dataclasses.replace(base, gemm1=g1, gemm2=g) for g1 in [base.gemm1] + g1s for g in g2s]]
        fails = precompile(jobs, workers)
        print(f"{name} M={M}: compiled {len(jobs)} configs, {len(fails)} failed", flush=True)
    gen = torch.Generator(device=dev).manual_seed(0)
    w13 = (torch.randn(E, 2 * I, H, device=dev, generator=gen) * H ** -0.5).to(dtype)
    w2 = (torch.randn(E, H, I, device=dev, generator=gen) * I ** -0.5).to(dtype)
    wts = ExpertWeights(w13, w2)
    sets = routing_sets(M, E, k, H, 4, dtype, dev)
    refs = [reference_experts(x, wts, w, ids) for x, w, ids in sets[:2]]

    def run(c, x, w, ids):
        return fused_moe(x, w13, w2, None, None, w, ids, None, "silu", config=c, direct=False, out_dtype=x.dtype)

    def check(c):
        errs = [float((run(c, *s).float() - r).norm() / r.norm()) for s, r in zip(sets, refs)]
        return max(errs)

    rows = []

    def try_config(c, label):
        try:
            err = check(c)
        except Exception as e:  # noqa: BLE001 - the launcher's refusals, Triton's compile and resource errors
            rows.append({"variant": label, "config": c.to_json(), "refused": str(e)[:200]})
            print(f"  {label:40s} refused: {str(e)[:80]}", flush=True)
            return None
        if not err <= 1e-2:
            rows.append({"variant": label, "config": c.to_json(), "rel_err": err, "failed": True})
            print(f"  {label:40s} FAILED rel err {err:.2e}", flush=True)
            return None
        ta, tb, ra, rb = _ab(run, base, c, sets, rounds, cuda)
        rows.append({"variant": label, "config": c.to_json(), "rel_err": err, "A_us": ta, "B_us": tb,
                     "rounds_A": ra, "rounds_B": rb, "speedup": ta / tb})
        print(f"  {label:40s} err {err:.1e} A {ta:8.1f} B {tb:8.1f} x{ta / tb:.3f}", flush=True)
        return ta / tb

    def tiles(t):
        return f"{t.BLOCK_SIZE_M}x{t.BLOCK_SIZE_N}x{t.BLOCK_SIZE_K}w{t.num_warps}s{t.num_stages}"

    best, best_gain = base, 1.0
    for g in g1s:
        c = dataclasses.replace(base, gemm1=g)
        gain = try_config(c, "gemm1 " + tiles(g))
        if gain and gain > best_gain:
            best, best_gain = c, gain
    for g in g2s:
        c = dataclasses.replace(best, gemm2=g)
        gain = try_config(c, f"gemm1 {tiles(best.gemm1)} gemm2 {tiles(g)}")
        if gain and gain > best_gain:
            best, best_gain = c, gain
    del w13, w2, wts
    return {"point": f"{name} M={M}", "shipped": base.to_json(), "best": best.to_json(), "best_speedup": best_gain,
            "variants": rows}


def write_table(shape, M, cfg):
    name, E, k, H, I = shape
    path = os.path.join(SHIPPED_DIR, config_file_name(E, I, "NVIDIA_H200"))
    with open(path) as f:
        table = json.load(f)
    table[str(M)] = cfg
    with open(path, "w") as f:
        json.dump(table, f, indent=1)
        f.write("\n")
    print(f"wrote M={M} of {path}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--points", default="olmoe-1b-7b:256")
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "tile_ab.json"))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--workers", type=int, default=max(1, min(14, (os.cpu_count() or 2) - 2)))
    p.add_argument("--write-tables", action="store_true")
    p.add_argument("--min-gain", type=float, default=1.01)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    args = p.parse_args()
    cuda = args.device == "cuda"
    dev = torch.device(args.device)
    shapes = {s[0]: s for s in GPU_SHAPES}
    results = []
    for item in args.points.split(","):
        sname, m = item.split(":")
        shape = shapes[sname] if cuda else ("tiny", 8, 2, 64, 32)
        r = point(shape, int(m), cuda, dev, args.rounds, args.workers)
        results.append(r)
        if args.write_tables and cuda and r.get("best_speedup", 1.0) >= args.min_gain:
            write_table(shape, int(m), r["best"])
    import triton  # noqa: PLC0415

    with open(args.out, "w") as f:
        json.dump({"benchmark": "prefill-tile-ab", "device": torch.cuda.get_device_name() if cuda else "cpu",
                   "torch": torch.__version__, "triton": triton.__version__, "command": " ".join(sys.argv),
                   "timing": "CUDA graph of 4 calls with fresh softmax top-k routing, 5 replays, median us per call; "
                             "A (shipped) and B interleaved, median of the rounds", "points": results}, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

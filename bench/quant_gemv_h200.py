"""One token on quantized weights: the sorted kernels (the shipped M = 1 entries) against the
one-token GEMVs (kernels/triton_decode_quant.py) with a search over their tiles, on one H200.

For every M = 1 point of moekit.benchmarks.gpu.QUANT_CASES: the shipped sorted entry (A), the
GEMVs with launch_quant.gemv_config's heuristic tiles (B), then GEMM1 candidates with B's GEMM2
and GEMM2 candidates with the best GEMM1, all timed in CUDA graphs of 8 calls with distinct
routing, each checked against the sorted path's output (relative error, recorded). `--apply
FILE` writes each point's best GEMV tiles into the shipped table's M = 1 entry (knobs.gemv)
where they beat the heuristic tiles by --min-gain.

    PYTHONPATH=src python bench/quant_gemv_h200.py [--out FILE] [--cases qwen3-30b-a3b:fp8_w8a8,...]
    python bench/quant_gemv_h200.py --apply FILE [--min-gain 1.02]

`--device cpu` is a dry run under TRITON_INTERPRET=1 on a tiny shape (wall-clock times).
"""

import dataclasses
import json
import os
import sys

import torch

from moekit.benchmarks.gpu import (GPU_SHAPES, QUANT_CASES, _quant_call, ab_arg_parser, ab_device, ab_time_us,
                                  quantized_weights, routing_sets, write_ab_result)
from moekit.kernels.launch_quant import gemv_config, gemv_refusal, quant_tiles
from moekit.kernels.quant_rows import modes_of
from moekit.kernels.quant_tuning import QuantKnobs, quant_file_name
from moekit.kernels.tuning import SHIPPED_DIR, MoEConfig, TileConfig
from moekit.quant import get_scheme


def _candidates(base: MoEConfig, cuda: bool):
    """(GEMM1 tiles, GEMM2 tiles) to try: the K tile a scheme allows is checked by gemv_refusal."""
    t1, t2 = base.gemm1, base.gemm2
    if not cuda:
        return [TileConfig(16, 32, t1.BLOCK_SIZE_K, 1, 4, 2)], [dataclasses.replace(t2, SPLIT_K=s) for s in (1, 3)]
    g1 = [TileConfig(16, bn, bk, 1, w, st) for bn, bk, w, st in
          ((16, 128, 4, 3), (16, 512, 4, 3), (32, 256, 4, 3), (32, 128, 4, 4), (16, 256, 4, 4), (16, 256, 2, 3),
           (16, 256, 8, 3), (64, 128, 4, 3))]
    g2 = [TileConfig(16, bn, bk, 1, w, st, SPLIT_K=s) for bn, bk, w, st, s in
          ((16, 256, 4, 3, 1), (16, 256, 4, 3, 2), (16, 256, 4, 3, 4), (16, 256, 4, 3, 8), (16, 128, 4, 3, 4),
           (16, 128, 4, 3, 8), (16, 512, 4, 3, 4), (32, 256, 4, 3, 4), (32, 128, 4, 3, 8), (16, 256, 4, 4, 4))]
    return g1, g2


def run(args):
    cuda, dev = ab_device(args)
    dtype = torch.bfloat16 if cuda else torch.float16
    shapes = {s[0]: s for s in GPU_SHAPES}
    cases = QUANT_CASES if cuda else (("tiny", "fp8_w8a8", True, (1,)), ("tiny", "int4_w4a16", False, (1,)))
    rows = []
    for shape, scheme_name, static, ms in cases:
        if 1 not in ms or (cuda and args.cases and f"{shape}:{scheme_name}" not in args.cases.split(",")):
            continue
        _, E, k, H, I = shapes[shape] if cuda else ("tiny", 8, 2, 256, 128)
        scheme = get_scheme(scheme_name)
        modes = modes_of(scheme)
        wts = quantized_weights(scheme_name, E, H, I, static, dev)
        label = f"{shape} {scheme_name}{' static' if static else ''} M=1"
        cfg, knobs = quant_tiles(1, E, k, H, I, dtype, "NVIDIA_H200" if cuda else None, scheme, modes)
        sets = routing_sets(1, E, k, H, 8 if cuda else 2, dtype, dev)
        sorted_out = [_quant_call(wts, *s, config=cfg, knobs=dataclasses.replace(knobs, gemv=None)) for s in sets]

        def timed(name, config=None, knobs_=None):
            call = lambda *s: _quant_call(wts, *s, config=config, knobs=knobs_)  # noqa: E731
            try:
                err = max(((call(*s).float() - ref.float()).norm() / ref.float().norm()).item()
                          for s, ref in zip(sets, sorted_out))
                us = min(ab_time_us(call, sets, cuda, replays=10) for _ in range(args.rounds))
            except Exception as exc:  # noqa: BLE001 (a variant Triton cannot build: recorded)
                print(f"{label} {name}: failed: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                return {"variant": name, "failed": f"{type(exc).__name__}: {exc}"[:2000]}
            print(f"{label:40s} {name:60s} {us:8.1f} us  rel err vs sorted {err:.1e}", flush=True)
            return {"variant": name, "us": us, "rel_err_vs_sorted": err}

        res = {"point": label, "table": quant_file_name(E, I, "NVIDIA_H200", scheme), "E": E, "k": k, "H": H, "I": I}
        res["sorted"] = timed("sorted (shipped entry)", cfg, dataclasses.replace(knobs, gemv=None))
        base = gemv_config(H, I, k, scheme, modes)
        res["heuristic"] = timed(f"gemv heuristic {json.dumps(base.to_json())}", None, QuantKnobs(gemv=base))
        res["heuristic"]["gemv"] = base.to_json()
        best, best_us = base, res["heuristic"].get("us", float("inf"))
        g1s, g2s = _candidates(base, cuda)
        tried = []
        for stage, cands in (("gemm1", g1s), ("gemm2", g2s)):
            for t in cands:
                cand = MoEConfig(t, best.gemm2) if stage == "gemm1" else MoEConfig(best.gemm1, t)
                if cand == best or gemv_refusal(cand, scheme, modes):
                    continue
                r = timed(f"gemv {json.dumps(cand.to_json())}", None, QuantKnobs(gemv=cand))
                r["gemv"] = cand.to_json()
                tried.append(r)
                if r.get("us", float("inf")) < best_us:
                    best, best_us = cand, r["us"]
        res["candidates"] = tried
        res["best"] = {"gemv": best.to_json(), "us": best_us}
        res["speedup_best_vs_sorted"] = res["sorted"].get("us", float("nan")) / best_us
        print(f"{label}: sorted {res['sorted'].get('us')} us, best gemv {best_us:.1f} us "
              f"(x{res['speedup_best_vs_sorted']:.2f})", flush=True)
        rows.append(res)
        del wts
    return rows


def apply(path, min_gain):
    with open(path) as f:
        rows = json.load(f)["rows"]
    for r in rows:
        best = r["best"]
        if best["us"] * min_gain > r["heuristic"].get("us", float("inf")) and best["gemv"] != r["heuristic"]["gemv"]:
            continue
        table_path = os.path.join(SHIPPED_DIR, r["table"])
        with open(table_path) as f:
            table = json.load(f)
        table["1"].setdefault("quant", {})["gemv"] = best["gemv"]
        with open(table_path, "w") as f:
            json.dump(table, f, indent=1)
            f.write("\n")
        print(f"{r['point']}: {best['us']:.1f} us, written to {r['table']}")


def main() -> None:
    p = ab_arg_parser(__doc__, "quant_gemv.json")
    p.add_argument("--cases", help="only these SHAPE:SCHEME of QUANT_CASES, comma-separated")
    p.add_argument("--apply", metavar="RESULTS_JSON")
    p.add_argument("--min-gain", type=float, default=1.02)
    args = p.parse_args()
    if args.apply:
        apply(args.apply, args.min_gain)
        return
    rows = run(args)
    write_ab_result(args.out, "quant-gemv", args.device == "cuda",
                    "CUDA graph of 8 calls with distinct softmax top-k routing, 10 replays, median us per call; "
                    "best of --rounds", rows=rows)


if __name__ == "__main__":
    main()

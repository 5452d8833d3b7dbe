"""Whole bf16 calls through the shipped entry (A) and through given table entries (B, C, ...), in
one process on one H200: each entry checked against `reference` (bf16 bound) and its output
compared with A's, then CUDA-graph times interleaved over --rounds. The quantized twin is
quant_entry_ab_h200.py.

    PYTHONPATH=src python bench/entry_ab_h200.py --point mixtral-8x7b:256 \\
        --entry '{"BLOCK_SIZE_M": 64, ..., "gemm2": {...}}' [--entry ...] [--out FILE]

`--default` adds the heuristic tiles of a shape without a tuned table (tuning.default_config) as
a variant. `--device cpu` is a dry run under TRITON_INTERPRET=1 on a tiny shape.
"""

import json
import statistics

import torch

from moekit.benchmarks.gpu import AB_TIMING, ab_time_us, entry_ab_args, routing_sets, write_ab_result
from moekit.experts.base import ExpertWeights
from moekit.experts.reference import reference_experts
from moekit.kernels.launch import fused_moe
from moekit.kernels.tuning import MoEConfig, default_config, get_config


def main() -> None:
    args, cuda, dev, shapes = entry_ab_args(__doc__, "entry_ab.json", "SHAPE:M", flags=("--default",))
    dtype = torch.bfloat16 if cuda else torch.float32
    entries = [MoEConfig.from_json(json.loads(e), f"--entry {i}") for i, e in enumerate(args.entry)]
    rows = []
    for point in args.point:
        shape, m = point.split(":")
        M = int(m)
        _, E, k, H, I = shapes[shape] if cuda else ("tiny", 8, 2, 256, 128)
        w13 = torch.randn(E, 2 * I, H, device=dev, dtype=dtype) * H ** -0.5
        w2 = torch.randn(E, H, I, device=dev, dtype=dtype) * I ** -0.5
        sets = routing_sets(M, E, k, H, 8 if cuda else 2, dtype, dev)
        shipped = get_config(M, E, k, H, I, dtype, "NVIDIA_H200" if cuda else None)
        variants = [("A", shipped)] + [(chr(ord("B") + i), c) for i, c in enumerate(entries)]
        if args.default:
            variants.append(("default", default_config(M, E, k, H, I, torch.finfo(dtype).bits // 8)))

        def call(c, x, w, ids):
            return fused_moe(x, w13, w2, None, None, w, ids, None, "silu", config=c, direct=False, out_dtype=x.dtype)

        refs = [reference_experts(x, ExpertWeights(w13, w2), w, ids) for x, w, ids in sets[:2]]
        outs_a = [call(shipped, *s) for s in sets[:2]]
        row = {"point": point, "variants": {}}
        for name, c in variants:
            try:
                outs = [call(c, *s) for s in sets[:2]]
            except Exception as exc:  # noqa: BLE001 (a variant Triton or the launcher cannot take: recorded)
                print(f"{point} {name}: failed: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                row["variants"][name] = {"entry": c.to_json(), "failed": f"{type(exc).__name__}: {exc}"[:2000]}
                continue
            err = max(float((o.float() - r).norm() / r.norm()) for o, r in zip(outs, refs))
            vs_a = max(float((o.float() - a.float()).norm() / a.float().norm()) for o, a in zip(outs, outs_a))
            row["variants"][name] = {"entry": c.to_json(), "rel_err_vs_reference": err, "rel_err_vs_A": vs_a,
                                     "within_bf16_bound": err <= 1e-2, "rounds_us": []}
        for _ in range(args.rounds):
            for name, c in variants:
                v = row["variants"][name]
                if "failed" not in v and v["within_bf16_bound"]:
                    v["rounds_us"].append(ab_time_us(lambda *s, c=c: call(c, *s), sets, cuda, replays=10))
        for name, v in row["variants"].items():
            if not v.get("rounds_us"):
                continue
            v["us"] = statistics.median(v["rounds_us"])
            print(f"{point:20s} {name} {v['us']:8.1f} us  x{row['variants']['A']['us'] / v['us']:.3f} vs A  "
                  f"err {v['rel_err_vs_reference']:.1e}  {json.dumps(v['entry'])[:150]}", flush=True)
        rows.append(row)
        del w13, w2
    write_ab_result(args.out, "entry-ab", cuda, AB_TIMING, rows=rows)


if __name__ == "__main__":
    main()

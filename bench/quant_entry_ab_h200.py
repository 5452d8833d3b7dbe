"""Whole quantized calls through the shipped entry (A) and through given entries (B, C, ...), in
one process on one H200: outputs against A's (relative error, recorded), then CUDA-graph times
interleaved over --rounds.

    PYTHONPATH=src python bench/quant_entry_ab_h200.py --point qwen3-30b-a3b:fp8_w8a8:s:256 \\
        --entry '{"BLOCK_SIZE_M": 32, ..., "quant": {"swap1": true}}' [--entry ...] [--out FILE]

An entry is a tuned table's M entry (tiles, "gemm2", "quant" knobs), run as a call without a
config runs it: an entry whose knobs carry static_prefill runs that prefill config at a static
point (A is the call with no config at all, the shipped path). `--bf16` also times the
unquantized Triton call on the same routing (the ratio each variant reaches over it). `--device cpu`
is a dry run under TRITON_INTERPRET=1 on a tiny shape.
"""

import json
import statistics

import torch

from moekit.benchmarks.gpu import (AB_TIMING, _quant_call, ab_time_us, entry_ab_args, parse_quant_entry, quant_entry,
                                  quantized_weights, routing_sets, write_ab_result)
from moekit.cli.tune_quant import as_called
from moekit.kernels.launch import fused_moe
from moekit.kernels.launch_quant import quant_tiles
from moekit.kernels.quant_rows import modes_of
from moekit.quant import get_scheme


def main() -> None:
    args, cuda, dev, shapes = entry_ab_args(__doc__, "quant_entry_ab.json", "SHAPE:SCHEME:s|d:M",
                                            flags=("--bf16",))
    dtype = torch.bfloat16 if cuda else torch.float16
    entries = [parse_quant_entry(json.loads(e)) for e in args.entry]
    rows = []
    for point in args.point:
        shape, scheme_name, sd, m = point.split(":")
        M, static = int(m), sd == "s"
        _, E, k, H, I = shapes[shape] if cuda else ("tiny", 8, 2, 256, 128)
        scheme = get_scheme(scheme_name)
        wts = quantized_weights(scheme_name, E, H, I, static, dev)
        shipped = quant_tiles(M, E, k, H, I, dtype, "NVIDIA_H200" if cuda else None, scheme, modes_of(scheme))
        sets = routing_sets(M, E, k, H, 8 if cuda else 2, dtype, dev)
        # An explicit config takes no static_prefill knob: B, C, ... run an entry that carries one
        # as its prefill config (as the shipped call does; A passes no config at all).
        variants = [("A", shipped, (None, None))] + [(chr(ord("B") + i), e, as_called(*e) if static else e)
                                                     for i, e in enumerate(entries)]
        ref = [_quant_call(wts, *s).float() for s in sets]
        row = {"point": point, "variants": {}}
        for name, entry, (cfg, kn) in variants:
            shown = quant_entry(*entry)
            try:
                err = max(((_quant_call(wts, *s, config=cfg, knobs=kn).float() - r).norm() / r.norm()).item()
                          for s, r in zip(sets, ref))
            except Exception as exc:  # noqa: BLE001 (a variant Triton cannot build: recorded)
                print(f"{point} {name}: failed: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                row["variants"][name] = {"entry": shown, "failed": f"{type(exc).__name__}: {exc}"[:2000]}
                continue
            row["variants"][name] = {"entry": shown, "rel_err_vs_A": err, "rounds_us": []}
        bf16_rounds = []
        if args.bf16:  # timed in every round beside the variants (the clocks drift as the GPU heats)
            w13 = torch.randn(E, 2 * I, H, device=dev, dtype=dtype) * H ** -0.5
            w2 = torch.randn(E, H, I, device=dev, dtype=dtype) * I ** -0.5
        for _ in range(args.rounds):
            for name, _, (cfg, kn) in variants:
                v = row["variants"][name]
                if "failed" not in v:
                    v["rounds_us"].append(ab_time_us(lambda *s, c=cfg, n=kn: _quant_call(wts, *s, config=c, knobs=n),
                                                     sets, cuda, replays=10))
            if args.bf16:
                bf16_rounds.append(ab_time_us(
                    lambda x, w, i: fused_moe(x, w13, w2, None, None, w, i, None, "silu", out_dtype=x.dtype),
                    sets, cuda, replays=10))
        bf16_us = None
        if args.bf16:
            bf16_us = row["bf16_us"] = statistics.median(bf16_rounds)
            row["bf16_rounds_us"] = bf16_rounds
            del w13, w2
        for name, v in row["variants"].items():
            if "failed" in v:
                continue
            v["us"] = statistics.median(v["rounds_us"])
            vs_bf16 = f"x{bf16_us / v['us']:.3f} vs bf16  " if bf16_us else ""
            print(f"{point:34s} {name} {v['us']:8.1f} us  x{row['variants']['A']['us'] / v['us']:.3f} vs A  {vs_bf16}"
                  f"rel err vs A {v['rel_err_vs_A']:.1e}  {json.dumps(v['entry'])}", flush=True)
        rows.append(row)
        del wts
    write_ab_result(args.out, "quant-entry-ab", cuda, AB_TIMING, rows=rows)


if __name__ == "__main__":
    main()

"""One QuantKnobs knob flipped on the shipped quantized entries, A/B in one process, on one H200.

For every point of moekit.benchmarks.gpu.QUANT_CASES up to --max-m whose shipped entry runs the
sorted quantized kernels (entries on the prefill kernels are skipped, but for fuse_x_quant), the entry as shipped (A)
and with --knob set (B): outputs compared bit for bit on every routing set (recorded: a knob that
only reschedules work must keep them), then both timed in CUDA graphs of 8 calls with distinct
routing, interleaved. `--apply FILE` writes the knob into the shipped tables where B was at least
--min-gain faster with the same bits.

    PYTHONPATH=src python bench/quant_knob_ab_h200.py --knob pdl=1 [--out FILE] [--rounds 3] [--max-m 256]
        [--cases qwen3-30b-a3b:fp8_w8a8,...]
    python bench/quant_knob_ab_h200.py --apply FILE [--min-gain 1.01]

`--device cpu` is a dry run under TRITON_INTERPRET=1 on a tiny shape (wall-clock times).
"""

import dataclasses
import json
import os
import statistics
import sys

import torch

from moekit.benchmarks.gpu import (GPU_SHAPES, QUANT_CASES, _quant_call, ab_arg_parser, ab_device, ab_time_us,
                                  quantized_weights, routing_sets, write_ab_result)
from moekit.kernels.launch_quant import quant_tiles
from moekit.kernels.quant_rows import modes_of
from moekit.kernels.quant_tuning import QuantKnobs, quant_file_name
from moekit.kernels.tuning import SHIPPED_DIR
from moekit.quant import get_scheme


# Knobs that also reach entries on the prefill kernels (the alignment's launches are shared).
_PREFILL_KNOBS = {"fuse_x_quant"}


def _value(name, text):
    """A QuantKnobs field's value from its text, typed as the field's default."""
    default = getattr(QuantKnobs(), name)
    if isinstance(default, bool):
        return text.lower() in ("1", "true")
    return int(text) if isinstance(default, int) else text


def run(args, knob):
    cuda = args.device == "cuda"
    dev = torch.device(args.device)
    dtype = torch.bfloat16 if cuda else torch.float16
    shapes = {s[0]: s for s in GPU_SHAPES}
    cases = QUANT_CASES if cuda else (("tiny", "fp8_w8a8", True, (5, 40)),)
    rows = []
    for shape, scheme_name, static, ms in cases:
        if cuda and args.cases and f"{shape}:{scheme_name}" not in args.cases.split(","):
            continue
        ms = [m for m in ms if m <= args.max_m]
        if not ms:
            continue
        _, E, k, H, I = shapes[shape] if cuda else ("tiny", 8, 2, 256, 128)
        scheme = get_scheme(scheme_name)
        wts = quantized_weights(scheme_name, E, H, I, static, dev)
        for M in ms:
            cfg, knobs = quant_tiles(M, E, k, H, I, dtype, "NVIDIA_H200" if cuda else None, scheme, modes_of(scheme))
            label = f"{shape} {scheme_name}{' static' if static else ''} M={M}"
            if (knobs.static_prefill is not None or cfg.prefill is not None) and set(knob) - _PREFILL_KNOBS:
                print(f"{label}: skipped (prefill entry)", flush=True)
                continue
            flipped = dataclasses.replace(knobs, **knob)
            if flipped == knobs:
                print(f"{label}: skipped (already {knob})", flush=True)
                continue
            sets = routing_sets(M, E, k, H, 8 if cuda else 2, dtype, dev)
            call = lambda kn, *s: _quant_call(wts, *s, knobs=kn)  # noqa: E731
            try:
                same = all(torch.equal(call(knobs, *s), call(flipped, *s)) for s in sets)
            except Exception as exc:  # noqa: BLE001 (a variant Triton cannot build: recorded, next point)
                print(f"{label}: B failed: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                rows.append({"point": label, "M": M, "quant": flipped.to_json(),
                             "failed": f"{type(exc).__name__}: {exc}"[:2000]})
                continue
            times = {"A": [], "B": []}
            for _ in range(args.rounds):
                for name, kn in (("A", knobs), ("B", flipped)):
                    times[name].append(ab_time_us(lambda *s, kn=kn: call(kn, *s), sets, cuda, replays=10))
            med = {n: statistics.median(t) for n, t in times.items()}
            row = {"point": label, "table": quant_file_name(E, I, "NVIDIA_H200", scheme), "M": M,
                   "shipped_quant": knobs.to_json(), "quant": flipped.to_json(), "bit_identical": same, "us": med,
                   "rounds_us": times, "speedup": med["A"] / med["B"]}
            print(f"{label:38s} same bits {same!s:5s} A {med['A']:8.1f} us  B {med['B']:8.1f} us  "
                  f"x{row['speedup']:.3f}", flush=True)
            rows.append(row)
        del wts
    return rows


def apply(path, min_gain):
    with open(path) as f:
        rows = json.load(f)["rows"]
    for r in rows:
        if "failed" in r or not (r["bit_identical"] and r["speedup"] >= min_gain):
            continue
        table_path = os.path.join(SHIPPED_DIR, r["table"])
        with open(table_path) as f:
            table = json.load(f)
        table[str(r["M"])]["quant"] = r["quant"]
        with open(table_path, "w") as f:
            json.dump(table, f, indent=1)
            f.write("\n")
        print(f"{r['point']}: x{r['speedup']:.3f}, written to {r['table']}")


def main() -> None:
    p = ab_arg_parser(__doc__, "quant_knob_ab.json")
    p.add_argument("--knob", help="name=value of QuantKnobs fields, comma-separated, e.g. pdl=1")
    p.add_argument("--max-m", type=int, default=256)
    p.add_argument("--cases", help="only these SHAPE:SCHEME of QUANT_CASES, comma-separated")
    p.add_argument("--apply", metavar="RESULTS_JSON")
    p.add_argument("--min-gain", type=float, default=1.01)
    args = p.parse_args()
    if args.apply:
        apply(args.apply, args.min_gain)
        return
    if not args.knob:
        sys.exit("--knob is required (or --apply)")
    ab_device(args)
    knob = {name: _value(name, v) for name, v in (kv.split("=") for kv in args.knob.split(","))}
    rows = run(args, knob)
    write_ab_result(args.out, "quant-knob-ab", args.device == "cuda",
                    "CUDA graph of 8 calls with distinct softmax top-k routing, 10 replays, median us per call; "
                    "A (shipped) and B (knob set) interleaved, median of the rounds", knob=knob, rows=rows)


if __name__ == "__main__":
    main()

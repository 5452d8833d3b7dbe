"""GEMM1 aligning its own rows (gemm1.ALIGN, QuantKnobs.gemm1_align) against the alignment
launch, A/B in one process on one H200, at the decode points of the shipped tables.

For every shipped entry on the sorted kernels (bf16 tables; quantized tables for fp8 with static
scales and the weight-only schemes; prefill and direct-path entries are skipped) the entry as
shipped (A) and with the knob (B): the outputs must be bit-identical (checked on every timed
routing set), then both are timed in CUDA graphs of 8 calls with distinct routing, interleaved.

    PYTHONPATH=src python bench/align1_ab_h200.py [--out FILE] [--rounds 3] [--ms 1,16,64,256]
    python bench/align1_ab_h200.py --apply FILE [--min-gain 1.01]   (winners into the shipped tables)

`--device cpu` is a dry run under TRITON_INTERPRET=1 on tiny shapes (wall-clock times).
"""

import argparse
import dataclasses
import json
import os
import statistics
import sys

import torch

from moekit.benchmarks.gpu import GPU_SHAPES, _quant_call, ab_time_us, quantized_weights, routing_sets
from moekit.kernels.launch import fused_moe
from moekit.kernels.launch_quant import quant_tiles
from moekit.kernels.quant_rows import modes_of
from moekit.kernels.quant_tuning import quant_file_name
from moekit.kernels.tuning import SHIPPED_DIR, MoEConfig, TileConfig, config_file_name, get_config, use_direct
from moekit.quant import get_scheme

QUANT_POINTS = (("qwen3-30b-a3b", "fp8_w8a8", True), ("mixtral-8x7b", "fp8_w8a8", True),
                ("qwen3-30b-a3b", "int4_w4a16", False), ("mixtral-8x7b", "int4_w4a16", False),
                ("qwen3-30b-a3b", "int8_w8a16", False), ("mixtral-8x7b", "int8_w8a16", False))


def _ab(label, run, a, b, sets, rounds, cuda):
    same = all(torch.equal(run(a, *s), run(b, *s)) for s in sets)
    times = {"A": [], "B": []}
    for _ in range(rounds):
        for name, c in (("A", a), ("B", b)):
            times[name].append(ab_time_us(lambda *s, c=c: run(c, *s), sets, cuda, replays=10))
    med = {n: statistics.median(t) for n, t in times.items()}
    print(f"{label:36s} same bits {same!s:5s} A {med['A']:8.1f} us  B {med['B']:8.1f} us  x{med['A'] / med['B']:.3f}",
          flush=True)
    return {"point": label, "bit_identical": same, "us": med, "rounds_us": times, "speedup": med["A"] / med["B"]}


def bf16_part(cuda, dev, ms, rounds):
    rows = []
    dtype = torch.bfloat16 if cuda else torch.float32
    shapes = GPU_SHAPES if cuda else (("tiny", 8, 2, 64, 32),)
    gen = torch.Generator(device=dev).manual_seed(0)
    for shape, E, k, H, I in shapes:
        w13 = (torch.randn(E, 2 * I, H, device=dev, generator=gen) * H ** -0.5).to(dtype)
        w2 = (torch.randn(E, H, I, device=dev, generator=gen) * I ** -0.5).to(dtype)

        def run(c, x, w, ids):
            return fused_moe(x, w13, w2, None, None, w, ids, None, "silu", config=c, out_dtype=x.dtype)

        for M in ms:
            cfg = get_config(M, E, k, H, I, dtype, "NVIDIA_H200" if cuda else None)
            if not cuda:
                cfg = MoEConfig(TileConfig(16, 32, 32, 2, 4, 2), TileConfig(16, 32, 32, 2, 4, 2))
            if cfg.prefill is not None or use_direct(M, k, E):
                print(f"{shape} bf16 M={M}: skipped ({'prefill' if cfg.prefill else 'direct'} entry)", flush=True)
                continue
            b = dataclasses.replace(cfg, gemm1=dataclasses.replace(cfg.gemm1, ALIGN=1))
            sets = routing_sets(M, E, k, H, 8 if cuda else 2, dtype, dev)
            row = _ab(f"{shape} bf16 M={M}", run, cfg, b, sets, rounds, cuda)
            row.update(table=config_file_name(E, I, "NVIDIA_H200"), M=M, shipped=cfg.to_json(), entry=b.to_json())
            rows.append(row)
        del w13, w2
    return rows


def quant_part(cuda, dev, ms, rounds):
    rows = []
    points = QUANT_POINTS if cuda else (("tiny", "int4_w4a16", False),)
    shapes = {s[0]: s for s in GPU_SHAPES} if cuda else {"tiny": ("tiny", 8, 2, 256, 128)}
    dtype = torch.bfloat16 if cuda else torch.float16
    for shape, scheme_name, static in points:
        _, E, k, H, I = shapes[shape]
        scheme = get_scheme(scheme_name)
        wts = quantized_weights(scheme_name, E, H, I, static, dev)
        for M in ms:
            cfg, knobs = quant_tiles(M, E, k, H, I, dtype, "NVIDIA_H200" if cuda else None, scheme, modes_of(scheme))
            label = f"{shape} {scheme_name}{' static' if static else ''} M={M}"
            if knobs.static_prefill is not None or cfg.prefill is not None:
                print(f"{label}: skipped (prefill entry)", flush=True)
                continue
            b = dataclasses.replace(knobs, gemm1_align=True)
            sets = routing_sets(M, E, k, H, 8 if cuda else 2, dtype, dev)
            row = _ab(label, lambda kn, x, w, ids: _quant_call(wts, x, w, ids, config=cfg, knobs=kn), knobs, b, sets,
                      rounds, cuda)
            row.update(table=quant_file_name(E, I, "NVIDIA_H200", scheme), M=M, shipped_quant=knobs.to_json(),
                       quant=b.to_json())
            rows.append(row)
        del wts
    return rows


def apply(path, min_gain):
    """Write the winners of a run (bit-identical, at least min_gain faster) into the shipped tables."""
    with open(path) as f:
        rows = json.load(f)["rows"]
    for r in rows:
        if not (r["bit_identical"] and r["speedup"] >= min_gain):
            continue
        table_path = os.path.join(SHIPPED_DIR, r["table"])
        with open(table_path) as f:
            table = json.load(f)
        entry = table[str(r["M"])]
        if "quant" in r:
            entry["quant"] = r["quant"]
        else:
            entry.update({key: value for key, value in r["entry"].items() if key != "gemm2"})
        with open(table_path, "w") as f:
            json.dump(table, f, indent=1)
            f.write("\n")
        print(f"{r['point']}: x{r['speedup']:.3f}, written to {r['table']}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "h200-align1-ab.json"))
    p.add_argument("--ms", default="1,16,64,256")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--apply", metavar="RESULTS_JSON")
    p.add_argument("--min-gain", type=float, default=1.01)
    args = p.parse_args()
    if args.apply:
        apply(args.apply, args.min_gain)
        return
    cuda = args.device == "cuda"
    if not cuda and os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("--device cpu needs TRITON_INTERPRET=1")
    dev = torch.device(args.device)
    ms = [int(m) for m in args.ms.split(",")] if cuda else [5, 40]
    rows = bf16_part(cuda, dev, ms, args.rounds) + quant_part(cuda, dev, ms, args.rounds)
    import triton  # noqa: PLC0415

    result = {"benchmark": "gemm1-align-ab", "device": torch.cuda.get_device_name() if cuda else "cpu",
              "torch": torch.__version__, "triton": triton.__version__, "command": " ".join(sys.argv),
              "timing": "CUDA graph of 8 calls with distinct softmax top-k routing, 10 replays, median us per call; "
                        "A (shipped) and B (GEMM1 aligns) interleaved, median of the rounds",
              "rows": rows}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

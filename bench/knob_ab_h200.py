"""One prefill knob flipped on the shipped entries, A/B in one process, on one H200.

For every shipped entry that runs the prefill kernels (bf16 tables at M in --ms, and the fp8
entries carrying static_prefill), the entry as shipped (A) and with --knob set (B): the outputs
must be bit-identical where the knob only reschedules work (checked on every timed routing set
and recorded), then both are timed in CUDA graphs, interleaved (A B A B ...), with fresh
routing per call in the graph. Entries the knob cannot apply to are skipped.

    PYTHONPATH=src python bench/knob_ab_h200.py --knob flatten=1[,ws=1] [--out FILE] [--ms 1024,4096,16384] [--rounds 3]
        [--shapes qwen3-30b-a3b,...] [--fp8-only] [--bf16]

`--bf16` times the bf16 kernel at each fp8 point after its A/B rounds (ratios in the record).

`--device cpu` is a dry run under TRITON_INTERPRET=1 on tiny fp32 shapes (wall-clock times).
"""

import argparse
import dataclasses
import json
import os
import statistics
import sys

import torch

from moekit.benchmarks.floors import layer_flops
from moekit.benchmarks.gpu import GPU_SHAPES, _quant_call, ab_time_us, quantized_weights, routing_sets
from moekit.kernels.launch import fused_moe
from moekit.kernels.launch_quant import quant_tiles
from moekit.kernels.quant_rows import modes_of
from moekit.kernels.tuning import MoEConfig, PrefillConfig, TileConfig, get_config
from moekit.quant import get_scheme

FP8_POINTS = (("qwen3-30b-a3b", 1024), ("qwen3-30b-a3b", 4096), ("qwen3-30b-a3b", 16384), ("mixtral-8x7b", 256),
              ("mixtral-8x7b", 1024), ("mixtral-8x7b", 4096), ("mixtral-8x7b", 16384))


def _flipped(cfg, knob):
    """cfg with the prefill knob set (None when the knobs cannot combine)."""
    try:
        return dataclasses.replace(cfg, prefill=dataclasses.replace(cfg.prefill, **knob))
    except ValueError:
        return None




def _point(label, run, cfg, knob, sets, rounds, cuda, flops) -> dict:
    """Bits of A and B on every set, then interleaved times."""
    flipped = _flipped(cfg, knob)
    if flipped is None or flipped == cfg:
        print(f"{label:28s} skipped: {knob} does not apply to {cfg.prefill.to_json()}", flush=True)
        return {"point": label, "config": cfg.to_json(), "skipped": f"{knob} does not apply"}
    try:
        same = all(torch.equal(run(cfg, *s), run(flipped, *s)) for s in sets)
    except Exception as e:  # noqa: BLE001 (refused by the launcher, or Triton cannot compile or fit it)
        print(f"{label:28s} skipped: {e}", flush=True)
        return {"point": label, "config": cfg.to_json(), "skipped": str(e)}
    times = {"A": [], "B": []}
    for _ in range(rounds):
        for name, c in (("A", cfg), ("B", flipped)):
            times[name].append(ab_time_us(lambda *s, c=c: run(c, *s), sets, cuda))
    med = {n: statistics.median(t) for n, t in times.items()}
    row = {"point": label, "config": cfg.to_json(), "knob": knob, "bit_identical": same, "us": med,
           "rounds_us": times, "speedup": med["A"] / med["B"], "tflops_A": flops / med["A"] * 1e-6,
           "tflops_B": flops / med["B"] * 1e-6}
    print(f"{label:28s} same bits {same!s:5s} A {med['A']:9.1f} us  B {med['B']:9.1f} us  x{row['speedup']:.3f}",
          flush=True)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--knob", required=True, help="name=value of PrefillConfig knobs, comma-separated, e.g. flatten=1,ws=1")
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "knob_ab.json"))
    p.add_argument("--ms", default="1024,4096,16384")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--fp8-only", action="store_true", help="only the fp8 entries (knobs of the static-scale path)")
    p.add_argument("--bf16", action="store_true", help="also time the bf16 kernel at each fp8 point (the ratios)")
    p.add_argument("--shapes", default="", help="comma-separated shape names to keep (default: all)")
    args = p.parse_args()
    knob = {name: int(value) for name, value in (kv.split("=") for kv in args.knob.split(","))}
    cuda = args.device == "cuda"
    dev = torch.device(args.device)
    dtype = torch.bfloat16 if cuda else torch.float32
    table_device = "NVIDIA_H200" if cuda else None
    shapes = GPU_SHAPES if cuda else (("tiny", 8, 2, 64, 32),)
    keep = set(args.shapes.split(",")) if args.shapes else None
    if keep and cuda:
        shapes = tuple(s for s in shapes if s[0] in keep)
    ms = [int(m) for m in args.ms.split(",")] if cuda else [64]
    gen = torch.Generator(device=dev).manual_seed(0)
    rows = []
    for shape, E, k, H, I in () if args.fp8_only else shapes:
        w13 = (torch.randn(E, 2 * I, H, device=dev, generator=gen) * H ** -0.5).to(dtype)
        w2 = (torch.randn(E, H, I, device=dev, generator=gen) * I ** -0.5).to(dtype)

        def run(c, x, w, ids):
            return fused_moe(x, w13, w2, None, None, w, ids, None, "silu", config=c, direct=False, out_dtype=x.dtype)

        for M in ms:
            cfg = get_config(M, E, k, H, I, dtype, table_device)
            if not cuda:  # the dry run's tiny tiles, warp-specialized schedule
                cfg = MoEConfig(TileConfig(64, 32, 32, 2, 4, 2), TileConfig(64, 16, 16, 3, 4, 2),
                                PrefillConfig(2, 1, 1, act_tma=1, ws=1))
            if cfg.prefill is None:
                continue
            sets = routing_sets(M, E, k, H, 2, dtype, dev)
            rows.append(_point(f"{shape} bf16 M={M}", run, cfg, knob, sets, args.rounds, cuda,
                               layer_flops(M, k, H, I)))
        del w13, w2
    if cuda:
        scheme = get_scheme("fp8_w8a8")
        for shape, M in (p for p in FP8_POINTS if p[1] in ms and (keep is None or p[0] in keep)):
            _, E, k, H, I = next(s for s in GPU_SHAPES if s[0] == shape)
            wts = quantized_weights("fp8_w8a8", E, H, I, True, dev)
            _, knobs = quant_tiles(M, E, k, H, I, dtype, table_device, scheme, modes_of(scheme))
            if knobs.static_prefill is None:
                continue
            sets = routing_sets(M, E, k, H, 2, dtype, dev)
            row = _point(f"{shape} fp8 static M={M}", lambda c, x, w, ids: _quant_call(wts, x, w, ids, config=c),
                         knobs.static_prefill, knob, sets, args.rounds, cuda, layer_flops(M, k, H, I))
            del wts
            if args.bf16 and "us" in row:
                w13 = (torch.randn(E, 2 * I, H, device=dev, generator=gen) * H ** -0.5).to(dtype)
                w2 = (torch.randn(E, H, I, device=dev, generator=gen) * I ** -0.5).to(dtype)
                bf16 = statistics.median(ab_time_us(lambda x, w, ids: fused_moe(x, w13, w2, None, None, w, ids, None,
                                                                                "silu", out_dtype=x.dtype), sets, cuda)
                                         for _ in range(args.rounds))
                row["bf16_us"] = bf16
                row["vs_bf16"] = {n: bf16 / t for n, t in row["us"].items()}
                print(f"{'':28s} bf16 {bf16:9.1f} us: A x{row['vs_bf16']['A']:.3f}, B x{row['vs_bf16']['B']:.3f}",
                      flush=True)
                del w13, w2
            rows.append(row)
    import triton  # noqa: PLC0415

    result = {"benchmark": "prefill-knob-ab", "knob": knob, "device": torch.cuda.get_device_name() if cuda else "cpu",
              "torch": torch.__version__, "triton": triton.__version__, "command": " ".join(sys.argv),
              "timing": "CUDA graph of 2 calls with fresh softmax top-k routing, 5 replays, median us per call; "
                        "A (shipped) and B (knob set) interleaved, median of the rounds",
              "rows": rows}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

"""A/B: the block scheme's GEMM1 on cuBLAS (knob cublas1 "on") against the Gluon GEMM1 ("off"),
eagerly, alternating, at each shape's table or untuned rule for its other knobs (points whose
knobs do not take the Gluon kernels are skipped: the knob does not apply there); and the host
time of one call (the launches run ahead of the GPU until the row counts are read back).

    python bench/cublas_gemm1_ab_h200.py --out $OUT/h200-cublas-gemm1-ab.json
    python bench/cublas_gemm1_ab_h200.py --shapes qwen3-30b-a3b mixtral-8x7b --M 2048 4096 16384
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time

import torch

from moekit.benchmarks.gpu import _quant_call, eager_time_us, quantized_weights, routing_sets, shape_by_name
from moekit.kernels.launch_quant import quant_tiles
from moekit.kernels.quant_rows import modes_of
from moekit.kernels.tuning import device_name
from moekit.quant import get_scheme


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    p.add_argument("--M", type=int, nargs="+", default=[12288, 16384])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--shapes", nargs="+", default=["deepseek-v3"])
    args = p.parse_args()
    sch = get_scheme("fp8_w8a8_block128")
    doc = {"torch": torch.__version__, "device": torch.cuda.get_device_name(), "points": []}
    for shape in args.shapes:
        _, E, k, H, I = shape_by_name(shape)
        wts = quantized_weights(sch.name, E, H, I, False, "cuda")
        for M in args.M:
            cfg, knobs = quant_tiles(M, E, k, H, I, torch.bfloat16, device_name(), sch, modes_of(sch))
            if not knobs.gluon:
                print(f"{shape} M={M}: Triton tiles (knob gluon=0), skipped", flush=True)
                continue
            sets = routing_sets(M, E, k, H, 2, torch.bfloat16, "cuda")
            fns = {mode: (lambda x, w, i, kn=dataclasses.replace(knobs, cublas1=mode): _quant_call(wts, x, w, i, cfg, kn))
                   for mode in ("on", "off")}
            times = {m: [] for m in fns}
            with torch.inference_mode():
                for _ in range(args.rounds):
                    for mode, fn in fns.items():
                        times[mode].append(eager_time_us(fn, sets, replays=3))
                torch.cuda.synchronize()
                host = []
                for _ in range(3):
                    t0 = time.perf_counter()
                    fns["on"](*sets[0])
                    host.append((time.perf_counter() - t0) * 1e6)
                    torch.cuda.synchronize()
            row = {"shape": shape, "M": M, "rows_an_expert": M * k / E,
                   "knobs": dataclasses.asdict(knobs) | {"static_prefill": None},
                   "on_us": statistics.median(times["on"]), "off_us": statistics.median(times["off"]),
                   "rounds_on_us": times["on"], "rounds_off_us": times["off"],
                   "host_us_on_call": statistics.median(host)}
            row["on_over_off"] = row["on_us"] / row["off_us"]
            doc["points"].append(row)
            print(f"{shape} M={M} ({row['rows_an_expert']:.0f} rows an expert): cuBLAS GEMM1 {row['on_us']:.1f} us, "
                  f"Gluon GEMM1 {row['off_us']:.1f} us, x{row['on_over_off']:.3f}; host {row['host_us_on_call']:.0f} "
                  f"us a call", flush=True)
            del sets
        del wts
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())

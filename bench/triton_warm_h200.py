"""GEMM2's L2 warm-up (gemm2.WARM_L2) against the shipped decode entries, side by side on one H200.

    PYTHONPATH=src python bench/triton_warm_h200.py [--shapes ...] [--ms 1,16,64,256] [--out FILE]
        [--write-configs DIR]
    PYTHONPATH=src python bench/triton_warm_h200.py --quant "qwen3-30b-a3b:fp8_w8a8:s:16,64;..." [--out FILE]

For every shape and M whose shipped entry runs the two-launch decode kernels (not the fused
direct path, not the prefill kernels): the entry as shipped, with GEMM2 launched as GEMM1's
programmatic dependent (PDL), and with PDL plus WARM_L2. Each variant is checked against
`reference` once, then timed in CUDA graphs with fresh routing, in interleaved rounds (the
median of the rounds' medians), so drift on the machine hits every variant alike.
--write-configs writes copies of the shipped tables in which an entry takes the fastest
variant when it beats the shipped one by more than --margin. --quant does the same for the
quantized kernels' entries (QuantKnobs pdl and warm_l2; s: static fp8 activation scales), against
the emulated reference, and --write-configs writes the quantized tables.
"""

import argparse
import json
import os
import statistics
from dataclasses import replace

import torch

from moekit.benchmarks.gpu import (
    GPU_SHAPES, _quant_call, graph_time_us, quant_entry, quantized_weights, routing_sets, shape_by_name,
)
from moekit.experts.base import ExpertWeights
from moekit.experts.reference import reference_experts
from moekit.kernels.launch import fused_moe
from moekit.kernels.launch_quant import quant_tiles
from moekit.kernels.quant_rows import modes_of
from moekit.kernels.quant_tuning import quant_file_name
from moekit.kernels.tuning import SHIPPED_DIR, MoEConfig, config_file_name, device_name, get_config
from moekit.quant import emulated_experts, get_scheme


def variants(cfg: MoEConfig) -> dict:
    """{name: config} to compare; empty where the entry does not run GEMM2 as its own launch."""
    if cfg.prefill is not None or cfg.gemm1.FUSED:
        return {}
    out = {"shipped": cfg}
    pdl = replace(cfg, gemm2=replace(cfg.gemm2, PDL=1))
    if not cfg.gemm2.PDL:
        out["pdl"] = pdl
    out["pdl+warm_l2"] = replace(pdl, gemm2=replace(pdl.gemm2, WARM_L2=1))
    return out


def quant_variants(cfg, kn) -> dict:
    out = {"shipped": (cfg, kn)}
    if not kn.pdl:
        out["pdl"] = (cfg, replace(kn, pdl=True))
    if not kn.warm_l2:
        out["pdl+warm_l2"] = (cfg, replace(kn, pdl=True, warm_l2=True))
    return out


def time_variants(point, cfgs, call, sets, rounds):
    """Interleaved rounds of CUDA-graph timings of call(args, config) per variant."""
    point["rounds"] = {n: [] for n in cfgs}
    for _ in range(rounds):
        for n, cfg in cfgs.items():
            point["rounds"][n].append(graph_time_us(lambda a, b, c, cfg=cfg: call(a, b, c, cfg), sets, replays=7))
    point["us"] = {n: statistics.median(v) for n, v in point["rounds"].items()}
    point["best"] = min(point["us"], key=point["us"].get)
    print(f"{point['shape']:14s} {point.get('scheme', 'bf16'):18s} M={point['M']:5d} "
          + "  ".join(f"{n} {us:7.1f}" for n, us in point["us"].items())
          + f"  -> {point['best']}  (errs {max(point['rel_err'].values()):.1e})", flush=True)


def run_quant(args, result) -> None:
    dev = device_name()
    for part in filter(None, args.quant.split(";")):
        name, scheme, st, ms = part.split(":")
        _, E, k, H, I = shape_by_name(name)
        sch = get_scheme(scheme)
        wts = quantized_weights(scheme, E, H, I, st == "s", "cuda")
        fname = quant_file_name(E, I, dev, sch)
        path = os.path.join(SHIPPED_DIR, fname)
        table = json.load(open(path)) if os.path.exists(path) else None
        changed = False
        for M in (int(m) for m in ms.split(",")):
            cfgs = quant_variants(*quant_tiles(M, E, k, H, I, torch.bfloat16, dev, sch, modes_of(sch)))
            sets = routing_sets(M, E, k, H, 8, torch.bfloat16, "cuda")
            x, w, ids = sets[0]
            ref = emulated_experts(x, wts, w, ids).float()
            point = {"shape": name, "scheme": scheme, "static": st == "s", "M": M, "rel_err": {},
                     "configs": {n: quant_entry(*c) for n, c in cfgs.items()}}
            for n, (cfg, kn) in cfgs.items():
                out = _quant_call(wts, x, w, ids, cfg, kn).float()
                point["rel_err"][n] = float((out - ref).norm() / ref.norm())
            time_variants(point, cfgs, lambda a, b, c, ck: _quant_call(wts, a, b, c, *ck), sets, args.rounds)
            result["points"].append(point)
            best = point["best"]
            if table is not None and best != "shipped" and point["us"][best] < (1 - args.margin) * point["us"]["shipped"]:
                key = str(min((int(m) for m in table), key=lambda m: (abs(m - M), m)))
                table[key] = quant_entry(*cfgs[best])
                changed = True
        if args.write_configs and changed:
            os.makedirs(args.write_configs, exist_ok=True)
            with open(os.path.join(args.write_configs, fname), "w") as fh:
                json.dump(table, fh, indent=1)
                fh.write("\n")
        del wts
        torch.cuda.empty_cache()
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=1)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default=",".join(s[0] for s in GPU_SHAPES))
    p.add_argument("--ms", default="1,16,64,256")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--margin", type=float, default=0.02)
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "warm_l2.json"))
    p.add_argument("--write-configs", default="")
    p.add_argument("--quant", default="", help="';'-separated SHAPE:SCHEME:s|d:M,M,... (quantized entries instead)")
    args = p.parse_args()
    dev = device_name()
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "points": []}
    if args.quant:
        run_quant(args, result)
        return
    for name in args.shapes.split(","):
        _, E, k, H, I = shape_by_name(name)
        w13 = torch.randn(E, 2 * I, H, device="cuda", dtype=torch.bfloat16) * H ** -0.5
        w2 = torch.randn(E, H, I, device="cuda", dtype=torch.bfloat16) * I ** -0.5
        fname = config_file_name(E, I, dev)
        with open(os.path.join(SHIPPED_DIR, fname)) as fh:
            table = json.load(fh)
        changed = False
        for M in (int(m) for m in args.ms.split(",")):
            cfgs = variants(get_config(M, E, k, H, I, torch.bfloat16, dev))
            if not cfgs:
                continue
            sets = routing_sets(M, E, k, H, 8, torch.bfloat16, "cuda")
            x, w, ids = sets[0]
            ref = reference_experts(x.float(), ExpertWeights(w13.float(), w2.float()), w, ids)
            point = {"shape": name, "M": M, "configs": {n: c.to_json() for n, c in cfgs.items()}, "rel_err": {}}
            for n, cfg in cfgs.items():
                out = fused_moe(x, w13, w2, None, None, w, ids, None, "silu", config=cfg).float()
                point["rel_err"][n] = float((out - ref).norm() / ref.norm())
            time_variants(point, cfgs, lambda a, b, c, cfg: fused_moe(a, w13, w2, None, None, b, c, None, "silu",
                                                                       config=cfg), sets, args.rounds)
            best = point["best"]
            result["points"].append(point)
            if best != "shipped" and point["us"][best] < (1 - args.margin) * point["us"]["shipped"]:
                key = str(min((int(m) for m in table), key=lambda m: (abs(m - M), m)))
                table[key] = cfgs[best].to_json()
                changed = True
        if args.write_configs and changed:
            os.makedirs(args.write_configs, exist_ok=True)
            with open(os.path.join(args.write_configs, fname), "w") as fh:
                json.dump(table, fh, indent=1)
                fh.write("\n")
        del w13, w2
        torch.cuda.empty_cache()
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()

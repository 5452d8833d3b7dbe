"""Merged tails (prefill knob merge) against the shipped entries, in one process, on one H200.

For each point, A is the shipped entry and the B candidates run the prefill kernels with
merge=16 / 32 on the shipped GEMM1 tiles (and with four stages), with three GEMM2 tiles
(merge takes no warp specialization, so GEMM2 runs unspecialized: 8 warps for 256 columns).
Every candidate's output is checked against A's (bf16 rounding: relative error <= 2e-2) and
against itself run to run (bits), then A and the candidates are timed in CUDA graphs,
interleaved over rounds, with fresh softmax top-k routing per call.

    PYTHONPATH=src python bench/merge_ab_h200.py --points deepseek-v3:4096,qwen3-30b-a3b:4096 [--out FILE]

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
from moekit.benchmarks.gpu import ab_time_us, routing_sets, shape_by_name
from moekit.kernels.launch import fused_moe
from moekit.kernels.tuning import MoEConfig, PrefillConfig, TileConfig, get_config

GEMM2_TILES = ((256, 64, 8, 3), (128, 64, 8, 3), (128, 64, 4, 4))  # BN, BK, warps, stages


def candidates(cfg: MoEConfig, merges, full: bool):
    """(label, config) of the merged candidates around a shipped entry."""
    g1s = [cfg.gemm1]
    if full:
        g1s.append(dataclasses.replace(cfg.gemm1, num_stages=4))
    out = []
    for merge in merges:
        for g1 in g1s:
            for bn, bk, warps, stages in GEMM2_TILES if full else GEMM2_TILES[:2]:
                g2 = TileConfig(cfg.block_m, bn, bk, cfg.gemm2.GROUP_SIZE_M, warps, stages)
                pre = PrefillConfig(tma=2, programs_per_sm=max(1, cfg.prefill.programs_per_sm), tail=1, act_tma=1,
                                    x_tma=1, gu1=1, merge=merge)
                label = f"merge={merge} g1 s{g1.num_stages} g2 {bn}x{bk} w{warps} s{stages}"
                out.append((label, MoEConfig(g1, g2, pre)))
    return out


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--points", default="deepseek-v3:4096,deepseek-v3:16384,qwen3-30b-a3b:4096,olmoe-1b-7b:4096,"
                                        "gpt-oss-20b:4096")
    p.add_argument("--full", default="deepseek-v3:4096", help="points that also try GEMM1 with 4 stages and "
                                                               "a third GEMM2 tile")
    p.add_argument("--merges", default="16,32")
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "merge_ab.json"))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    args = p.parse_args()
    cuda = args.device == "cuda"
    dev = torch.device(args.device)
    dtype = torch.bfloat16 if cuda else torch.float32
    merges = [int(m) for m in args.merges.split(",")]
    points = [(s.split(":")[0], int(s.split(":")[1])) for s in args.points.split(",")] if cuda else [("tiny", 64)]
    full = set(args.full.split(","))
    rows = []
    for name, M in points:
        if cuda:
            _, E, k, H, I = shape_by_name(name)
            cfg = get_config(M, E, k, H, I, dtype, "NVIDIA_H200")
        else:
            E, k, H, I = 8, 2, 64, 32
            cfg = MoEConfig(TileConfig(64, 32, 32, 2, 4, 2), TileConfig(64, 16, 16, 3, 4, 2),
                            PrefillConfig(2, 1, 1, act_tma=1, ws=1))
        gen = torch.Generator(device=dev).manual_seed(0)
        w13 = (torch.randn(E, 2 * I, H, device=dev, generator=gen) * H ** -0.5).to(dtype)
        w2 = (torch.randn(E, H, I, device=dev, generator=gen) * I ** -0.5).to(dtype)

        def run(c, x, w, ids):
            return fused_moe(x, w13, w2, None, None, w, ids, None, "silu", config=c, direct=False, out_dtype=x.dtype)

        sets = routing_sets(M, E, k, H, 2, dtype, dev)
        cands = [("A shipped", cfg)]
        for label, c in candidates(cfg, merges if cuda else [16, 32], f"{name}:{M}" in full or not cuda):
            try:
                outs = [run(c, *s) for s in sets]
                err = max(rel_err(o, run(cfg, *s)) for o, s in zip(outs, sets))
                same = all(torch.equal(o, run(c, *s)) for o, s in zip(outs, sets))
            except (ValueError, RuntimeError) as e:  # refused, or failed to compile
                print(f"{name} M={M} {label}: skipped: {str(e)[:200]}", flush=True)
                continue
            if err > 2e-2 or not same:
                print(f"{name} M={M} {label}: WRONG rel err {err:.2e}, run to run same {same}", flush=True)
                rows.append({"point": f"{name}:{M}", "candidate": label, "config": c.to_json(), "rel_err": err,
                             "run_to_run_bits": same, "wrong": True})
                continue
            cands.append((label, c))
            rows.append({"point": f"{name}:{M}", "candidate": label, "config": c.to_json(), "rel_err": err,
                         "run_to_run_bits": same})
        times = {label: [] for label, _ in cands}
        for _ in range(args.rounds):
            for label, c in cands:
                times[label].append(ab_time_us(lambda *s, c=c: run(c, *s), sets, cuda))
        flops = layer_flops(M, k, H, I)
        a = statistics.median(times["A shipped"])
        for label, c in cands:
            med = statistics.median(times[label])
            row = next((r for r in rows if r["point"] == f"{name}:{M}" and r["candidate"] == label), None)
            if row is None:
                row = {"point": f"{name}:{M}", "candidate": label, "config": c.to_json()}
                rows.append(row)
            row.update(us=med, rounds_us=times[label], speedup_vs_shipped=a / med, tflops=flops / med * 1e-6)
            print(f"{name} M={M} {label:40s} {med:9.1f} us  x{a / med:.3f}  {flops / med * 1e-6:6.1f} TFLOP/s",
                  flush=True)
        del w13, w2, sets
        if cuda:
            torch.cuda.empty_cache()
    import triton  # noqa: PLC0415

    result = {"benchmark": "prefill-merge-ab", "device": torch.cuda.get_device_name() if cuda else "cpu",
              "torch": torch.__version__, "triton": triton.__version__, "command": " ".join(sys.argv),
              "timing": "CUDA graph of 2 calls with fresh softmax top-k routing, 5 replays, median us per call; "
                        "shipped and candidates interleaved, median of the rounds",
              "rows": rows}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

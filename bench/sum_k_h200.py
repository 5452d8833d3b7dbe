"""The sum over k at large M (triton_moe.sum_k_kernel) on one GPU: block shapes, warps and
pipelined slot loads, each timed in a CUDA graph against the bytes it must move.

    PYTHONPATH=src python bench/sum_k_h200.py [--out FILE]

Each point is a PERF.md shape's [T * k, H] bf16 rows summed into [T, H] bf16; the shipped
launch (BT = 4096 / BN rows, BN = min(1024, H), no pipelining) is the first variant.
"""

import argparse
import json
import os

import torch
import triton

from moekit.benchmarks.gpu import graph_time_us
from moekit.kernels.triton_moe import sum_k_kernel

POINTS = (("qwen3-30b-a3b", 4096, 8, 2048), ("olmoe-1b-7b", 4096, 8, 2048), ("gpt-oss-20b", 4096, 4, 2880),
          ("mixtral-8x7b", 16384, 2, 4096), ("deepseek-v3", 16384, 8, 7168))
# (rows per program BT, columns BN, pipelined slot loads, warps); BN None: min(1024, next pow2 of H)
VARIANTS = ((None, None, None, 4), (None, None, 2, 4), (None, None, 3, 4), (2, None, 3, 4), (8, 512, 2, 4),
            (1, 2048, 4, 8), (4, 1024, 2, 8), (16, 256, 2, 4))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "sum_k.json"))
    args = p.parse_args()
    rows = []
    for name, T, k, H in POINTS:
        y = torch.randn(T * k, H, device="cuda").bfloat16()
        ids = torch.randint(0, 64, (T, k), device="cuda", dtype=torch.int32)
        out = torch.empty(T, H, device="cuda", dtype=torch.bfloat16)
        ref = y.view(T, k, H).float().sum(1).bfloat16()
        moved = (y.numel() + out.numel()) * 2
        for bt, bn, stages, warps in VARIANTS:
            bn = bn or min(1024, max(16, triton.next_power_of_2(H)))
            bt = bt or max(1, 4096 // bn)

            def run():
                sum_k_kernel[(triton.cdiv(T, bt), triton.cdiv(H, bn))](
                    y, out, ids, ids, T, H, k, y.stride(0), out.stride(0), BT=bt, BN=bn, HAS_MAP=False,
                    STAGES=stages, num_warps=warps)

            run()
            ok = bool(torch.allclose(out.float(), ref.float(), rtol=1e-2, atol=1e-2))
            us = graph_time_us(lambda: run(), [()] * 4, replays=5)
            row = dict(shape=name, T=T, k=k, H=H, BT=bt, BN=bn, STAGES=stages, warps=warps, us=us,
                       tb_per_s=moved / us * 1e-6, close_to_torch=ok)
            rows.append(row)
            print(f"{name:14s} T={T:6d} BT={bt:3d} BN={bn:5d} stages={stages} warps={warps}: {us:8.1f} us "
                  f"{row['tb_per_s']:.2f} TB/s {'ok' if ok else 'MISMATCH'}", flush=True)
    with open(args.out, "w", encoding="utf-8") as fh:
        json.dump({"benchmark": "sum over k", "device": torch.cuda.get_device_name(), "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()

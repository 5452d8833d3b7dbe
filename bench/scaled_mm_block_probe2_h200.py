"""Probe 2: torch._scaled_mm's block recipe at small K (the layer's calling convention), and the
transposed orientation (weights as the 128 x 128 operand a, x^T as the 1 x 128 operand b) by rows.

    python bench/scaled_mm_block_probe2_h200.py --out $OUT/h200-scaled-mm-block-probe-3.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from scaled_mm_block_probe_h200 import quant_blocks, quant_groups, time_ms  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    args = p.parse_args()
    dev = "cuda"
    torch.manual_seed(0)
    doc = {"torch": torch.__version__, "small_k": {}, "transposed_layouts": {}, "transposed_rows": {}}
    for K, N, M in itertools.product((256, 512, 768, 1024, 2048), (512, 1024), (4, 12, 64, 132)):
        x = torch.randn(M, K, device=dev)
        xq, sa = quant_groups(x)
        wq, sb = quant_blocks(torch.randn(N, K, device=dev) * 0.05)
        ref = (xq.float().view(M, K // 128, 128) * sa[..., None]).view(M, K) @ \
              (wq.float().view(N // 128, 128, K // 128, 128) * sb[:, None, :, None]).view(N, K).t()
        out = torch.empty(M, N, device=dev, dtype=torch.bfloat16)
        try:
            torch.ops.aten._scaled_mm.out(xq, wq.t(), sa.t().contiguous().t(), sb.t(), out_dtype=torch.bfloat16, out=out)
            err = round(float((out.float() - ref).norm() / ref.norm()), 5)
        except Exception as e:  # noqa: BLE001
            err = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
        doc["small_k"][f"K={K} N={N} M={M}"] = err
        print("small_k", K, N, M, err, flush=True)
    # transposed: out^T [N, M] = W [N, K] x^T
    M, N, K = 256, 512, 1024
    x = torch.randn(M, K, device=dev)
    xq, sa = quant_groups(x)
    wq, sb = quant_blocks(torch.randn(N, K, device=dev) * 0.05)
    ref = ((xq.float().view(M, K // 128, 128) * sa[..., None]).view(M, K) @
           (wq.float().view(N // 128, 128, K // 128, 128) * sb[:, None, :, None]).view(N, K).t()).t()
    a_opts = {"wa_NK": sb.contiguous(), "wa_NK_kmajor": sb.t().contiguous().t(), "wa_KN": sb.t().contiguous(),
              "wa_KN_view": sb.t()}
    b_opts = {"xb_KM": sa.t().contiguous(), "xb_MK_view": sa.t().contiguous().t().t(), "xb_MK": sa.contiguous(),
              "xb_MK_mmajor": sa.t().contiguous().t()}
    good = None
    for (an, a), (bn, b) in itertools.product(a_opts.items(), b_opts.items()):
        try:
            out = torch._scaled_mm(wq, xq.t(), a, b, out_dtype=torch.bfloat16)
            err = round(float((out.float() - ref).norm() / ref.norm()), 5)
            if err < 1e-2 and good is None:
                good = (an, bn)
        except Exception as e:  # noqa: BLE001
            err = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
        doc["transposed_layouts"][f"{an}+{bn}"] = err
        print("transposed", an, bn, err, flush=True)
    if good:
        K, N = 7168, 4096
        wq, sb = quant_blocks(torch.randn(N, K, device=dev) * 0.02)
        for M in (128, 256, 384, 448, 480, 496, 512, 528, 544, 576, 608, 640, 768, 1024):
            xq, sa = quant_groups(torch.randn(M, K, device=dev))
            a = dict(zip(a_opts, (sb.contiguous(), sb.t().contiguous().t(), sb.t().contiguous(), sb.t())))[good[0]]
            b = dict(zip(b_opts, (sa.t().contiguous(), sa.t().contiguous().t().t(), sa.contiguous(),
                                  sa.t().contiguous().t())))[good[1]]
            out = torch.empty(N, M, device=dev, dtype=torch.bfloat16)
            t = time_ms(lambda: torch.ops.aten._scaled_mm.out(wq, xq.t(), a, b, out_dtype=torch.bfloat16, out=out),
                        reps=30)
            doc["transposed_rows"][M] = round(t * 1e3, 2)
            print("transposed rows", M, round(t * 1e3, 2), "us", flush=True)
    # out^T written straight into GEMM1's row layout: out = h[rows].t() (column-major [N, m])
    K, N = 7168, 4096
    wq, sb = quant_blocks(torch.randn(N, K, device=dev) * 0.02)
    doc["transposed_into_rows"] = {}
    for M in (16, 496, 512, 528, 576, 640):
        xq, sa = quant_groups(torch.randn(M, K, device=dev))
        h = torch.zeros(M + 32, N, device=dev, dtype=torch.bfloat16)
        try:
            torch.ops.aten._scaled_mm.out(wq, xq.t(), sb, sa.t().contiguous(), out_dtype=torch.bfloat16,
                                          out=h[16:16 + M].t())
            ref = (xq.float().view(M, K // 128, 128) * sa[..., None]).view(M, K) @ \
                  (wq.float().view(N // 128, 128, K // 128, 128) * sb[:, None, :, None]).view(N, K).t()
            err = round(float((h[16:16 + M].float() - ref).norm() / ref.norm()), 5)
            t = time_ms(lambda: torch.ops.aten._scaled_mm.out(wq, xq.t(), sb, sa.t().contiguous(),
                                                              out_dtype=torch.bfloat16, out=h[16:16 + M].t()), reps=30)
            res = {"err": err, "us": round(t * 1e3, 2), "untouched": bool((h[:16] == 0).all() and (h[16 + M:] == 0).all())}
        except Exception as e:  # noqa: BLE001
            res = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
        doc["transposed_into_rows"][M] = res
        print("transposed into rows", M, res, flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

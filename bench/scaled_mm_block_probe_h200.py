"""Probe: torch._scaled_mm with DeepSeek-style block scales (1 x 128 activation groups, 128 x 128
weight blocks; cuBLAS from CUDA 12.9 on Hopper) at DeepSeek-V3's expert shapes.

Finds the scale layouts torch accepts (checked against the dequantized product), then times one
GEMM at rows an expert M (TFLOP/s) for GEMM1 (N = 2I = 4096, K = H = 7168) and GEMM2 (N = 7168,
K = I = 2048), bf16 torch.mm beside it, and a loop of one GEMM per expert (256 experts, the rows
of uniform routing at M = 16384 tokens, k = 8: 512 an expert) as a layer would launch it.

    python bench/scaled_mm_block_probe_h200.py --out $OUT/h200-scaled-mm-block-probe.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys

import torch

FP8 = torch.float8_e4m3fn


def quant_blocks(w: torch.Tensor):
    """w [N, K] -> fp8 [N, K], scales [N/128, K/128] (w = q * s per 128 x 128 block)."""
    N, K = w.shape
    b = w.view(N // 128, 128, K // 128, 128)
    s = b.abs().amax(dim=(1, 3)).clamp_min(1e-12) / 448.0
    q = (b / s[:, None, :, None]).to(FP8).view(N, K)
    return q, s


def quant_groups(x: torch.Tensor):
    """x [M, K] -> fp8 [M, K], scales [M, K/128]."""
    M, K = x.shape
    g = x.view(M, K // 128, 128)
    s = g.abs().amax(dim=2).clamp_min(1e-12) / 448.0
    return (g / s[..., None]).to(FP8).view(M, K), s


def layouts(sa, sb):
    """Candidate (name, scale_a, scale_b) layouts."""
    a_opts = {"a_rowmajor": sa.contiguous(), "a_mmajor": sa.t().contiguous().t()}
    b_opts = {"b_NK": sb.contiguous(), "b_KN": sb.t().contiguous(), "b_KN_view": sb.t(),
              "b_NK_kmajor": sb.t().contiguous().t()}
    for (an, a), (bn, b) in itertools.product(a_opts.items(), b_opts.items()):
        yield f"{an}+{bn}", a, b


def time_ms(fn, reps=20):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    p.add_argument("--sweep", action="store_true", help="also: few rows, rows around 512, host time a launch")
    args = p.parse_args(argv)
    dev = "cuda"
    doc = {"torch": torch.__version__, "cuda": torch.version.cuda, "device": torch.cuda.get_device_name(),
           "cublas": getattr(torch._C, "_cuda_getCompiledVersion", lambda: None)(), "layouts": {}, "gemm": [],
           "loop": []}
    print(doc, flush=True)
    torch.manual_seed(0)
    M, N, K = 256, 512, 1024
    x, w = torch.randn(M, K, device=dev), torch.randn(N, K, device=dev) * 0.05
    xq, sa = quant_groups(x)
    wq, sb = quant_blocks(w)
    ref = (xq.float().view(M, K // 128, 128) * sa[..., None]).view(M, K) @ \
          (wq.float().view(N // 128, 128, K // 128, 128) * sb[:, None, :, None]).view(N, K).t()
    good = None
    for name, a, b in layouts(sa, sb):
        try:
            out = torch._scaled_mm(xq, wq.t(), a, b, out_dtype=torch.bfloat16)
            err = float((out.float() - ref).norm() / ref.norm())
            doc["layouts"][name] = round(err, 6)
            if err < 1e-2 and good is None:
                good = name
        except Exception as e:  # noqa: BLE001 (a probe: report what torch says)
            doc["layouts"][name] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        print(name, doc["layouts"][name], flush=True)
    doc["accepted"] = good
    if good is None:
        print("no layout accepted", flush=True)
    else:
        def scales_for(sa_, sb_):
            return next((a, b) for n, a, b in layouts(sa_, sb_) if n == good)
        for (gname, N, K), rows in itertools.product((("gemm1", 4096, 7168), ("gemm2", 7168, 2048)),
                                                     (128, 256, 512, 1024, 2048, 4096, 16384)):
            x = torch.randn(rows, K, device=dev)
            w = torch.randn(N, K, device=dev) * 0.02
            xq, sa_ = quant_groups(x)
            wq, sb_ = quant_blocks(w)
            a, b = scales_for(sa_, sb_)
            t8 = time_ms(lambda: torch._scaled_mm(xq, wq.t(), a, b, out_dtype=torch.bfloat16))
            xb, wb = x.bfloat16(), w.bfloat16()
            t16 = time_ms(lambda: torch.mm(xb, wb.t()))
            flop = 2 * rows * N * K
            row = {"gemm": gname, "M": rows, "N": N, "K": K, "fp8_block_ms": round(t8, 4),
                   "fp8_block_TFLOPs": round(flop / t8 / 1e9, 1), "bf16_ms": round(t16, 4),
                   "bf16_TFLOPs": round(flop / t16 / 1e9, 1)}
            doc["gemm"].append(row)
            print(row, flush=True)
        # one GEMM per expert, as a layer launches them (no graph), 256 experts x 512 rows
        for gname, N, K in (("gemm1", 4096, 7168), ("gemm2", 7168, 2048)):
            E, rows = 256, 512
            xs = [quant_groups(torch.randn(rows, K, device=dev)) for _ in range(4)]
            ws = [quant_blocks(torch.randn(N, K, device=dev) * 0.02) for _ in range(E)]
            args_ = [(xs[e % 4][0], ws[e][0].t(), *scales_for(xs[e % 4][1], ws[e][1])) for e in range(E)]

            def loop():
                for xq_, wt, a, b in args_:
                    torch._scaled_mm(xq_, wt, a, b, out_dtype=torch.bfloat16)

            t = time_ms(loop, reps=5)
            flop = 2 * E * rows * N * K
            row = {"gemm": gname, "experts": E, "rows_each": rows, "ms": round(t, 3), "TFLOPs": round(flop / t / 1e9, 1)}
            doc["loop"].append(row)
            print(row, flush=True)
    if good is not None and args.sweep:
        sweep(doc, good, dev)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


def sweep(doc: dict, good: str, dev: str) -> None:
    """Few rows with the M-major scales as a slice at an offset of a larger buffer (as the layer
    passes them), checked; GEMM1's time by rows around 512; the host time of a launch."""
    import time  # noqa: PLC0415

    K, N, G = 7168, 4096, 7168 // 128
    w = torch.randn(N, K, device=dev) * 0.02
    wq, sb = quant_blocks(w)
    wd = (wq.float().view(N // 128, 128, K // 128, 128) * sb[:, None, :, None]).view(N, K)
    doc["small"] = {}
    for M in (1, 2, 3, 4, 5, 8, 12, 16, 17, 32, 64, 100, 128, 200):
        m = (M + 3) // 4 * 4
        x = torch.zeros(m, K, device=dev)
        x[:M] = torch.randn(M, K, device=dev)
        xq, sa = quant_groups(x)
        buf = torch.zeros(64 * G + m * G, device=dev)
        buf[64 * G:].view(G, m).copy_(sa.t())
        a_s = buf[64 * G:].view(G, m).t()
        out = torch.empty(m + 8, N, device=dev, dtype=torch.bfloat16)
        try:
            torch.ops.aten._scaled_mm.out(xq, wq.t(), a_s, sb.t(), out_dtype=torch.bfloat16, out=out[4:4 + m])
            ref = (xq.float().view(m, G, 128) * sa[..., None]).view(m, K)[:M] @ wd.t()
            err = float((out[4:4 + M].float() - ref).norm() / ref.norm())
            doc["small"][M] = round(err, 5)
        except Exception as e:  # noqa: BLE001
            doc["small"][M] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
        print("small", M, doc["small"][M], flush=True)
    doc["rows_sweep"] = {}
    for M in list(range(448, 580, 4)) + [496, 512, 528, 544, 576, 640]:
        xq, sa = quant_groups(torch.randn(M, K, device=dev))
        a_s = sa.t().contiguous().t()
        out = torch.empty(M, N, device=dev, dtype=torch.bfloat16)
        fn = lambda: torch.ops.aten._scaled_mm.out(xq, wq.t(), a_s, sb.t(), out_dtype=torch.bfloat16, out=out)  # noqa: E731
        doc["rows_sweep"][M] = round(time_ms(fn, reps=30) * 1e3, 2)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(50):
            fn()
        host = (time.perf_counter() - t0) / 50 * 1e6
        torch.cuda.synchronize()
        print("rows", M, doc["rows_sweep"][M], "us; host", round(host, 1), "us a launch", flush=True)
        doc.setdefault("host_us_per_launch", {})[M] = round(host, 1)


if __name__ == "__main__":
    sys.exit(main())

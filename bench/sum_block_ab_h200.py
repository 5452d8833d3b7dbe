"""Column blocks and pipelining of the sum over k at decode sizes, in whole calls, on one H200.

The sum over k (triton_moe.sum_k_kernel on the bf16 paths, triton_quant_rows.sum_slots_kernel on
the quantized one) reads a token's k rows of GEMM2's output back. Up to 256 tokens it runs a
program per token and column block; this script times whole calls through the shipped tables
with other column blocks (BN) and slot loads in flight (STAGES), A/B in one process (CUDA graphs
of 8 calls with distinct routing, interleaved). The sum's order does not depend on the blocks,
so every variant must give the shipped bits (checked on every routing set).

    PYTHONPATH=src python bench/sum_block_ab_h200.py [--out FILE] [--rounds 3]

`--device cpu` is a dry run under TRITON_INTERPRET=1 on a tiny shape (wall-clock times).
"""

import statistics

import torch
import triton

from moekit.benchmarks.gpu import (AB_TIMING, GPU_SHAPES, _quant_call, ab_arg_parser, ab_device, ab_time_us,
                                  quantized_weights, routing_sets, write_ab_result)
from moekit.kernels import launch_quant, triton_moe, triton_prefill
from moekit.kernels.launch import fused_moe

BF16_POINTS = (("qwen3-30b-a3b", (16, 64, 256)), ("olmoe-1b-7b", (16, 64, 256)), ("gpt-oss-20b", (16, 256)),
               ("mixtral-8x7b", (16,)))
FP8_POINTS = (("qwen3-30b-a3b", (16, 64, 256)), ("mixtral-8x7b", (16, 64)))
BF16_VARIANTS = ((1024, 4), (512, 4), (256, 4), (256, None), (128, 4), (512, None))
QUANT_VARIANTS = ((1024, None), (512, None), (256, None), (128, None), (256, 3), (512, 3))


def _bf16_sum(bn, stages):
    def sum_over_k(y, topk_ids, emap, has_map, out_dtype):
        T, k = topk_ids.shape
        H = y.shape[1]
        out = torch.empty(T, H, dtype=out_dtype, device=y.device)
        triton_moe.sum_k_kernel[(T, triton.cdiv(H, bn))](y, out, topk_ids, emap, T, H, k, y.stride(0), out.stride(0),
                                                         BT=1, BN=bn, HAS_MAP=has_map, STAGES=stages, num_warps=4)
        return out
    return sum_over_k


def _patched(run, bf16=None, quant=None):
    def fn(*s):
        saved = triton_moe.sum_over_k, triton_prefill.sum_over_k, launch_quant._sum_block, launch_quant._sum_stages
        if bf16 is not None:
            triton_moe.sum_over_k = triton_prefill.sum_over_k = _bf16_sum(*bf16)
        if quant is not None:
            launch_quant._sum_block = lambda T, H: quant[0]
            launch_quant._sum_stages = lambda T: quant[1]
        try:
            return run(*s)
        finally:
            triton_moe.sum_over_k, triton_prefill.sum_over_k, launch_quant._sum_block, launch_quant._sum_stages = saved
    return fn


def _point(label, fns, sets, rounds, cuda):
    ref = [fns["shipped"](*s) for s in sets]
    same = {n: all(torch.equal(f(*s), r) for s, r in zip(sets, ref)) for n, f in fns.items()}
    times = {n: [] for n in fns}
    for _ in range(rounds):
        for n, f in fns.items():
            times[n].append(ab_time_us(f, sets, cuda, replays=10))
    med = {n: statistics.median(t) for n, t in times.items()}
    best = min(med, key=med.get)
    print(f"{label:30s} " + " ".join(f"{n} {v:.1f}" for n, v in med.items())
          + f"  best {best} x{med['shipped'] / med[best]:.3f}", flush=True)
    return {"point": label, "bit_identical": same, "us": med, "rounds_us": times, "best": best,
            "best_speedup": med["shipped"] / med[best]}


def main() -> None:
    p = ab_arg_parser(__doc__, "h200-sum-block-ab.json")
    args = p.parse_args()
    cuda, dev = ab_device(args)
    shapes = {s[0]: s for s in GPU_SHAPES} if cuda else {"tiny": ("tiny", 8, 2, 256, 128)}
    dtype = torch.bfloat16 if cuda else torch.float32
    rows = []
    gen = torch.Generator(device=dev).manual_seed(0)
    for shape, ms in (BF16_POINTS if cuda else (("tiny", (5,)),)):
        _, E, k, H, I = shapes[shape]
        w13 = (torch.randn(E, 2 * I, H, device=dev, generator=gen) * H ** -0.5).to(dtype)
        w2 = (torch.randn(E, H, I, device=dev, generator=gen) * I ** -0.5).to(dtype)
        run = lambda x, w, ids: fused_moe(x, w13, w2, None, None, w, ids, None, "silu", direct=False,  # noqa: E731
                                          out_dtype=x.dtype)
        for M in ms:
            fns = {"shipped": run}
            fns.update({f"bn{bn}_s{st}": _patched(run, bf16=(bn, st)) for bn, st in BF16_VARIANTS})
            rows.append(_point(f"{shape} bf16 M={M}", fns, routing_sets(M, E, k, H, 8 if cuda else 2, dtype, dev),
                               args.rounds, cuda))
        del w13, w2
    for shape, ms in (FP8_POINTS if cuda else (("tiny", (5,)),)):
        _, E, k, H, I = shapes[shape]
        wts = quantized_weights("fp8_w8a8", E, H, I, True, dev)
        run = lambda x, w, ids: _quant_call(wts, x, w, ids)  # noqa: E731
        for M in ms:
            fns = {"shipped": run}
            fns.update({f"bn{bn}_s{st}": _patched(run, quant=(bn, st)) for bn, st in QUANT_VARIANTS})
            sets = routing_sets(M, E, k, H, 8 if cuda else 2, torch.bfloat16 if cuda else torch.float16, dev)
            rows.append(_point(f"{shape} fp8 static M={M}", fns, sets, args.rounds, cuda))
        del wts
    write_ab_result(args.out, "sum-block-ab", cuda, AB_TIMING, rows=rows)


if __name__ == "__main__":
    main()

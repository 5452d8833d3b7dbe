"""The one-launch alignment with a program per expert against the paths it replaced, on one H200.

Replaced (moekit 760dac0): up to 512 assignments one program sorted them all (a bitonic sort of
bin * n + index keys), above that the two chunked launches. Now up to triton_align.SMALL (2048)
assignments one launch of E programs does it (triton_align.align_expert_kernel), and the
quantized path's fused launch (x quantized beside the alignment) runs the same programs. The
replaced kernels are kept here only to be measured. Two parts, one process:
1. alignment alone at decode points: both paths checked against a stable sort on the host, then
   timed in CUDA graphs of 8 alignments with distinct routing, interleaved;
2. whole calls through the shipped tables (bf16, fp8 with static scales, whose alignment
   launch also quantizes x, and int4 weights), A (replaced) and B (current): outputs compared bit for bit, then
   timed as the decode bench does (CUDA graphs of 8 calls with distinct routing), interleaved.

    PYTHONPATH=src python bench/align_expert_ab_h200.py [--out FILE] [--rounds 3]

`--device cpu` is a dry run under TRITON_INTERPRET=1 on tiny shapes (wall-clock times).
"""


import torch
import triton
import triton.language as tl

from align_ab_h200 import _interleaved, expected_rows
from moekit.benchmarks.gpu import (GPU_SHAPES, _quant_call, ab_arg_parser, ab_device, quantized_weights, routing_sets,
                                  write_ab_result)
from moekit.kernels import launch, launch_quant
from moekit.kernels import triton_align as align
from moekit.kernels import triton_quant_rows as qr
from moekit.kernels.launch import alignment_buffers, fused_moe, moe_align
from moekit.kernels.quant_rows import _chunk_buffers, _quant_args, place_chunks
from moekit.kernels.triton_moe import pow2

OLD_SMALL = 512


@triton.jit(do_not_specialize=["TK"])
def _old_small(ids_ptr, map_ptr, sorted_ptr, expert_end_ptr, TK, E, BM: tl.constexpr, N: tl.constexpr,
               E_PAD: tl.constexpr, HAS_MAP: tl.constexpr):
    """The replaced one-program alignment (a sort of all keys, a histogram, rows at start + rank)."""
    bins = align._bins(ids_ptr, map_ptr, tl.arange(0, N), TK, E_PAD, HAS_MAP)
    counts = tl.histogram(bins, E_PAD)
    starts, local, padded = align._extents(counts, E, BM, E_PAD)
    align._write_rows(sorted_ptr, align._chunk_keys(bins, N), starts, counts, 0, E, N)
    align._write_ends(sorted_ptr, expert_end_ptr, starts, local, padded, TK, E, BM, E_PAD)


@triton.jit(do_not_specialize=["TK"])
def _old_small_kernel(ids_ptr, map_ptr, sorted_ptr, expert_end_ptr, TK, E, BM: tl.constexpr, N: tl.constexpr,
                      E_PAD: tl.constexpr, HAS_MAP: tl.constexpr):
    _old_small(ids_ptr, map_ptr, sorted_ptr, expert_end_ptr, TK, E, BM, N, E_PAD, HAS_MAP)


@triton.jit(do_not_specialize=["TK", "top_k"])
def _old_align_quant_kernel(
    ids_ptr, map_ptr, sorted_ptr, expert_end_ptr, hist_ptr, keys_ptr, x_ptr, q_ptr, s_ptr, topk_w_ptr, src_ptr,
    TK, E, K, top_k, stride_x, stride_q, stride_s, NA, NCH,
    BM: tl.constexpr, N: tl.constexpr, E_PAD: tl.constexpr, HAS_MAP: tl.constexpr, SMALL: tl.constexpr,
    BC: tl.constexpr, G: tl.constexpr, GRAN: tl.constexpr, QMAX: tl.constexpr, INT8: tl.constexpr,
    ON_INPUT: tl.constexpr, PDL: tl.constexpr,
):
    """triton_quant_rows.align_quant_kernel as it was: one aligning program on the small path."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    pid = tl.program_id(0)
    if pid < NA:
        if SMALL:
            _old_small(ids_ptr, map_ptr, sorted_ptr, expert_end_ptr, TK, E, BM, N, E_PAD, HAS_MAP)
        else:
            align.align_chunk_kernel(ids_ptr, map_ptr, hist_ptr, keys_ptr, TK, N, E_PAD, HAS_MAP)
    else:
        j = pid - NA
        qr._quant_chunk(x_ptr, q_ptr, s_ptr, topk_w_ptr, src_ptr, ids_ptr, map_ptr, j // NCH, j // NCH + 1, j % NCH,
                        K, top_k, stride_x, stride_q, stride_s, BC, G, GRAN, QMAX, INT8, ON_INPUT, HAS_MAP, 1)


def old_align(topk_ids, expert_map, num_experts, block_m, small_max=None, chunk=None):
    TK, E = topk_ids.numel(), num_experts
    if TK > OLD_SMALL:
        return moe_align(topk_ids, expert_map, E, block_m, small_max=0, chunk=chunk)
    al, e_pad = alignment_buffers(topk_ids, E, block_m)
    emap = expert_map if expert_map is not None else topk_ids
    _old_small_kernel[(1,)](topk_ids, emap, al.sorted_ids, al.expert_end, TK, E, BM=block_m, N=pow2(TK), E_PAD=e_pad,
                            HAS_MAP=expert_map is not None, num_warps=4)
    return al


def old_align_and_quantize(topk_ids, expert_map, num_experts, block_m, x, q, s, modes, gran, group, topk_weights,
                           small_max, pdl=False, src=None):
    TK, E, dev = topk_ids.numel(), num_experts, topk_ids.device
    al, e_pad = alignment_buffers(topk_ids, E, block_m)
    emap = expert_map if expert_map is not None else topk_ids
    small = TK <= OLD_SMALL
    n = pow2(TK) if small else align.chunk_size(TK)
    hist, keys = (al.expert_end, al.expert_end) if small else _chunk_buffers(TK, n, e_pad, dev)
    n_align = 1 if small else hist.shape[0]
    (xx, qq, ss, w, sr, _, _), sizes, meta, n_chunks = _quant_args(x, q, s, modes, gran, group, topk_weights,
                                                                   topk_ids, expert_map, src)
    _old_align_quant_kernel[(n_align + x.shape[0] * n_chunks,)](
        topk_ids, emap, al.sorted_ids, al.expert_end, hist, keys, xx, qq, ss, w, sr, TK, E, *sizes, n_align,
        n_chunks, BM=block_m, N=n, E_PAD=e_pad, SMALL=small, **meta, PDL=pdl and small, num_warps=4)
    if not small:
        place_chunks(al, hist, keys, TK, E, n, e_pad)
    return al


ALIGN_POINTS = (("qwen3", 128, 8, 16, 16), ("qwen3", 128, 8, 64, 16), ("qwen3", 128, 8, 256, 32),
                ("olmoe", 64, 8, 16, 16), ("olmoe", 64, 8, 64, 16), ("olmoe", 64, 8, 256, 64),
                ("deepseek-v3", 256, 8, 16, 16), ("deepseek-v3", 256, 8, 64, 16), ("deepseek-v3", 256, 8, 256, 64),
                ("mixtral", 8, 2, 256, 64), ("gpt-oss", 32, 4, 256, 64))
CALL_POINTS = (("qwen3-30b-a3b", (16, 64, 256)), ("olmoe-1b-7b", (16, 64, 256)), ("deepseek-v3", (16, 64)),
               ("mixtral-8x7b", (256,)), ("gpt-oss-20b", (64, 256)))
QUANT_POINTS = (("qwen3-30b-a3b", "fp8_w8a8", (1, 16, 64, 256)), ("mixtral-8x7b", "fp8_w8a8", (1, 16, 64)),
                ("qwen3-30b-a3b", "int4_w4a16", (1, 16)))


def alignment_part(cuda, dev, rounds):
    rows = []
    points = ALIGN_POINTS if cuda else (("tiny", 6, 2, 30, 16), ("tiny", 40, 4, 300, 32))
    for label, E, k, M, bm in points:
        sets = [(torch.rand(M, E, device=dev).topk(k, dim=1).indices.to(torch.int32).contiguous(),) for _ in range(8)]
        fns = {"A_replaced": lambda ids: old_align(ids, None, E, bm), "B_per_expert": lambda ids: moe_align(ids, None, E, bm)}
        ok = {}
        for name, fn in fns.items():
            good = True
            for (ids,) in sets[:3]:
                al = fn(ids)
                want, ends = expected_rows(ids, E, bm)
                good &= al.expert_end.tolist() == ends and al.sorted_ids[:len(want)].tolist() == want
            ok[name] = bool(good)
        med, all_t = _interleaved(fns, sets, rounds, cuda)
        row = {"point": f"{label} E={E} k={k} M={M} BM={bm}", "assignments": M * k, "correct": ok, "us": med,
               "rounds_us": all_t}
        print(row["point"], "correct", ok, {n: round(v, 2) for n, v in med.items()}, flush=True)
        rows.append(row)
    return rows


def _call_ab(label, run, sets, rounds, cuda):
    def replaced(*s):
        saved = launch.moe_align, launch_quant.moe_align, launch_quant.align_and_quantize
        launch.moe_align = launch_quant.moe_align = old_align
        launch_quant.align_and_quantize = old_align_and_quantize
        try:
            return run(*s)
        finally:
            launch.moe_align, launch_quant.moe_align, launch_quant.align_and_quantize = saved

    same = [bool(torch.equal(replaced(*s), run(*s))) for s in sets]
    med, all_t = _interleaved({"A_replaced": replaced, "B_per_expert": run}, sets, rounds, cuda)
    row = {"point": label, "bit_identical": same, "us": med, "rounds_us": all_t,
           "speedup": med["A_replaced"] / med["B_per_expert"]}
    print(f"{label:32s} same {all(same)} A {med['A_replaced']:9.1f} B {med['B_per_expert']:9.1f} "
          f"x{row['speedup']:.3f}", flush=True)
    return row


def call_part(cuda, dev, rounds):
    rows = []
    dtype = torch.bfloat16 if cuda else torch.float32
    shapes = {s[0]: s for s in GPU_SHAPES} if cuda else {"tiny": ("tiny", 8, 2, 64, 32)}
    points = CALL_POINTS if cuda else (("tiny", (5, 300)),)
    gen = torch.Generator(device=dev).manual_seed(0)
    for shape, ms in points:
        _, E, k, H, I = shapes[shape]
        w13 = (torch.randn(E, 2 * I, H, device=dev, generator=gen) * H ** -0.5).to(dtype)
        w2 = (torch.randn(E, H, I, device=dev, generator=gen) * I ** -0.5).to(dtype)
        for M in ms:
            sets = routing_sets(M, E, k, H, 8 if cuda else 2, dtype, dev)
            run = lambda x, w, ids: fused_moe(x, w13, w2, None, None, w, ids, None, "silu", direct=False,  # noqa: E731
                                              out_dtype=x.dtype)
            rows.append(_call_ab(f"{shape} bf16 M={M}", run, sets, rounds, cuda))
        del w13, w2
    quant_points = QUANT_POINTS if cuda else (("tiny", "fp8_w8a8", (5, 300)),)
    for shape, scheme, ms in quant_points:
        _, E, k, H, I = shapes[shape]
        if not cuda:
            H, I = 256, 128
        static = scheme == "fp8_w8a8"
        wts = quantized_weights(scheme, E, H, I, static, dev)
        for M in ms:
            sets = routing_sets(M, E, k, H, 8 if cuda else 2, torch.bfloat16 if cuda else torch.float16, dev)
            rows.append(_call_ab(f"{shape} {scheme}{' static' if static else ''} M={M}",
                                 lambda x, w, ids: _quant_call(wts, x, w, ids), sets, rounds, cuda))
        del wts
    return rows


def main() -> None:
    p = ab_arg_parser(__doc__, "h200-align-per-expert.json")
    p.add_argument("--calls-only", action="store_true")
    args = p.parse_args()
    cuda, dev = ab_device(args)
    write_ab_result(args.out, "alignment-per-expert-ab", cuda,
                    "CUDA graphs of 8 alignments / 8 calls with distinct routing, 10 replays, median us per call; A and "
                    "B interleaved, median of the rounds",
                    alignment=[] if args.calls_only else alignment_part(cuda, dev, args.rounds),
                    calls=call_part(cuda, dev, args.rounds))


if __name__ == "__main__":
    main()

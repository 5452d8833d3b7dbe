"""The chunked alignment (two launches, no atomics) against the one it replaced, on one H200.

The replaced path (a memset of the counts, histograms added with atomics, a one-program scan,
rows claimed with an atomic increment per assignment; moekit 89a94e9) is kept here only to be
measured. Two parts, one process:
1. alignment alone: every (E, k, M, BM) point, both paths and every chunk size, checked (the
   new rows against a stable sort on the host; the old ones as a set per expert), then timed
   in CUDA graphs of 8 alignments with distinct routing, A and B interleaved;
2. whole calls through the shipped tables (moe_align swapped for the old one in A): the
   outputs compared, then timed as bench/knob_ab_h200.py does.

    PYTHONPATH=src python bench/align_ab_h200.py [--out FILE] [--rounds 3]

`--device cpu` is a dry run under TRITON_INTERPRET=1 on tiny shapes (wall-clock times).
"""

import statistics

import torch
import triton
import triton.language as tl

from moekit.benchmarks.gpu import (GPU_SHAPES, _quant_call, ab_arg_parser, ab_device, ab_time_us, quantized_weights,
                                  routing_sets, write_ab_result)
from moekit.kernels import launch, launch_quant
from moekit.kernels import triton_align as align
from moekit.kernels.launch import alignment_buffers, fused_moe, moe_align
from moekit.kernels.tuning import get_config


@triton.jit(do_not_specialize=["TK"])
def _old_count_kernel(ids_ptr, counts_ptr, TK, N: tl.constexpr, E_PAD: tl.constexpr):
    c = tl.program_id(0)
    offs = c * N + tl.arange(0, N)
    lid = tl.load(ids_ptr + offs, mask=offs < TK, other=-1)
    bins = tl.where(lid >= 0, lid, E_PAD - 1)
    tl.atomic_add(counts_ptr + tl.arange(0, E_PAD), tl.histogram(bins, E_PAD))


@triton.jit(do_not_specialize=["TK"])
def _old_scan_kernel(counts_ptr, cursor_ptr, expert_end_ptr, sorted_ptr, E, TK, BM: tl.constexpr,
                     E_PAD: tl.constexpr):
    experts = tl.arange(0, E_PAD)
    local = tl.where(experts < E, tl.load(counts_ptr + experts), 0)
    padded = (local + BM - 1) // BM * BM
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    tl.store(cursor_ptr + experts, starts)
    tl.store(expert_end_ptr + experts, ends, mask=experts < E)
    for p0 in tl.static_range(0, BM, 16):
        col = p0 + tl.arange(0, 16)
        tl.store(sorted_ptr + (starts + local)[:, None] + col[None, :], tl.zeros([E_PAD, 16], tl.int32) + TK,
                 mask=col[None, :] < (padded - local)[:, None])


@triton.jit(do_not_specialize=["TK"])
def _old_scatter_kernel(ids_ptr, cursor_ptr, sorted_ptr, TK, E, N: tl.constexpr, E_PAD: tl.constexpr):
    offs = tl.program_id(0) * N + tl.arange(0, N)
    lid = tl.load(ids_ptr + offs, mask=offs < TK, other=-1)
    bins = tl.where(lid >= 0, lid, E_PAD - 1)
    rows = tl.atomic_add(cursor_ptr + bins, 1, mask=bins < E)
    tl.store(sorted_ptr + rows, offs, mask=bins < E)


def old_align(topk_ids, expert_map, num_experts, block_m, small_max=launch.ALIGN_SMALL_MAX, chunk=None):
    """The replaced alignment (no expert map: the points here have none)."""
    assert expert_map is None
    TK, E = topk_ids.numel(), num_experts
    if TK <= small_max:
        return moe_align(topk_ids, None, E, block_m, small_max=small_max)
    al, e_pad = alignment_buffers(topk_ids, E, block_m)
    n = 1024
    nc = triton.cdiv(TK, n)
    counts = torch.zeros(e_pad, dtype=torch.int32, device=topk_ids.device)
    cursor = torch.empty(e_pad, dtype=torch.int32, device=topk_ids.device)
    _old_count_kernel[(nc,)](topk_ids, counts, TK, N=n, E_PAD=e_pad, num_warps=4)
    _old_scan_kernel[(1,)](counts, cursor, al.expert_end, al.sorted_ids, E, TK, BM=block_m, E_PAD=e_pad, num_warps=4)
    _old_scatter_kernel[(nc,)](topk_ids, cursor, al.sorted_ids, TK, E, N=n, E_PAD=e_pad, num_warps=4)
    return al


def expected_rows(ids, E, bm):
    flat = ids.reshape(-1).long().cpu()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=E)
    rows, ends = [], []
    pos = 0
    for e in range(E):
        mine = order[pos:pos + counts[e]].tolist()
        pos += int(counts[e])
        padded = -(-len(mine) // bm) * bm
        rows += mine + [flat.numel()] * (padded - len(mine))
        ends.append(len(rows))
    return rows, ends




def _interleaved(fns, sets, rounds, cuda):
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            times[name].append(ab_time_us(fn, sets, cuda, replays=10))
    return {name: statistics.median(t) for name, t in times.items()}, times


ALIGN_POINTS = (  # (label, E, k, M, BM)
    ("olmoe", 64, 8, 256, 64), ("qwen3", 128, 8, 256, 32), ("olmoe", 64, 8, 1024, 64), ("qwen3", 128, 8, 1024, 64),
    ("mixtral", 8, 2, 4096, 64), ("olmoe", 64, 8, 4096, 64), ("qwen3", 128, 8, 4096, 64),
    ("deepseek-v3", 256, 8, 4096, 64), ("qwen3", 128, 8, 16384, 64), ("deepseek-v3", 256, 8, 16384, 64),
)
CALL_POINTS = (("olmoe-1b-7b", 256), ("olmoe-1b-7b", 1024), ("olmoe-1b-7b", 4096), ("qwen3-30b-a3b", 1024),
               ("qwen3-30b-a3b", 4096), ("qwen3-30b-a3b", 16384), ("mixtral-8x7b", 1024), ("gpt-oss-20b", 4096),
               ("deepseek-v3", 4096))
FP8_POINTS = (("qwen3-30b-a3b", 4096), ("qwen3-30b-a3b", 16384), ("mixtral-8x7b", 1024))


def alignment_part(cuda, dev, rounds):
    rows = []
    points = ALIGN_POINTS if cuda else (("tiny", 6, 2, 300, 16), ("tiny", 40, 4, 300, 32))
    for label, E, k, M, bm in points:
        sets = [(torch.rand(M, E, device=dev).topk(k, dim=1).indices.to(torch.int32).contiguous(),)
                for _ in range(8)]
        chunks = [c for c in (256, 512, 1024, 2048) if c <= max(256, triton.next_power_of_2(M * k))] if cuda \
            else [16, 64]
        fns = {"old": lambda ids: old_align(ids, None, E, bm)}
        for c in chunks:
            fns[f"new_{c}"] = lambda ids, c=c: moe_align(ids, None, E, bm, chunk=c)
        fns["new_default"] = lambda ids: moe_align(ids, None, E, bm)
        ok = {}
        for name, fn in fns.items():
            good = True
            for (ids,) in sets[:3]:
                al = fn(ids)
                want, ends = expected_rows(ids, E, bm)
                got = al.sorted_ids[:len(want)].tolist()
                good &= al.expert_end.tolist() == ends
                if name == "old":
                    good &= all(sorted(got[lo:hi]) == sorted(want[lo:hi]) for lo, hi in zip([0] + ends[:-1], ends))
                else:
                    good &= got == want
            ok[name] = bool(good)
        med, all_t = _interleaved(fns, sets, rounds, cuda)
        row = {"point": f"{label} E={E} k={k} M={M} BM={bm}", "assignments": M * k, "default_chunk": align.chunk_size(M * k),
               "correct": ok, "us": med, "rounds_us": all_t}
        print(row["point"], "correct", ok, {n: round(v, 2) for n, v in med.items()}, flush=True)
        rows.append(row)
    return rows


def _call_ab(label, run, sets, rounds, cuda):
    """A: moe_align swapped for the old alignment; B: as shipped."""
    def with_old(*s):
        launch.moe_align, launch_quant.moe_align = old_align, old_align
        try:
            return run(*s)
        finally:
            launch.moe_align, launch_quant.moe_align = moe_align, moe_align

    same = [bool(torch.equal(with_old(*s), run(*s))) for s in sets]
    diff = max(float((with_old(*s).float() - run(*s).float()).abs().max()) for s in sets)
    med, all_t = _interleaved({"A_old": with_old, "B_new": run}, sets, rounds, cuda)
    row = {"point": label, "bit_identical": same, "max_abs_diff": diff, "us": med, "rounds_us": all_t,
           "speedup": med["A_old"] / med["B_new"]}
    print(f"{label:30s} same {same} A {med['A_old']:9.1f} B {med['B_new']:9.1f} x{row['speedup']:.3f}", flush=True)
    return row


def call_part(cuda, dev, rounds):
    rows = []
    dtype = torch.bfloat16 if cuda else torch.float32
    shapes = {s[0]: s for s in GPU_SHAPES} if cuda else {"tiny": ("tiny", 8, 2, 64, 32)}
    points = CALL_POINTS if cuda else (("tiny", 300),)
    gen = torch.Generator(device=dev).manual_seed(0)
    for shape in dict.fromkeys(p[0] for p in points):
        _, E, k, H, I = shapes[shape]
        w13 = (torch.randn(E, 2 * I, H, device=dev, generator=gen) * H ** -0.5).to(dtype)
        w2 = (torch.randn(E, H, I, device=dev, generator=gen) * I ** -0.5).to(dtype)
        for _, M in (p for p in points if p[0] == shape):
            cfg = get_config(M, E, k, H, I, dtype, "NVIDIA_H200" if cuda else None)
            sets = routing_sets(M, E, k, H, 2, dtype, dev)
            run = lambda x, w, ids, cfg=cfg: fused_moe(x, w13, w2, None, None, w, ids, None, "silu", config=cfg,  # noqa: E731
                                                       direct=False, out_dtype=x.dtype)
            rows.append(_call_ab(f"{shape} bf16 M={M}", run, sets, rounds, cuda))
        del w13, w2
    if cuda:
        for shape, M in FP8_POINTS:
            _, E, k, H, I = shapes[shape]
            wts = quantized_weights("fp8_w8a8", E, H, I, True, dev)
            sets = routing_sets(M, E, k, H, 2, dtype, dev)
            rows.append(_call_ab(f"{shape} fp8 static M={M}", lambda x, w, ids: _quant_call(wts, x, w, ids), sets,
                                 rounds, cuda))
            del wts
    return rows


def main() -> None:
    p = ab_arg_parser(__doc__, "align_ab.json")
    p.add_argument("--skip-calls", action="store_true")
    args = p.parse_args()
    cuda, dev = ab_device(args)
    write_ab_result(args.out, "alignment-ab", cuda,
                    "CUDA graphs (8 alignments / 2 calls with distinct routing per graph), 10 / 5 replays, median "
                    "us per call; paths interleaved, median of the rounds",
                    alignment=alignment_part(cuda, dev, args.rounds),
                    **({} if args.skip_calls else {"calls": call_part(cuda, dev, args.rounds)}))

if __name__ == "__main__":
    main()

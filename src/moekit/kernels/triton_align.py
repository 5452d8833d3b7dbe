"""Sort (token, slot) assignments by local expert on the GPU, padded to GEMM row blocks.

Output layout (no host synchronisation: every size is a bound known from the shapes):
    sorted_ids [max_blocks * BM] int32: assignment index a = t * k + j of each GEMM row,
        grouped by expert, each expert's rows padded to a multiple of BM with the
        sentinel T * k; within an expert in assignment order (the sort is stable, so the
        rows, and every GEMM tile's contents, are the same on every run).
    expert_end [E] int32: cumulative padded row counts; row block b belongs to the expert
        whose rows [end[e-1], end[e]) hold b * BM, and blocks at or past end[E-1] are unused.
Assignments whose expert is not local (expert_map gives -1) get no row at all.

Up to SMALL assignments one launch does it all, a program per expert (align_expert_kernel):
each counts every local assignment (a histogram over E_BINS >= E bins gives the experts' padded
extents), and writes its own expert's rows, in assignment order (a prefix sum over the lanes
of its expert ranks them), its padding sentinels and its expert_end. Above, two launches over
chunks of N assignments, with no atomics, their bins the E experts plus one more (E_PAD - 1 >=
E) that collects non-local and out-of-range lanes, so they sort last:
    align_chunk_kernel: each chunk sorted by stable keys (bin * N + index), its keys kept
        and its histogram stored as row c of hist [n_chunks, E_PAD];
    align_place_kernel: each chunk adds up the histograms (all chunks: the experts' padded
        starts; the chunks before it: where its own rows of each expert begin) and writes its
        sorted assignments there; chunk 0 also writes expert_end and the padding sentinels.
Every program of the one-launch path reads all assignments, which stops paying above a few
thousand; a chunk's sort of a few hundred runs beside the others.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["align_expert_kernel", "align_expert", "align_chunk_kernel", "align_place_kernel", "local_expert",
           "chunk_size", "SMALL", "expert_bins", "expert_warps"]

# Largest T*k aligned in one launch by a program per expert. On an H200 it beats the one-program
# sort it replaced and the chunked launches up to 2048 assignments (E = 128: 3.8 -> 2.6 us at
# 128, 5.2 -> 3.0 at 512, 6.0 -> 4.6 at 2048; bench/results/h200-align-per-expert.json), is even
# at 4096 and loses at 8192 (6.9 -> 8.8-11.1 us; h200-align-per-expert-probe.json).
SMALL = 2048


def expert_bins(E: int) -> int:
    """align_expert's histogram bins for E local experts: the power of two at or above E. (A
    spare bin for non-local lanes, as the chunks have, made E = 128 or 256 count into twice the
    bins: DeepSeek-V3 fp8 M = 64 5.0 -> 3.7 us without it, Qwen3-30B-A3B M = 256 5.7 -> 5.5;
    bench/results/h200-align-bins-warps.json.)"""
    return triton.next_power_of_2(E)


def expert_warps(N: int) -> int:
    """Warps of an align_expert program over N lanes: its histogram and prefix sum over them are
    the launch's critical path. 8 at 2048 lanes (Qwen3-30B-A3B M = 256 5.5 -> 4.8 us, OLMoE
    3.4 -> 3.0), 4 below (8 took DeepSeek-V3 fp8 M = 64, 512 lanes, from 3.7 to 4.2 us; 16
    were slower everywhere: h200-align-bins-warps.json)."""
    return 8 if N >= 2048 else 4


def chunk_size(TK: int) -> int:
    """Assignments per chunk above SMALL: about TK / 64 as a power of two from 256 to 1024.

    On an H200 (bench/results/h200-align-ab.json) a chunk's sort costs about 2 us at 256 keys,
    7 at 1024 and 25 at 2048, while the histograms every chunk adds up grow with the chunk count.
    """
    n = 256
    while n < 1024 and n * 64 < TK:
        n *= 2
    return n


@triton.jit
def local_expert(ids_ptr, map_ptr, offs, mask, HAS_MAP: tl.constexpr):
    """Local expert id of assignments `offs` (-1 where masked or not local)."""
    gid = tl.load(ids_ptr + offs, mask=mask, other=-1)
    if HAS_MAP:
        return tl.load(map_ptr + gid, mask=mask & (gid >= 0), other=-1)
    return gid


@triton.jit
def _bins(ids_ptr, map_ptr, offs, n, E_PAD: tl.constexpr, HAS_MAP: tl.constexpr):
    """Histogram bin of each assignment: its local expert, or E_PAD - 1 for the rest."""
    lid = local_expert(ids_ptr, map_ptr, offs, offs < n, HAS_MAP)
    return tl.where(lid >= 0, lid, E_PAD - 1)


@triton.jit
def _chunk_keys(bins, N: tl.constexpr):
    """Sort keys bin * N + index of N assignments (stable by bin: indices are distinct)."""
    return tl.sort(bins * N + tl.arange(0, N))


@triton.jit
def _extents(counts, E, BM: tl.constexpr, E_PAD: tl.constexpr):
    """(first row, assignments, padded rows) of each expert lane from the counts per bin."""
    local = tl.where(tl.arange(0, E_PAD) < E, counts, 0)
    padded = (local + BM - 1) // BM * BM
    return tl.cumsum(padded, axis=0) - padded, local, padded


@triton.jit
def _write_rows(sorted_ptr, key, base, hist, first_index, E, N: tl.constexpr):
    """sorted_ids[row] = first_index + index in the chunk, for the chunk's N sorted keys.

    base [E_PAD]: the first row of each expert for this chunk.  hist [E_PAD]: the chunk's
    histogram (its exclusive cumsum is where each bin starts in the sorted order).
    """
    sbin = key // N
    sidx = key - sbin * N
    first = tl.cumsum(hist, axis=0) - hist
    rows = tl.gather(base, sbin, 0) + tl.arange(0, N) - tl.gather(first, sbin, 0)
    tl.store(sorted_ptr + rows, first_index + sidx, mask=sbin < E)


@triton.jit
def _write_ends(sorted_ptr, expert_end_ptr, starts, counts, padded, TK, E, BM: tl.constexpr, E_PAD: tl.constexpr):
    """expert_end, and the sentinel TK in each expert's padding rows [start + count, start + padded)."""
    experts = tl.arange(0, E_PAD)
    tl.store(expert_end_ptr + experts, starts + padded, mask=experts < E)
    for p0 in tl.static_range(0, BM, 16):
        col = p0 + tl.arange(0, 16)
        tl.store(sorted_ptr + (starts + counts)[:, None] + col[None, :], tl.zeros([E_PAD, 16], tl.int32) + TK,
                 mask=col[None, :] < (padded - counts)[:, None])


@triton.jit
def align_expert(ids_ptr, map_ptr, sorted_ptr, expert_end_ptr, e, TK, E,
                 BM: tl.constexpr, N: tl.constexpr, E_BINS: tl.constexpr, HAS_MAP: tl.constexpr):
    """Expert e's part of the alignment of TK <= N assignments (see the module docstring): its
    sorted_ids rows, its padding sentinels and expert_end[e]. E_BINS: a power of two >= E (the
    histogram counts local assignments only: no spare bin, whose lanes would double the
    histogram's work at E = 128 or 256)."""
    lanes = tl.arange(0, N)
    lid = local_expert(ids_ptr, map_ptr, lanes, lanes < TK, HAS_MAP)
    starts, local, padded = _extents(tl.histogram(lid, E_BINS, mask=lid >= 0), E, BM, E_BINS)
    sel = tl.arange(0, E_BINS) == e
    start = tl.sum(tl.where(sel, starts, 0), axis=0)
    count = tl.sum(tl.where(sel, local, 0), axis=0)
    pad = tl.sum(tl.where(sel, padded, 0), axis=0) - count
    mine = lid == e
    tl.store(sorted_ptr + start + tl.cumsum(mine.to(tl.int32), axis=0) - 1, lanes, mask=mine)
    p = tl.arange(0, BM)
    tl.store(sorted_ptr + start + count + p, TK + p * 0, mask=p < pad)
    tl.store(expert_end_ptr + e, start + count + pad)


@triton.jit(do_not_specialize=["TK"])
def align_expert_kernel(
    ids_ptr, map_ptr, sorted_ptr, expert_end_ptr, TK, E,
    BM: tl.constexpr, N: tl.constexpr, E_BINS: tl.constexpr, HAS_MAP: tl.constexpr,
):
    """The whole alignment of TK <= N assignments in one launch, grid (E,): expert program_id(0)'s part."""
    align_expert(ids_ptr, map_ptr, sorted_ptr, expert_end_ptr, tl.program_id(0), TK, E, BM, N, E_BINS, HAS_MAP)


@triton.jit(do_not_specialize=["TK"])
def align_chunk_kernel(ids_ptr, map_ptr, hist_ptr, keys_ptr, TK, N: tl.constexpr, E_PAD: tl.constexpr,
                       HAS_MAP: tl.constexpr):
    """Chunk c = program_id(0) of N assignments: its sorted keys to keys[c * N:], its histogram
    to hist[c, :E_PAD]."""
    c = tl.program_id(0)
    bins = _bins(ids_ptr, map_ptr, c * N + tl.arange(0, N), TK, E_PAD, HAS_MAP)
    tl.store(keys_ptr + c * N + tl.arange(0, N), _chunk_keys(bins, N))
    tl.store(hist_ptr + c * E_PAD + tl.arange(0, E_PAD), tl.histogram(bins, E_PAD))


@triton.jit(do_not_specialize=["TK", "NC"])
def align_place_kernel(
    hist_ptr, keys_ptr, sorted_ptr, expert_end_ptr, TK, E, NC,
    BM: tl.constexpr, N: tl.constexpr, E_PAD: tl.constexpr, CB: tl.constexpr,
):
    """Rows of chunk c = program_id(0) of NC (see the module docstring); CB histogram rows
    are read per step.  Integer sums: the same in any order."""
    c = tl.program_id(0)
    experts = tl.arange(0, E_PAD)
    before = tl.zeros([E_PAD], dtype=tl.int32)
    total = tl.zeros([E_PAD], dtype=tl.int32)
    for c0 in tl.range(0, NC, CB, num_stages=2):
        cs = c0 + tl.arange(0, CB)
        h = tl.load(hist_ptr + cs[:, None] * E_PAD + experts[None, :], mask=(cs < NC)[:, None], other=0)
        total += tl.sum(h, axis=0)
        before += tl.sum(tl.where((cs < c)[:, None], h, 0), axis=0)
    starts, local, padded = _extents(total, E, BM, E_PAD)
    key = tl.load(keys_ptr + c * N + tl.arange(0, N))
    _write_rows(sorted_ptr, key, starts + before, tl.load(hist_ptr + c * E_PAD + experts), c * N, E, N)
    if c == 0:
        _write_ends(sorted_ptr, expert_end_ptr, starts, local, padded, TK, E, BM, E_PAD)

"""Sort (token, slot) assignments by local expert on the GPU, padded to GEMM row blocks.

Output layout (no host synchronisation: every size is a bound known from the shapes):
    sorted_ids [max_blocks * BM] int32: assignment index a = t * k + j of each GEMM row,
        grouped by expert, each expert's rows padded to a multiple of BM with the
        sentinel T * k; in assignment order within an expert up to SMALL assignments,
        in arrival order above (see align_scatter_kernel).
    expert_end [E] int32: cumulative padded row counts; row block b belongs to the expert
        whose rows [end[e-1], end[e]) hold b * BM, and blocks at or past end[E-1] are unused.
Assignments whose expert is not local (expert_map gives -1) get no row at all.

Bins are the E experts plus one more (E_PAD - 1 >= E) that collects non-local and
out-of-range lanes. Up to SMALL assignments one program does it all (one launch): a
bitonic sort of keys (bin * n + index) puts each expert's assignments together in order,
a histogram gives the counts, and a row's place is its expert's padded start plus its
rank. Above, three launches over chunks of CHUNK assignments: histograms added into global
counts, a one-program scan, then each assignment claims a row with an atomic increment
(a sort of thousands of keys in one program costs tens of microseconds).
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["align_small_kernel", "align_count_kernel", "align_scan_kernel", "align_scatter_kernel",
           "local_expert", "SMALL", "CHUNK"]

# Largest T*k aligned by the one-program sort; assignments per program above it.
SMALL = 512
CHUNK = 1024


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
def _sorted_rows(bins, base, first, N: tl.constexpr):
    """Sort N assignments by bin (stable); return (bin, index in the chunk, row) of each.

    base [E_PAD]: the first row of each expert for this chunk.  first [E_PAD]: where each
    bin starts in the chunk's sorted order (exclusive cumsum of its histogram).
    """
    key = tl.sort(bins * N + tl.arange(0, N))
    sbin = key // N
    sidx = key - sbin * N
    rows = tl.gather(base, sbin, 0) + tl.arange(0, N) - tl.gather(first, sbin, 0)
    return sbin, sidx, rows


@triton.jit
def _sentinels(sorted_ptr, starts, counts, padded, TK, BM: tl.constexpr, E_PAD: tl.constexpr):
    """Fill each expert's padding rows [start + count, start + padded) with the sentinel TK."""
    for p0 in tl.static_range(0, BM, 16):
        col = p0 + tl.arange(0, 16)
        tl.store(sorted_ptr + (starts + counts)[:, None] + col[None, :], tl.zeros([E_PAD, 16], tl.int32) + TK,
                 mask=col[None, :] < (padded - counts)[:, None])


@triton.jit(do_not_specialize=["TK"])
def align_small_kernel(
    ids_ptr, map_ptr, sorted_ptr, expert_end_ptr, TK, E,
    BM: tl.constexpr, N: tl.constexpr, E_PAD: tl.constexpr, HAS_MAP: tl.constexpr,
):
    """The whole alignment of TK <= N assignments in one program (grid (1,))."""
    experts = tl.arange(0, E_PAD)
    bins = _bins(ids_ptr, map_ptr, tl.arange(0, N), TK, E_PAD, HAS_MAP)
    counts = tl.histogram(bins, E_PAD)
    local = tl.where(experts < E, counts, 0)
    padded = (local + BM - 1) // BM * BM
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    sbin, sidx, rows = _sorted_rows(bins, starts, tl.cumsum(counts, axis=0) - counts, N)
    tl.store(sorted_ptr + rows, sidx, mask=sbin < E)
    _sentinels(sorted_ptr, starts, local, padded, TK, BM, E_PAD)
    tl.store(expert_end_ptr + experts, ends, mask=experts < E)


@triton.jit(do_not_specialize=["TK"])
def align_count_kernel(ids_ptr, map_ptr, counts_ptr, TK, N: tl.constexpr, E_PAD: tl.constexpr, HAS_MAP: tl.constexpr):
    """counts[e] += assignments of chunk c (N of them) in bin e (integer adds: exact in any order)."""
    c = tl.program_id(0)
    bins = _bins(ids_ptr, map_ptr, c * N + tl.arange(0, N), TK, E_PAD, HAS_MAP)
    tl.atomic_add(counts_ptr + tl.arange(0, E_PAD), tl.histogram(bins, E_PAD))


@triton.jit(do_not_specialize=["TK"])
def align_scan_kernel(
    counts_ptr, cursor_ptr, expert_end_ptr, sorted_ptr, E, TK,
    BM: tl.constexpr, E_PAD: tl.constexpr,
):
    """One program (grid (1,)): padded expert extents, each expert's first free row
    (cursor), sentinel rows."""
    experts = tl.arange(0, E_PAD)
    local = tl.where(experts < E, tl.load(counts_ptr + experts), 0)
    padded = (local + BM - 1) // BM * BM
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    tl.store(cursor_ptr + experts, starts)
    tl.store(expert_end_ptr + experts, ends, mask=experts < E)
    _sentinels(sorted_ptr, starts, local, padded, TK, BM, E_PAD)


@triton.jit(do_not_specialize=["TK"])
def align_scatter_kernel(
    ids_ptr, map_ptr, cursor_ptr, sorted_ptr, TK, E,
    N: tl.constexpr, E_PAD: tl.constexpr, HAS_MAP: tl.constexpr,
):
    """sorted_ids[row] = a for the local assignments of chunk c; a row is claimed from its
    expert's cursor, so the order within an expert is the order of arrival. That order does
    not change any result: each row's GEMM outputs depend on that row alone, and the sum
    over k runs in slot order."""
    offs = tl.program_id(0) * N + tl.arange(0, N)
    bins = _bins(ids_ptr, map_ptr, offs, TK, E_PAD, HAS_MAP)
    rows = tl.atomic_add(cursor_ptr + bins, 1, mask=bins < E)
    tl.store(sorted_ptr + rows, offs, mask=bins < E)

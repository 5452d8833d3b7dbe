"""Sort (token, slot) assignments by local expert on the GPU, padded to GEMM row blocks.

Output layout (no host synchronisation: every size is a bound known from the shapes):
    sorted_ids [max_blocks * BM] int32: assignment index a = t * k + j of each GEMM row,
        grouped by expert, each expert's rows padded to a multiple of BM with the
        sentinel T * k; stable (assignment order within an expert).
    block_expert [max_blocks] int32: the local expert of each row block.
    num_padded [1] int32: rows in use; blocks past it are skipped by the GEMMs.
Assignments whose expert is not local (expert_map gives -1) get no row at all.

Two variants: one program for small T * k (one launch), and count -> scan -> scatter
over chunks of assignments for large T * k (three launches; only the scan, over chunk
counts, is a single program).
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["align_small_kernel", "align_count_kernel", "align_scan_kernel", "align_scatter_kernel", "local_expert"]


@triton.jit
def local_expert(ids_ptr, map_ptr, offs, mask, HAS_MAP: tl.constexpr):
    """Local expert id of assignments `offs` (-1 where masked or not local)."""
    gid = tl.load(ids_ptr + offs, mask=mask, other=-1)
    if HAS_MAP:
        return tl.load(map_ptr + gid, mask=mask & (gid >= 0), other=-1)
    return gid


@triton.jit(do_not_specialize=["TK", "max_blocks"])
def align_small_kernel(
    ids_ptr, map_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr,
    TK, max_blocks,
    BM: tl.constexpr, C: tl.constexpr, E_PAD: tl.constexpr, NB: tl.constexpr, HAS_MAP: tl.constexpr,
):
    """The whole alignment in one program (grid (1,)); C assignments at a time against all experts."""
    experts = tl.arange(0, E_PAD)
    # Step 1: tokens per expert.
    counts = tl.zeros([E_PAD], dtype=tl.int32)
    for c0 in range(0, TK, C):
        offs = c0 + tl.arange(0, C)
        lid = local_expert(ids_ptr, map_ptr, offs, offs < TK, HAS_MAP)
        counts += tl.sum((lid[:, None] == experts[None, :]).to(tl.int32), axis=0)
    # Step 2: padded extents, sentinel rows, block -> expert.
    padded = (counts + BM - 1) // BM * BM
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    pad_col = tl.arange(0, BM)
    tl.store(sorted_ptr + (starts + counts)[:, None] + pad_col[None, :], tl.zeros([E_PAD, BM], tl.int32) + TK,
             mask=pad_col[None, :] < (padded - counts)[:, None])
    for b0 in range(0, max_blocks, NB):
        blocks = b0 + tl.arange(0, NB)
        owner = tl.sum((ends[None, :] <= (blocks * BM)[:, None]).to(tl.int32), axis=1)
        tl.store(block_expert_ptr + blocks, owner, mask=blocks < max_blocks)
    tl.store(num_padded_ptr, tl.sum(padded, axis=0))
    # Step 3: each assignment's row = its expert's start + assignments of that expert before it.
    running = starts
    for c0 in range(0, TK, C):
        offs = c0 + tl.arange(0, C)
        lid = local_expert(ids_ptr, map_ptr, offs, offs < TK, HAS_MAP)
        onehot = (lid[:, None] == experts[None, :]).to(tl.int32)
        rank = tl.cumsum(onehot, axis=0) - 1 + running[None, :]
        pos = tl.sum(rank * onehot, axis=1)
        tl.store(sorted_ptr + pos, offs, mask=lid >= 0)
        running += tl.sum(onehot, axis=0)


@triton.jit(do_not_specialize=["TK"])
def align_count_kernel(
    ids_ptr, map_ptr, chunk_counts_ptr, TK, E,
    C: tl.constexpr, CS: tl.constexpr, EB: tl.constexpr, HAS_MAP: tl.constexpr,
):
    """chunk_counts[c, e] = assignments of chunk c (C assignments) routed to local expert e."""
    c = tl.program_id(0)
    for e0 in range(0, E, EB):
        experts = e0 + tl.arange(0, EB)
        counts = tl.zeros([EB], dtype=tl.int32)
        for s0 in range(0, C, CS):
            offs = c * C + s0 + tl.arange(0, CS)
            lid = local_expert(ids_ptr, map_ptr, offs, offs < TK, HAS_MAP)
            counts += tl.sum((lid[:, None] == experts[None, :]).to(tl.int32), axis=0)
        tl.store(chunk_counts_ptr + c * E + experts, counts, mask=experts < E)


@triton.jit(do_not_specialize=["NC", "TK"])
def align_scan_kernel(
    chunk_counts_ptr, chunk_base_ptr, expert_start_ptr, expert_end_ptr, sorted_ptr, num_padded_ptr,
    NC, E, TK,
    BM: tl.constexpr, R: tl.constexpr, EB: tl.constexpr,
):
    """One program (grid (1,)): per-chunk bases (exclusive scan over chunks), padded expert
    extents, sentinel rows and the row count."""
    total = 0
    pad_col = tl.arange(0, BM)
    for e0 in range(0, E, EB):
        experts = e0 + tl.arange(0, EB)
        emask = experts < E
        carry = tl.zeros([EB], dtype=tl.int32)
        for c0 in range(0, NC, R):
            chunks = c0 + tl.arange(0, R)
            idx = chunks[:, None] * E + experts[None, :]
            m = (chunks < NC)[:, None] & emask[None, :]
            tile = tl.load(chunk_counts_ptr + idx, mask=m, other=0)
            incl = tl.cumsum(tile, axis=0) + carry[None, :]
            tl.store(chunk_base_ptr + idx, incl - tile, mask=m)
            carry += tl.sum(tile, axis=0)
        padded = (carry + BM - 1) // BM * BM
        ends = total + tl.cumsum(padded, axis=0)
        starts = ends - padded
        tl.store(expert_start_ptr + experts, starts, mask=emask)
        tl.store(expert_end_ptr + experts, ends, mask=emask)
        tl.store(sorted_ptr + (starts + carry)[:, None] + pad_col[None, :], tl.zeros([EB, BM], tl.int32) + TK,
                 mask=emask[:, None] & (pad_col[None, :] < (padded - carry)[:, None]))
        total += tl.sum(padded, axis=0)
    tl.store(num_padded_ptr, total)


@triton.jit(do_not_specialize=["TK", "max_blocks", "blocks_per_chunk"])
def align_scatter_kernel(
    ids_ptr, map_ptr, chunk_base_ptr, expert_start_ptr, expert_end_ptr, sorted_ptr, block_expert_ptr,
    TK, E, max_blocks, blocks_per_chunk,
    BM: tl.constexpr, C: tl.constexpr, CS: tl.constexpr, EB: tl.constexpr, NB: tl.constexpr,
    HAS_MAP: tl.constexpr,
):
    """sorted_ids[row] = a for every local assignment a of chunk c (stable within an expert),
    and block_expert for this chunk's share of the row blocks."""
    c = tl.program_id(0)
    for e0 in range(0, E, EB):
        experts = e0 + tl.arange(0, EB)
        emask = experts < E
        running = (tl.load(chunk_base_ptr + c * E + experts, mask=emask, other=0)
                   + tl.load(expert_start_ptr + experts, mask=emask, other=0))
        for s0 in range(0, C, CS):
            offs = c * C + s0 + tl.arange(0, CS)
            lid = local_expert(ids_ptr, map_ptr, offs, offs < TK, HAS_MAP)
            onehot = (lid[:, None] == experts[None, :]).to(tl.int32)
            pos = tl.sum((tl.cumsum(onehot, axis=0) - 1 + running[None, :]) * onehot, axis=1)
            tl.store(sorted_ptr + pos, offs, mask=(lid >= e0) & (lid < e0 + EB))
            running += tl.sum(onehot, axis=0)
    # Row block b belongs to the expert whose padded rows [start, end) hold b * BM.
    first = c * blocks_per_chunk
    for b0 in range(first, first + blocks_per_chunk, NB):
        blocks = b0 + tl.arange(0, NB)
        owner = tl.zeros([NB], dtype=tl.int32)
        for e0 in range(0, E, EB):
            experts = e0 + tl.arange(0, EB)
            ends = tl.load(expert_end_ptr + experts, mask=experts < E, other=2147483647)
            owner += tl.sum((ends[None, :] <= (blocks * BM)[:, None]).to(tl.int32), axis=1)
        tl.store(block_expert_ptr + blocks, owner, mask=(blocks < max_blocks) & (blocks < first + blocks_per_chunk))

"""GEMM2 of the prefill path for Hopper (SM90), written in Gluon: Triton's lower-level
dialect, where shared-memory buffers, mbarriers, TMA copies and asynchronous warpgroup
MMAs are explicit.

Why: at large M, triton_prefill's GEMM2 (K = I, 768-2880) runs each tile's K loop as its
own pipeline: it fills, drains, then stores while the tensor cores idle, and Triton's
flattened loops did not overlap tiles here (bench/NOTES-triton.md). This kernel walks one
flat sequence of (tile, K step) pairs per persistent program through a ring of NUM_BUF
shared-memory stages: while a tile's last products run and its epilogue stores, the TMA
loads of the next tile's first NUM_BUF - 1 steps are already in flight.

Per step i (stage i % NUM_BUF): wait for its TMA loads, issue the product asynchronously,
wait until only it is outstanding (so step i - 1's stage is free), and refill that stage
with step i + NUM_BUF - 1. After a tile's last step: wait for all products, scale each row
by its routing weight (unless it went on the input), add the bias, and store y rows by
assignment, as triton_prefill's GEMM2 does (same row layout, same sum over k afterwards).

Operands: act [R, I] rows (sorted layout, contiguous per expert) and w2 as [E * H, I]
through host TMA descriptors ([BM, BK] and [BN, BK] blocks). A tile reads BM act rows from
its first row: rows past the expert's belong to the next expert or are zeros past R and
reach only rows that are not stored; weight rows past H reach only columns not stored.
Row tiles start at each expert's first (padded) row, whatever granule the alignment padded
to; an expert's last tile may hold fewer than BM rows.

Letters: as triton_prefill. Availability: `available()`; the launcher refuses otherwise.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import triton

try:  # Gluon ships with triton >= 3.5; the kernels below need its Hopper module
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        mbarrier, tma, warpgroup_mma, warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    _IMPORT_ERROR: Optional[str] = None
except ImportError as err:  # pragma: no cover - depends on the installed triton
    _IMPORT_ERROR = f"{type(err).__name__}: {err}"

__all__ = ["available", "gluon_gemm2"]


def available(device: torch.device) -> Optional[str]:
    """None when the Gluon GEMM2 can run on device, else why not."""
    if _IMPORT_ERROR is not None:
        return f"this triton has no Gluon Hopper module ({_IMPORT_ERROR})"
    if device.type != "cuda":
        return f"it needs a CUDA device, got {device.type}"
    major, minor = torch.cuda.get_device_capability(device)
    if major != 9:
        return f"it is written for SM90 (Hopper), got SM{major}{minor}"
    return None


if _IMPORT_ERROR is None:

    @gluon.jit
    def _add(a, b):
        return a + b

    @gluon.jit
    def _schedule(expert_end_ptr, E, BM: gl.constexpr, E_PAD: gl.constexpr, LANES: gl.constexpr):
        """Per expert lane: row tiles ending there (cumulative), the row base of its tiles (row
        of its tile m is base + m * BM), its padded end row; and the number of row tiles."""
        lanes = gl.arange(0, E_PAD, layout=LANES)
        ends = gl.load(expert_end_ptr + lanes, mask=lanes < E, other=0)
        starts = gl.load(expert_end_ptr + lanes - 1, mask=(lanes >= 1) & (lanes < E), other=0)
        tiles = (ends - starts + BM - 1) // BM
        tile_end = gl.associative_scan(tiles, 0, _add)
        row_base = starts - (tile_end - tiles) * BM
        return tile_end, row_base, ends, gl.sum(tiles, axis=0)

    @gluon.jit
    def _tile(q, pid, programs, num_m, num_n, tile_end, row_base, ends,
              BM: gl.constexpr, GROUP_M: gl.constexpr, E_PAD: gl.constexpr, LANES: gl.constexpr):
        """This program's q-th work item: (expert, first row, rows, column tile)."""
        t = pid + q * programs
        per_group = GROUP_M * num_n
        first_m = (t // per_group) * GROUP_M
        group_rows = gl.maximum(gl.minimum(num_m - first_m, GROUP_M), 1)  # >= 1 past the last item too
        m = first_m + (t % per_group) % group_rows
        nt = (t % per_group) // group_rows
        e = gl.sum((tile_end <= m).to(gl.int32), axis=0)
        sel = gl.arange(0, E_PAD, layout=LANES) == e
        row0 = gl.sum(gl.where(sel, row_base, 0), axis=0) + m * BM
        rows = gl.minimum(gl.sum(gl.where(sel, ends, 0), axis=0) - row0, BM)
        return e, row0, rows, nt

    @gluon.jit
    def _coords(q, pid, programs, num_m, num_n, tile_end, row_base, ends, N,
                BM: gl.constexpr, BN: gl.constexpr, GROUP_M: gl.constexpr, E_PAD: gl.constexpr, LANES: gl.constexpr):
        """TMA row coordinates of this program's q-th item: its first act row, its first w2 row."""
        e, row0, rows, nt = _tile(q, pid, programs, num_m, num_n, tile_end, row_base, ends, BM, GROUP_M, E_PAD, LANES)
        return row0, e * N + nt * BN

    @gluon.jit
    def _load_step(s, a_row, w_row, KT, a_desc, w_desc, a_bufs, w_bufs, bars, BK: gl.constexpr,
                   NUM_BUF: gl.constexpr, pred):
        """TMA loads of step s (K step s % KT of the item at rows a_row / w_row) into stage s % NUM_BUF."""
        k0 = (s % KT) * BK
        stage = s % NUM_BUF
        bar = bars.index(stage)
        mbarrier.expect(bar, a_desc.block_type.nbytes + w_desc.block_type.nbytes, pred=pred)
        tma.async_copy_global_to_shared(a_desc, [a_row, k0], bar, a_bufs.index(stage), pred)
        tma.async_copy_global_to_shared(w_desc, [w_row, k0], bar, w_bufs.index(stage), pred)

    @gluon.jit
    def gluon_gemm2_kernel(
        a_desc, w_desc, b_ptr, y_ptr, topk_w_ptr, sorted_ptr, expert_end_ptr,
        N, K, TK, E, stride_be, stride_ym,
        BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, GROUP_M: gl.constexpr, NUM_BUF: gl.constexpr,
        E_PAD: gl.constexpr, HAS_BIAS: gl.constexpr, ON_INPUT: gl.constexpr, num_warps: gl.constexpr,
    ):
        """y[a, n] = w[a] * (act[row] W2[e]^T + b2[e])[n] for every row tile (w = 1 when it went on
        the input); a persistent program per SM walks items pid, pid + programs, ..."""
        # Every warp holds all E_PAD lanes, so the schedule's sums are warp shuffles (no barrier).
        LANES: gl.constexpr = gl.BlockedLayout([E_PAD // 32], [32], [num_warps], [0])
        ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                      instr_shape=[16, BN, 16])
        STORE: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // BN, BN // 8], [num_warps, 1], [1, 0])
        ROWS: gl.constexpr = gl.SliceLayout(1, ACC)
        COLS: gl.constexpr = gl.SliceLayout(0, ACC)
        dtype: gl.constexpr = a_desc.dtype

        pid = gl.program_id(0)
        programs = gl.num_programs(0)
        tile_end, row_base, ends, num_m = _schedule(expert_end_ptr, E, BM, E_PAD, LANES)
        num_n = gl.cdiv(N, BN)
        KT = gl.cdiv(K, BK)
        items = gl.cdiv(num_m * num_n - pid, programs)
        steps = items * KT

        a_bufs = gl.allocate_shared_memory(dtype, [NUM_BUF, BM, BK], a_desc.layout)
        w_bufs = gl.allocate_shared_memory(dtype, [NUM_BUF, BN, BK], w_desc.layout)
        bars = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(NUM_BUF):
            mbarrier.init(bars.index(i), count=1)
        for i in gl.static_range(NUM_BUF - 1):
            a_row, w_row = _coords(i // KT, pid, programs, num_m, num_n, tile_end, row_base, ends, N, BM, BN, GROUP_M,
                                   E_PAD, LANES)
            _load_step(i, a_row, w_row, KT, a_desc, w_desc, a_bufs, w_bufs, bars, BK, NUM_BUF, i < steps)
        # the producer's item coordinates, recomputed when it crosses into the next item
        a_row, w_row = _coords((NUM_BUF - 1) // KT, pid, programs, num_m, num_n, tile_end, row_base, ends, N, BM, BN,
                               GROUP_M, E_PAD, LANES)

        acc = gl.zeros([BM, BN], gl.float32, ACC)
        for s in range(steps):
            stage = s % NUM_BUF
            kk = s % KT
            mbarrier.wait(bars.index(stage), (s // NUM_BUF) & 1)
            acc = warpgroup_mma(a_bufs.index(stage), w_bufs.index(stage).permute((1, 0)), acc, use_acc=kk > 0,
                                is_async=True)
            acc = warpgroup_mma_wait(1, deps=(acc,))
            # step s - 1's product is done: its stage takes step s + NUM_BUF - 1
            nxt = s + NUM_BUF - 1
            if nxt % KT == 0:
                a_row, w_row = _coords(nxt // KT, pid, programs, num_m, num_n, tile_end, row_base, ends, N, BM, BN,
                                       GROUP_M, E_PAD, LANES)
            _load_step(nxt, a_row, w_row, KT, a_desc, w_desc, a_bufs, w_bufs, bars, BK, NUM_BUF, nxt < steps)
            if kk == KT - 1:
                acc = warpgroup_mma_wait(0, deps=(acc,))
                e, row0, rows, nt = _tile(s // KT, pid, programs, num_m, num_n, tile_end, row_base, ends, BM,
                                          GROUP_M, E_PAD, LANES)
                r = gl.arange(0, BM, layout=ROWS)
                cols = nt * BN + gl.arange(0, BN, layout=COLS)
                col_ok = cols < N
                assign = gl.load(sorted_ptr + row0 + r, mask=r < rows, other=TK)
                live = assign < TK
                out = acc
                if HAS_BIAS:
                    bias = gl.load(b_ptr + e.to(gl.int64) * stride_be + cols, mask=col_ok, other=0.0)
                    out = out + gl.expand_dims(bias.to(gl.float32), 0)
                if not ON_INPUT:
                    route_w = gl.load(topk_w_ptr + assign, mask=live, other=0.0)
                    out = out * gl.expand_dims(route_w, 1)
                # rows of 16-byte pieces for the stores (through shared memory)
                out = gl.convert_layout(out.to(y_ptr.dtype.element_ty), STORE)
                rs = gl.arange(0, BM, layout=gl.SliceLayout(1, STORE))
                cs = nt * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, STORE))
                assign = gl.load(sorted_ptr + row0 + rs, mask=rs < rows, other=TK)
                live = assign < TK
                y_ptrs = y_ptr + gl.expand_dims(gl.where(live, assign, 0).to(gl.int64) * stride_ym, 1) \
                    + gl.expand_dims(cs, 0)
                gl.store(y_ptrs, out, mask=gl.expand_dims(live, 1) & gl.expand_dims(cs < N, 0))
        for i in gl.static_range(NUM_BUF):
            mbarrier.invalidate(bars.index(i))


def _nvmma(block, dtype: torch.dtype):
    return gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16 if dtype == torch.bfloat16 else gl.float16)


@functools.lru_cache(maxsize=None)
def _sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def gluon_gemm2(act: torch.Tensor, w2: torch.Tensor, b2: Optional[torch.Tensor], y: torch.Tensor,
                topk_weights: torch.Tensor, sorted_ids: torch.Tensor, expert_end: torch.Tensor, TK: int,
                on_input: bool, BM: int, BN: int, BK: int, group_m: int, num_buf: int, num_warps: int,
                e_pad: int, per_sm: int = 1) -> None:
    """y[a] for every assignment a of the sorted rows (launch-ready inputs from
    triton_prefill.fused_moe_prefill: act [R, I], w2 [E, H, I], y [TK, H] in act's dtype)."""
    if BM != 16 * num_warps or BN not in (64, 128, 256) or num_buf < 2:
        raise ValueError(f"the Gluon GEMM2 takes BLOCK_SIZE_M = 16 * num_warps (one 16-row slice a warp), "
                         f"BLOCK_SIZE_N in (64, 128, 256) and num_stages >= 2, got BLOCK_SIZE_M={BM}, "
                         f"num_warps={num_warps}, BLOCK_SIZE_N={BN}, num_stages={num_buf}")
    E, H, I = w2.shape
    R = act.shape[0]
    a_desc = TensorDescriptor(act, [R, I], [act.stride(0), 1], [BM, BK], _nvmma([BM, BK], act.dtype))
    w_desc = TensorDescriptor(w2.view(E * H, I), [E * H, I], [I, 1], [BN, BK], _nvmma([BN, BK], w2.dtype))
    E_rows = triton.cdiv(R, BM) + E  # bound: each expert adds at most one partly filled tile
    items = E_rows * triton.cdiv(H, BN)
    sms = _sms(act.device.index if act.device.index is not None else torch.cuda.current_device())
    grid = (max(1, min(items, sms * per_sm)),)
    bias = b2 if b2 is not None else y
    gluon_gemm2_kernel[grid](
        a_desc, w_desc, bias, y, topk_weights, sorted_ids, expert_end,
        H, I, TK, E, b2.stride(0) if b2 is not None else 0, y.stride(0),
        BM=BM, BN=BN, BK=BK, GROUP_M=group_m, NUM_BUF=num_buf, E_PAD=e_pad, HAS_BIAS=b2 is not None,
        ON_INPUT=on_input, num_warps=num_warps)

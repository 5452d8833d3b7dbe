"""Triton kernels of the peer-memory dispatcher (p2p_a2a.py): push rows, push partials, barrier.

Every rank owns one window (peer_memory.py) that the other ranks of its host can write:

    [flags P int32 | pad to 256 B | counts P int32 | pad to 512 B | recv P*C rows | back P*C*H fp32]

recv and back are split in P blocks of C = capacity rows, block q for source rank q, so
ranks never write the same bytes. A kernel reaches rank r's window at
`window + delta[r] * 4` (int32 words), delta[r] = (address of r's window - address of this
rank's window) / 16 bytes, which keeps the 16-byte alignment the compiler needs for wide
accesses (an address loaded as a plain integer would lose it).

    push_rows      program (d, s) copies slot s of the send block for rank d (ep_kernels.pack's
                   [P*C, row] buffer) to slot s of block `me` of d's recv, whole for a token,
                   only [weights | ids] for a padding slot (zero weights and ids no expert of d
                   serves: the x bytes left there are never read); program (d, 0) also writes
                   the count into d's counts[me].
    push_partials  program (q, s), s < counts[q] (rows rank q sent here): the partial output
                   y[q*C + s] to slot s of block `me` of q's back. y is an argument, or (INDIRECT)
                   found at window + y_delta[0] * 16 bytes, a device value the host sets before
                   the launch: a captured launch then serves a new y without copying it.
    barrier        one program: epoch += 1, write it to flags[me] of every rank with release
                   semantics at system scope, then wait until this rank's flags[r] >= epoch
                   for every r (acquire). Flags only grow, so nothing is ever reset and the
                   kernels replay from a CUDA graph as they are. A peer that does not arrive
                   within the spin limit sets status[0] = 1 and the wait gives up (the
                   dispatcher's check_health() raises on it) instead of hanging the GPU.

Two barriers per dispatch + combine (after each push) order every reuse of a buffer: a rank
writes a peer's recv (back) only after that peer passed the barrier that follows its last
read of it. Importing this module needs the optional `triton` package.
"""

from __future__ import annotations

from typing import Optional

import torch

try:
    import triton
    import triton.language as tl
except ImportError as err:  # pragma: no cover - depends on the environment
    raise ImportError("moekit.parallel.p2p_kernels needs Triton: `pip install moekit[gpu]`") from err

from .peer_memory import COUNTS_OFFSET, DATA_OFFSET, FLAGS_OFFSET

__all__ = ["push_rows", "push_partials", "barrier"]



@triton.jit
def _peer(win_ptr, delta_ptr, r):
    """Rank r's window as int32 words (see the module docstring)."""
    return win_ptr + tl.load(delta_ptr + r) * 4


@triton.jit
def p2p_push_rows_kernel(send_ptr, win_ptr, delta_ptr, meta_ptr, me, C, row_w, tail_w, recv_w, counts_w,
                         BLOCK: tl.constexpr, TAIL: tl.constexpr):
    """Grid (P * C,): slot s of the block for rank d = pid // C (see the module docstring)."""
    pid = tl.program_id(0)
    d = pid // C
    s = pid - d * C
    count = tl.load(meta_ptr + 2 * d)
    peer = _peer(win_ptr, delta_ptr, d)
    src = send_ptr + pid.to(tl.int64) * row_w
    dst = peer + recv_w + (me * C + s).to(tl.int64) * row_w
    cols = tl.arange(0, BLOCK)
    if s < count:
        for c0 in range(0, row_w, BLOCK):
            c = c0 + cols
            tl.store(dst + c, tl.load(src + c, mask=c < row_w), mask=c < row_w)
    else:
        c = tail_w + tl.arange(0, TAIL)
        tl.store(dst + c, tl.load(src + c, mask=c < row_w), mask=c < row_w)
    if s == 0:
        tl.store(peer + counts_w + me, count)


@triton.jit
def p2p_push_partials_kernel(y_ptr, win_ptr, delta_ptr, y_delta_ptr, me, C, H, y_s0, back_w, counts_w,
                             BLOCK: tl.constexpr, INDIRECT: tl.constexpr):
    """Grid (P * C,): row s of source q = pid // C goes home when s < counts[q]. INDIRECT: y is
    read at this window + y_delta[0] * 16 bytes (a CUDA graph then serves any y: module docstring)."""
    pid = tl.program_id(0)
    q = pid // C
    s = pid - q * C
    if s < tl.load(win_ptr + counts_w + q):
        if INDIRECT:  # y_ptr is this window as fp32
            src = y_ptr + tl.load(y_delta_ptr) * 4 + pid.to(tl.int64) * y_s0
        else:
            src = y_ptr + pid.to(tl.int64) * y_s0
        dst = (_peer(win_ptr, delta_ptr, q) + back_w).to(tl.pointer_type(tl.float32)) + (me * C + s).to(tl.int64) * H
        cols = tl.arange(0, BLOCK)
        for c0 in range(0, H, BLOCK):
            c = c0 + cols
            tl.store(dst + c, tl.load(src + c, mask=c < H), mask=c < H)


@triton.jit
def _clock(USE_TIMER: tl.constexpr):
    if USE_TIMER:
        return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False,
                                         pack=1)
    else:
        return tl.full([], 0, tl.int64)


@triton.jit
def p2p_barrier_kernel(win_ptr, delta_ptr, epoch_ptr, status_ptr, me, P, flags_w, limit,
                       PHASE: tl.constexpr, USE_TIMER: tl.constexpr):
    """Grid (1,). PHASE 1 signals, 2 waits, 3 both. `limit`: ns with USE_TIMER, else spins."""
    if PHASE & 1:
        epoch = tl.load(epoch_ptr) + 1
        tl.store(epoch_ptr, epoch)
        if USE_TIMER:  # CUDA: order this GPU's earlier writes to the peers (the push kernel's) before the flags
            tl.inline_asm_elementwise("fence.sc.sys;\n\tmov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False,
                                      pack=1)
        for r in range(P):
            tl.atomic_xchg(_peer(win_ptr, delta_ptr, r) + flags_w + me, epoch, sem="release", scope="sys")
    else:
        epoch = tl.load(epoch_ptr)
    if PHASE & 2:
        start = _clock(USE_TIMER)
        spins = 0
        for r in range(P):
            seen = tl.atomic_add(win_ptr + flags_w + r, 0, sem="acquire", scope="sys")
            while seen < epoch:
                spins += 1
                if USE_TIMER:
                    waited = _clock(USE_TIMER) - start
                else:
                    waited = spins
                if waited > limit:
                    tl.store(status_ptr, 1)
                    seen = epoch  # give up on this peer (status says so)
                else:
                    seen = tl.atomic_add(win_ptr + flags_w + r, 0, sem="acquire", scope="sys")


def push_rows(send: torch.Tensor, meta: torch.Tensor, window, layout, capacity: int, block: int = 1024) -> None:
    """Copy this rank's send blocks ([P*C, row_bytes] uint8, padded by ep_kernels.pack) into the peers' recv.

    meta: ep_kernels.plan's buffer for these tokens (its send counts say which slots hold tokens).
    """
    P = window.size
    row_w, tail_w = layout.row_bytes // 4, layout.w_offset // 4
    if P * capacity == 0:
        return
    p2p_push_rows_kernel[(P * capacity,)](
        send.view(torch.int32), window.words, window.deltas, meta, window.rank, capacity, row_w, tail_w,
        DATA_OFFSET // 4, COUNTS_OFFSET // 4,
        BLOCK=min(block, triton.next_power_of_2(row_w)), TAIL=triton.next_power_of_2(row_w - tail_w), num_warps=4)


def push_partials(y: torch.Tensor, window, capacity: int, back_offset: int, y_delta: Optional[torch.Tensor] = None,
                  block: int = 1024) -> None:
    """Send the partial outputs y [P*C, H] fp32 (unit stride along H) of the rows received here home,
    into block `me` of each source's back region (at byte `back_offset` of every window).

    y_delta: None reads y where it is; else a [1] int64 device tensor holding
    (y's address - the window's) / 16, read by the kernel when it runs (y must then have
    row stride H): a captured launch serves whatever y the tensor points at on replay.
    """
    P, H = window.size, y.shape[1]
    if P * capacity == 0 or H == 0:
        return
    indirect = y_delta is not None
    p2p_push_partials_kernel[(P * capacity,)](
        window.words.view(torch.float32) if indirect else y, window.words, window.deltas, y_delta if indirect else window.deltas,
        window.rank, capacity, H, H if indirect else y.stride(0), back_offset // 4, COUNTS_OFFSET // 4,
        BLOCK=min(block, triton.next_power_of_2(H)), INDIRECT=indirect, num_warps=4)


def barrier(window, phase: int = 3) -> None:
    """All ranks of the window's group meet (see the module docstring); phase 1/2 split it (tests)."""
    use_timer = window.words.device.type == "cuda"
    limit = int(window.timeout_s * 1e9) if use_timer else window.spin_limit
    p2p_barrier_kernel[(1,)](window.words, window.deltas, window.epoch, window.status, window.rank, window.size,
                             FLAGS_OFFSET // 4, limit, PHASE=phase, USE_TIMER=use_timer, num_warps=1)

"""`p2p_all_to_all`: the fixed-capacity exchange through peer-mapped GPU memory (one host).

The same contract and buffers as `static_all_to_all` (C = max_tokens_per_rank rows per
(source, destination) pair, padding rows in empty slots, static shapes, no host sync,
CUDA-graph capturable, bit-identical results), but no NCCL: every rank maps the other
ranks' windows (peer_memory.py) and Triton kernels (p2p_kernels.py) write straight into
them, then meet in a barrier kernel:

    dispatch: plan + pack (ep_kernels) -> push rows into each destination's recv -> barrier
    combine:  push the partial outputs home into each source's back -> barrier -> combine (ep_kernels)

Only slots that hold a token move their whole row (a padding slot moves its weights and ids,
a few dozen bytes), so the bytes on the links follow the routing, not the capacity, and
there is no collective's host cost: about 7 launches per dispatch + combine, one graph
replay when captured.

Needs: CUDA, Triton, every rank of the group on one host with peer access between the
GPUs (`peer_memory="auto"` tries torch symmetric memory, then CUDA IPC; PeerWindow).
The experts' view of the received rows (Dispatched.x, ...) is the window itself: it is
valid until the next dispatch. One dispatch at a time per window: dispatch twice without
combine raises (the second would overwrite rows a peer may still read). A peer that stops
taking part makes the others' barrier give up after ParallelConfig.timeout_s, and
`check_health()` then raises; results after that are invalid.
"""

from __future__ import annotations

from typing import Optional

import torch

from .base import Dispatched
from .config import ParallelConfig
from .ep_common import check_no_grad, unpack_rows
from .peer_memory import MAX_RANKS, PEER_MEMORY, PeerWindow, open_window, regions
from .static_a2a import StaticAllToAllDispatcher, StaticHandle

__all__ = ["P2PAllToAllDispatcher"]


class P2PAllToAllDispatcher(StaticAllToAllDispatcher):
    """Fixed-capacity exchange through peer-mapped memory (see the module docstring).

    Args (beyond the other dispatchers'):
        peer_memory: "auto" | "symmetric" | "ipc": how the peers' windows are mapped (None:
            ParallelConfig.peer_memory).
    """

    name = "p2p_all_to_all"

    def __init__(self, parallel: ParallelConfig, num_experts: int, top_k: int, kernels: str = "auto",
                 kernel_config=None, peer_memory: Optional[str] = None) -> None:
        if kernels == "torch":
            raise ValueError("p2p_all_to_all moves rows with Triton kernels over peer-mapped GPU memory; "
                             "kernels='torch' cannot serve it (use 'static_all_to_all' for the torch path)")
        peer_memory = parallel.peer_memory if peer_memory is None else peer_memory
        if peer_memory not in PEER_MEMORY:
            raise ValueError(f"peer_memory must be one of {list(PEER_MEMORY)}, got {peer_memory!r}")
        super().__init__(parallel, num_experts, top_k, kernels, kernel_config)
        if self.size > MAX_RANKS:
            raise ValueError(f"p2p_all_to_all serves at most {MAX_RANKS} ranks, got ep_size={self.size}")
        self.peer_memory = peer_memory
        self._windows = {}

    def _kernels(self, x: torch.Tensor):
        kern = self.triton_for(x)
        if kern is None:
            raise ValueError("p2p_all_to_all needs CUDA tensors and Triton (`pip install moekit[gpu]`), "
                             f"got x on {x.device}; use 'static_all_to_all' elsewhere")
        from . import p2p_kernels  # noqa: PLC0415 (needs Triton, present once triton_for answered)

        return kern, p2p_kernels

    def window(self, device: torch.device, layout) -> PeerWindow:
        """This rank's window for rows of `layout` (a collective on first use per shape)."""
        nbytes = regions(self.size, self.capacity, layout)[2]
        key = (str(device), nbytes)
        if key not in self._windows:
            self._windows[key] = open_window(nbytes, self.group, self.rank, self.size, device, self.peer_memory,
                                             self.parallel.timeout_s)
        return self._windows[key]

    def check_health(self) -> None:
        """Raise if a barrier of this dispatcher's windows gave up on a peer (a host read)."""
        for win in self._windows.values():
            win.check_health()

    # The steps of dispatch and combine, on an explicit window (tests play several ranks with them).
    def send(self, x, topk_weights, topk_ids, win: PeerWindow) -> StaticHandle:
        """Plan, pack and push this rank's rows into the destinations' windows."""
        kern, p2p = self._kernels(x)
        T, H = x.shape
        k, P, C = topk_ids.shape[1], self.size, self.capacity
        owner, _ = self.tables(x.device)
        layout = self.layout(H, x.dtype, k)
        pad_ids = self.cached(("pad_ids", x.device), lambda: self._pad_ids_cpu.to(x.device))
        meta = torch.empty(kern.meta_size(P, T), dtype=torch.int32, device=x.device)
        kern.plan(topk_ids, owner, P, meta, self._kernel_config)
        send = torch.empty((P * C, layout.row_bytes), dtype=torch.uint8, device=x.device)
        kern.pack(x, topk_weights, topk_ids, meta, layout, send, P, C, pad_ids, self._kernel_config)
        p2p.push_rows(send, meta, win, layout, C)
        return StaticHandle(T, meta=meta)

    def received(self, win: PeerWindow, layout) -> tuple:
        """Views of the rows pushed here: x [P*C, H], weights [P*C, k], ids [P*C, k]."""
        recv, _, _ = regions(self.size, self.capacity, layout)
        n = self.size * self.capacity
        rows = win.bytes()[recv:recv + n * layout.row_bytes].view(n, layout.row_bytes)
        return unpack_rows(rows, layout)

    def give_back(self, y: torch.Tensor, win: PeerWindow, layout) -> None:
        """Push the partial outputs of the rows received here home."""
        _, p2p = self._kernels(y)
        p2p.push_partials(y, win, self.capacity, regions(self.size, self.capacity, layout)[1])

    def gather(self, handle: StaticHandle, win: PeerWindow, layout) -> torch.Tensor:
        """Sum each token's partials from this rank's back region: [T, H] fp32."""
        kern = self._triton
        _, back, _ = regions(self.size, self.capacity, layout)
        n, H = self.size * self.capacity, layout.hidden_size
        partials = win.bytes()[back:back + n * H * 4].view(torch.float32).view(n, H)
        out = torch.empty((handle.num_tokens, H), dtype=torch.float32, device=partials.device)
        kern.combine(partials, handle.meta, self.size, self.capacity, out, self._kernel_config)
        return out

    def dispatch(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> Dispatched:
        """x [T, H] (T <= capacity), topk_weights [T, k] fp32, topk_ids [T, k] -> [P*C, ..] rows to compute here."""
        check_no_grad(x, "x")
        T, H = x.shape
        if T > self.capacity:
            raise ValueError(
                f"p2p_all_to_all: this rank got {T} tokens, more than its capacity "
                f"max_tokens_per_rank={self.capacity}; raise max_tokens_per_rank")
        _, p2p = self._kernels(x)
        layout = self.layout(H, x.dtype, topk_ids.shape[1])
        win = self.window(x.device, layout)
        if win.in_flight:
            raise RuntimeError("p2p_all_to_all: dispatch called again before the previous dispatch's combine; "
                               "its rows would overwrite rows a peer may still be reading")
        handle = self.send(x, topk_weights, topk_ids, win)
        p2p.barrier(win)
        win.in_flight = True
        x_r, w_r, ids_r = self.received(win, layout)
        _, emap = self.tables(x.device)
        return Dispatched(x_r, w_r, ids_r, emap, (handle, win, layout))

    def combine(self, y: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        """y [P*cap, H] weighted partial outputs -> [T, H] fp32 for this rank's tokens."""
        check_no_grad(y, "the experts' output")
        handle, win, layout = dispatched.handle
        _, p2p = self._kernels(y)
        self.give_back(y.float().contiguous(), win, layout)
        p2p.barrier(win)
        win.in_flight = False
        return self.gather(handle, win, layout)

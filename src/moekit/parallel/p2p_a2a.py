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

Eager calls replay CUDA graphs. A Triton launch costs tens of microseconds of host time, more
than the copies take below a few thousand tokens, so outside a CUDA graph capture the
dispatcher keeps, per token count T (the last `eager_graphs` of them), static inputs and two
graphs: dispatch copies x, weights and ids into the static inputs and replays one graph
(plan, pack, push, barrier); combine points the graph at y (a device value holding y's
address, set by one small fill, so y is not copied) and replays the other (push, barrier,
combine), returning a copy of its output. The first call of a T runs the same kernels on the
same tensors directly (that builds them), the second captures. Every path makes exactly one
barrier per dispatch and per combine, so ranks may take different paths.

Needs: CUDA, Triton, every rank of the group on one host with peer access between the
GPUs (`peer_memory="auto"` tries torch symmetric memory, then CUDA IPC; PeerWindow).
The experts' view of the received rows (Dispatched.x, ...) is the window itself: it is
valid until the next dispatch. One dispatch at a time per window: dispatch twice without
combine raises (the second would overwrite rows a peer may still read). A peer that stops
taking part makes the others' barrier give up after ParallelConfig.timeout_s, and
`check_health()` then raises; results after that are invalid.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional

import torch

from .base import Dispatched
from .config import ParallelConfig
from .ep_common import check_no_grad, unpack_rows
from .peer_memory import MAX_RANKS, PEER_MEMORY, PeerWindow, open_window, regions
from .static_a2a import StaticAllToAllDispatcher, StaticHandle

__all__ = ["P2PAllToAllDispatcher"]

_GATHER_IN_GRAPH_BYTES = 16 << 20  # outputs smaller than this are summed inside the combine graph


@dataclass
class _Replay:
    """The static tensors and CUDA graphs of one token count (see the module docstring)."""

    x: torch.Tensor  # [T, H] static inputs
    w: torch.Tensor  # [T, k] fp32
    ids: torch.Tensor  # [T, k] int32
    handle: StaticHandle  # its meta is static too
    y_delta: torch.Tensor  # [1] int64: (y's address - the window's) / 16
    y_delta_value: Optional[int] = None  # what y_delta holds
    out: Optional[torch.Tensor] = None  # the combine graph's output
    dispatch_graph: Optional[torch.cuda.CUDAGraph] = None
    combine_graph: Optional[torch.cuda.CUDAGraph] = None
    dispatch_runs: int = 0
    combine_runs: int = 0


class P2PAllToAllDispatcher(StaticAllToAllDispatcher):
    """Fixed-capacity exchange through peer-mapped memory (see the module docstring).

    Args (beyond the other dispatchers'):
        peer_memory: "auto" | "symmetric" | "ipc": how the peers' windows are mapped (None:
            ParallelConfig.peer_memory).
        eager_graphs: token counts whose eager calls replay CUDA graphs (0: launch the
            kernels on every call); the least recently used count beyond it is dropped.
    """

    name = "p2p_all_to_all"

    def __init__(self, parallel: ParallelConfig, num_experts: int, top_k: int, kernels: str = "auto",
                 kernel_config=None, peer_memory: Optional[str] = None, eager_graphs: int = 16) -> None:
        if kernels == "torch":
            raise ValueError("p2p_all_to_all moves rows with Triton kernels over peer-mapped GPU memory; "
                             "kernels='torch' cannot serve it (use 'static_all_to_all' for the torch path)")
        peer_memory = parallel.peer_memory if peer_memory is None else peer_memory
        if peer_memory not in PEER_MEMORY:
            raise ValueError(f"peer_memory must be one of {list(PEER_MEMORY)}, got {peer_memory!r}")
        super().__init__(parallel, num_experts, top_k, kernels, kernel_config)
        if self.size > MAX_RANKS:
            raise ValueError(f"p2p_all_to_all serves at most {MAX_RANKS} ranks, got ep_size={self.size}")
        if isinstance(eager_graphs, bool) or not isinstance(eager_graphs, int) or eager_graphs < 0:
            raise ValueError(f"eager_graphs must be an int >= 0, got {eager_graphs!r}")
        self.peer_memory = peer_memory
        self.eager_graphs = eager_graphs
        self._windows = {}
        self._replays: "OrderedDict[tuple, _Replay]" = OrderedDict()
        self._pool = None

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
    def send(self, x, topk_weights, topk_ids, win: PeerWindow, meta: Optional[torch.Tensor] = None) -> StaticHandle:
        """Plan, pack and push this rank's rows into the destinations' windows (meta: the plan's buffer,
        None for a new one)."""
        kern, p2p = self._kernels(x)
        T, H = x.shape
        k, P, C = topk_ids.shape[1], self.size, self.capacity
        owner, _ = self.tables(x.device)
        layout = self.layout(H, x.dtype, k)
        pad_ids = self.cached(("pad_ids", x.device), lambda: self._pad_ids_cpu.to(x.device))
        if meta is None:
            meta = torch.empty(kern.meta_size(P, T), dtype=torch.int32, device=x.device)
        kern.plan(topk_ids, owner, P, meta, self._kernel_config)
        send = torch.empty((P * C, layout.row_bytes), dtype=torch.uint8, device=x.device)
        kern.pack(x, topk_weights, topk_ids, meta, layout, send, P, C, pad_ids, self._kernel_config)
        p2p.push_rows(send, meta, win, layout, C)
        return StaticHandle(T, meta=meta)

    def received(self, win: PeerWindow, layout) -> tuple:
        """Views of the rows pushed here: x [P*C, H], weights [P*C, k], ids [P*C, k]."""
        def views():
            recv, _, _ = regions(self.size, self.capacity, layout)
            n = self.size * self.capacity
            return unpack_rows(win.bytes()[recv:recv + n * layout.row_bytes].view(n, layout.row_bytes), layout)

        return self.cached(("received", id(win), layout.hidden_size, layout.dtype, layout.top_k), views)

    def give_back(self, y: torch.Tensor, win: PeerWindow, layout, y_delta: Optional[torch.Tensor] = None) -> None:
        """Push the partial outputs of the rows received here home (y_delta: p2p_kernels.push_partials)."""
        _, p2p = self._kernels(y)
        p2p.push_partials(y, win, self.capacity, regions(self.size, self.capacity, layout)[1], y_delta)

    def gather(self, handle: StaticHandle, win: PeerWindow, layout) -> torch.Tensor:
        """Sum each token's partials from this rank's back region: [T, H] fp32."""
        kern = self._triton
        _, back, _ = regions(self.size, self.capacity, layout)
        n, H = self.size * self.capacity, layout.hidden_size
        partials = win.bytes()[back:back + n * H * 4].view(torch.float32).view(n, H)
        out = torch.empty((handle.num_tokens, H), dtype=torch.float32, device=partials.device)
        kern.combine(partials, handle.meta, self.size, self.capacity, out, self._kernel_config)
        return out

    def _replay_for(self, x: torch.Tensor, k: int) -> Optional[_Replay]:
        """The _Replay of x's token count, or None when eager calls launch directly (module docstring)."""
        if not self.eager_graphs or x.device.type != "cuda" or torch.cuda.is_current_stream_capturing():
            return None
        T, H = x.shape
        key = (T, H, x.dtype, k, str(x.device))
        rep = self._replays.get(key)
        if rep is None:
            kern = self._triton
            dev = x.device
            rep = _Replay(torch.empty((T, H), dtype=x.dtype, device=dev), torch.empty((T, k), device=dev),
                          torch.empty((T, k), dtype=torch.int32, device=dev),
                          StaticHandle(T, meta=torch.empty(kern.meta_size(self.size, T), dtype=torch.int32,
                                                           device=dev)),
                          torch.zeros(1, dtype=torch.int64, device=dev))
            self._replays[key] = rep
            while len(self._replays) > self.eager_graphs:
                self._replays.popitem(last=False)
        self._replays.move_to_end(key)
        return rep

    def _graph(self, steps) -> torch.cuda.CUDAGraph:
        """Capture steps() (this rank's kernels only: nothing runs, nobody waits) into a new graph."""
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            steps()
        return graph

    def dispatch(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> Dispatched:
        """x [T, H] (T <= capacity), topk_weights [T, k] fp32, topk_ids [T, k] -> [P*C, ..] rows to compute here."""
        check_no_grad(x, "x")
        check_no_grad(topk_weights, "topk_weights (the routing weights: a trainable gate or router)")
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
        rep = self._replay_for(x, topk_ids.shape[1])
        if rep is None:
            handle = self.send(x, topk_weights, topk_ids, win)
            p2p.barrier(win)
        else:
            rep.x.copy_(x)
            rep.w.copy_(topk_weights)
            rep.ids.copy_(topk_ids)

            def steps():
                self.send(rep.x, rep.w, rep.ids, win, rep.handle.meta)
                p2p.barrier(win)

            if rep.dispatch_graph is None and rep.dispatch_runs:
                rep.dispatch_graph = self._graph(steps)
            if rep.dispatch_graph is None:
                steps()
            else:
                rep.dispatch_graph.replay()
            rep.dispatch_runs += 1
            handle = rep.handle
        win.in_flight = True
        x_r, w_r, ids_r = self.received(win, layout)
        _, emap = self.tables(x.device)
        return Dispatched(x_r, w_r, ids_r, emap, (handle, win, layout, rep))

    def combine(self, y: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        """y [P*cap, H] weighted partial outputs -> [T, H] fp32 for this rank's tokens."""
        check_no_grad(y, "the experts' output")
        handle, win, layout, rep = dispatched.handle
        _, p2p = self._kernels(y)
        y = y.float().contiguous()
        if rep is None:
            self.give_back(y, win, layout)
            p2p.barrier(win)
            win.in_flight = False
            return self.gather(handle, win, layout)
        if (y.data_ptr() - win.words.data_ptr()) % 16:
            y = y.clone()  # the kernel finds y in 16-byte steps from the window (fresh tensors are aligned)
        delta = (y.data_ptr() - win.words.data_ptr()) // 16
        if delta != rep.y_delta_value:  # steady state: the allocator hands the experts the same block
            rep.y_delta.fill_(delta)
            rep.y_delta_value = delta
        # A large output is summed by a direct launch into a fresh tensor (its host cost hides behind
        # the copies); a small one inside the graph, then copied out of the graph's buffer.
        in_graph = handle.num_tokens * layout.hidden_size * 4 < _GATHER_IN_GRAPH_BYTES

        def steps():
            self.give_back(y, win, layout, rep.y_delta)
            p2p.barrier(win)
            if in_graph:
                rep.out = self.gather(handle, win, layout)

        if rep.combine_graph is None and rep.combine_runs:
            rep.combine_graph = self._graph(steps)
            rep.combine_graph.replay()
        elif rep.combine_graph is None:
            steps()
        else:
            rep.combine_graph.replay()
        rep.combine_runs += 1
        win.in_flight = False
        return rep.out.clone() if in_graph else self.gather(handle, win, layout)

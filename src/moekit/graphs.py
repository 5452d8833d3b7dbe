"""Eager calls that replay CUDA graphs: FusedMoE(..., eager_graphs=N).

Launching kernels one by one costs host time per launch, Triton's most of all (tens of
microseconds on a busy host). A decode step runs a dozen kernels on a few tokens, so eager
decode is host-bound: the GPU idles while Python launches. Engines capture whole models in CUDA
graphs; code that calls a layer eagerly (a transformers model's generate, say) cannot.
EagerGraphs does it per layer. It keeps, for each input signature (shapes, dtypes, device) of
the last N seen, static input tensors and a graph of the call:

    first call of a signature   the call runs directly, on the static inputs (that builds the
                                kernels and runs the host-side checks once);
    second call                 the call is captured into a graph (nothing runs), then replayed;
    later calls                 inputs are copied into the static ones and the graph replays;
                                the caller gets a copy of the graph's output.

Calls of more than max_tokens rows (1024) run directly: the GPU sets their time. A graph
replays what was captured, so it is used only where that is the call: CUDA tensors,
autograd off (torch.no_grad / inference_mode), no capture or torch.compile already running,
and a dispatcher with no host synchronisation (Dispatcher.graph_safe). A graph reads the
weights where they were at capture: in-place updates (load_weights, EPLB's rearrangement
copies) are seen by the next replay, and tensors that move (new storage) drop every graph.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Tuple

import torch

from .checks import cuda_capturing

__all__ = ["EagerGraphs"]


@dataclass
class _Entry:
    inputs: Tuple[torch.Tensor, ...]
    graph: Optional[torch.cuda.CUDAGraph] = None
    out: Optional[torch.Tensor] = None
    runs: int = 0


class EagerGraphs:
    """CUDA graphs of a call for the last `max_graphs` input signatures (see the module docstring).

    Holds no reference to what it calls (a module keeps one, and copies or pickles of that module
    start with no graphs: CUDA graphs neither copy nor pickle).

    Args:
        max_graphs: signatures kept (least recently used dropped); 0 turns the replays off.
        max_tokens: calls whose first input has more rows run directly (prefill: the GPU, not
            the host, sets their time, and their static inputs would hold memory).
    """

    def __init__(self, max_graphs: int, max_tokens: int = 1024) -> None:
        if isinstance(max_graphs, bool) or not isinstance(max_graphs, int) or max_graphs < 0:
            raise ValueError(f"eager_graphs must be an int >= 0, got {max_graphs!r}")
        self.max_graphs, self.max_tokens = max_graphs, max_tokens
        self._entries: "OrderedDict[tuple, _Entry]" = OrderedDict()
        self._storage: Optional[tuple] = None

    def __getstate__(self):
        return {"max_graphs": self.max_graphs, "max_tokens": self.max_tokens}

    def __setstate__(self, state) -> None:
        self.__init__(state["max_graphs"], state["max_tokens"])

    def usable(self, inputs: Sequence[torch.Tensor]) -> bool:
        """Whether this call can replay a graph (module docstring); else run the call directly."""
        return (self.max_graphs > 0 and inputs[0].device.type == "cuda" and inputs[0].shape[0] <= self.max_tokens
                and not torch.is_grad_enabled() and not cuda_capturing(inputs[0]) and not torch.compiler.is_compiling())

    def __len__(self) -> int:
        return sum(1 for e in self._entries.values() if e.graph is not None)

    def clear(self) -> None:
        """Drop every graph and static input."""
        self._entries.clear()

    def run(self, fn: Callable[..., torch.Tensor], storage: tuple, *inputs: torch.Tensor) -> torch.Tensor:
        """fn(*inputs), replayed from a graph when this signature was seen before.

        Args:
            fn: tensors -> one tensor, replayable (no host synchronisation, no data-dependent shapes).
            storage: what fn reads besides its inputs (the weights' addresses, ...); a change
                drops every graph.
        """
        if storage != self._storage:
            self._entries.clear()
            self._storage = storage
        key = tuple((tuple(t.shape), t.dtype, str(t.device)) for t in inputs)
        entry = self._entries.get(key)
        if entry is None:
            entry = _Entry(tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in inputs))
            self._entries[key] = entry
            while len(self._entries) > self.max_graphs:
                self._entries.popitem(last=False)
        self._entries.move_to_end(key)
        for static, t in zip(entry.inputs, inputs):
            static.copy_(t)
        entry.runs += 1
        if entry.graph is None and entry.runs == 1:
            return fn(*entry.inputs)
        if entry.graph is None:  # a memory pool of its own: nothing it keeps is another graph's scratch
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                entry.out = fn(*entry.inputs)
            entry.graph = graph
        entry.graph.replay()
        return entry.out.clone()

"""Dispatchers by name, and the builder FusedMoE uses."""

from __future__ import annotations

from typing import Dict, Type

from .allgather import AllGatherReduceScatterDispatcher
from .all_to_all import AllToAllDispatcher
from .base import Dispatcher, LocalDispatcher
from .config import ParallelConfig
from .p2p_a2a import P2PAllToAllDispatcher
from .static_a2a import StaticAllToAllDispatcher
from .tensor_parallel import AllReduceDispatcher

__all__ = ["DISPATCHERS", "build_dispatcher"]

DISPATCHERS: Dict[str, Type[Dispatcher]] = {
    cls.name: cls
    for cls in (LocalDispatcher, AllToAllDispatcher, AllGatherReduceScatterDispatcher, StaticAllToAllDispatcher,
                P2PAllToAllDispatcher, AllReduceDispatcher)
}


def build_dispatcher(parallel: ParallelConfig, num_experts: int, top_k: int) -> Dispatcher:
    """The dispatcher `parallel` selects, for E = num_experts global experts and k = top_k."""
    name = parallel.dispatcher_name
    if name == "local":
        return LocalDispatcher()
    if name == "all_reduce":
        return AllReduceDispatcher(parallel)
    return DISPATCHERS[name](parallel, num_experts, top_k)

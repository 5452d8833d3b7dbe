"""Expert parallelism: dispatchers over torch.distributed."""

from .allgather import AllGatherReduceScatterDispatcher
from .all_to_all import AllToAllDispatcher
from .base import Dispatched, Dispatcher, LocalDispatcher
from .config import ParallelConfig
from .placement import expert_map, expert_owner, local_experts
from .registry import DISPATCHERS, build_dispatcher
from .static_a2a import StaticAllToAllDispatcher
from .tensor_parallel import AllReduceDispatcher

__all__ = [
    "Dispatched",
    "Dispatcher",
    "LocalDispatcher",
    "ParallelConfig",
    "AllToAllDispatcher",
    "AllGatherReduceScatterDispatcher",
    "StaticAllToAllDispatcher",
    "AllReduceDispatcher",
    "DISPATCHERS",
    "build_dispatcher",
    "expert_map",
    "expert_owner",
    "local_experts",
]

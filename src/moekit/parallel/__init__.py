"""Expert parallelism and tensor parallelism of I for FusedMoE, over torch.distributed.

    torch.distributed.init_process_group("nccl")          # or "gloo" on CPU; under torchrun
    layer = FusedMoE(E, H, I, routing, device="cuda",
                     parallel=ParallelConfig.expert_parallel(dispatcher="all_to_all"))
    layer.load_weights(w13, w2)                            # full [E, ..] tensors or this rank's
    with torch.no_grad():
        out = layer(x, router_logits)                      # this rank's tokens -> [T, H]

Every rank gets exactly the single-process layer's output for its own tokens (any T per
rank, zero included). Dispatchers (parallel/<name>.py): "all_to_all" (dynamic, default),
"allgather_reducescatter", "static_all_to_all" (fixed capacity, CUDA-graph capturable
decode path), "p2p_all_to_all" (the same contract through peer-mapped GPU memory on one
host: no NCCL, bytes that follow the routing) and, for ParallelConfig.tensor_parallel, "all_reduce". Inference only: the
collectives carry no gradients, and a forward that autograd records is refused.
examples/ep_torchrun.py runs and checks all of them; bench/ep_nccl.py times them.
"""

from .allgather import AllGatherReduceScatterDispatcher
from .all_to_all import AllToAllDispatcher
from .base import Dispatched, Dispatcher, LocalDispatcher
from .config import ParallelConfig
from .placement import expert_map, expert_owner, local_experts
from .registry import DISPATCHERS, build_dispatcher
from .p2p_a2a import P2PAllToAllDispatcher
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
    "P2PAllToAllDispatcher",
    "AllReduceDispatcher",
    "DISPATCHERS",
    "build_dispatcher",
    "expert_map",
    "expert_owner",
    "local_experts",
]

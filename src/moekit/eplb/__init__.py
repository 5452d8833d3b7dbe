"""Expert-parallel load balancing (EPLB.md): policy, routing-time maps, load recorder,
state and trigger, weight rearrangement between ranks, and the asynchronous mode."""

from .enable import enable_eplb
from .maps import initial_placement, map_to_physical, maps_from_phy2log, physical_expert_map, physical_to_logical_load
from .policy import (balanced_packing, balancedness, gpu_loads, improves, preserve_slots, rebalance_experts,
                     replicate_experts)
from .rearrange import RankPlan, StagedLayer, commit_layer, exchange_layer, plan_layer, rearrange_layer
from .recorder import LoadRecorder
from .state import EplbConfig, EplbLayerHook, EplbState

__all__ = [
    "enable_eplb",
    "EplbConfig",
    "EplbState",
    "EplbLayerHook",
    "LoadRecorder",
    "rebalance_experts",
    "balanced_packing",
    "replicate_experts",
    "preserve_slots",
    "gpu_loads",
    "balancedness",
    "improves",
    "map_to_physical",
    "initial_placement",
    "maps_from_phy2log",
    "physical_to_logical_load",
    "physical_expert_map",
    "RankPlan",
    "StagedLayer",
    "plan_layer",
    "exchange_layer",
    "commit_layer",
    "rearrange_layer",
]

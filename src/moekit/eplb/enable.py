"""`enable_eplb`: turn FusedMoE layers into EPLB layers with redundant experts.

Each layer's RoutedExperts is resized from E logical experts to this rank's S = R / P
physical slots, every slot loaded from its logical expert's weights (replicas are exact
copies), and the runner's `eplb` hook is set so routing maps logical ids to physical slots
and records the load. The returned EplbState drives the window and the rearrangements.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Dict, List, Optional, Sequence, Union

import torch
import torch.distributed as dist
import torch.nn as nn

from ..experts.base import ExpertWeights
from ..layer import FusedMoE
from ..parallel.base import LocalDispatcher
from .maps import initial_placement, local_slots
from .state import EplbConfig, EplbState

__all__ = ["enable_eplb"]


def _resized(experts: nn.Module, logical: ExpertWeights, rows: torch.Tensor) -> Dict[str, torch.Tensor]:
    """Each per-expert tensor of `experts` rebuilt from the logical tensor's `rows` [S] (nothing assigned)."""
    given = dict(logical.per_expert_tensors())
    buffers = dict(experts.named_buffers(recurse=False))
    new = {}
    for name, current in experts.expert_weights().per_expert_tensors():
        if name not in given:
            raise ValueError(f"logical_weights has no {name!r}, which the layer holds")
        if not isinstance(current, nn.Parameter) and name not in buffers:
            raise TypeError(f"{name} is neither a parameter nor a buffer of {type(experts).__name__}; "
                            "EPLB cannot resize it")
        src = given[name].detach()
        if tuple(src.shape[1:]) != tuple(current.shape[1:]):
            raise ValueError(f"logical {name} must be [E, {', '.join(map(str, current.shape[1:]))}], "
                             f"got {tuple(src.shape)}")
        new[name] = src.index_select(0, rows.to(src.device)).to(current.device, current.dtype).contiguous()
    return new


def _assign(experts: nn.Module, new: Dict[str, torch.Tensor]) -> None:
    """Put the tensors of _resized in place of the layer's per-expert tensors."""
    for name, data in new.items():
        current = getattr(experts, name)
        if isinstance(current, nn.Parameter):
            setattr(experts, name, nn.Parameter(data, requires_grad=current.requires_grad))
        else:
            experts.register_buffer(name, data)


def _split_of(layers: List[FusedMoE]):
    """The ParallelConfig the layers share (None when not split); refuses tensor parallelism."""
    configs = []
    for i, m in enumerate(layers):
        shard = getattr(m, "shard", None)
        parallel = None if shard is None or shard.parallel.size == 1 else shard.parallel
        if parallel is not None and parallel.ep_size == 1:
            raise ValueError(f"layer {i} ({m.layer_name}) is split by tensor parallelism (tp_size="
                             f"{parallel.tp_size}); EPLB needs expert parallelism or a single process")
        if parallel is None and not isinstance(m.runner.dispatcher, LocalDispatcher):
            raise ValueError(f"layer {i} ({m.layer_name}) uses dispatcher {m.runner.dispatcher.name!r} "
                             "without a ParallelConfig; EPLB cannot place its experts")
        configs.append(parallel)
    keys = {None if c is None else (c.ep_size, id(c.group)) for c in configs}
    if len(keys) != 1:
        raise ValueError("every layer must be split the same way (one ep_size and process group), "
                         f"got {len(keys)} different splits")
    return configs[0]


def enable_eplb(layers: Union[FusedMoE, Sequence[FusedMoE]], config: EplbConfig, *,
                logical_weights: Optional[Sequence[ExpertWeights]] = None, worker_group=None) -> EplbState:
    """Give FusedMoE layers R = E + config.num_redundant physical slots and an EPLB hook.

    Single-process layers hold all R slots. Expert-parallel layers (FusedMoE(parallel=
    ParallelConfig(ep_size=P, ...))) hold R / P contiguous slots each, and their
    dispatcher is rebuilt over the R physical slots ("linear" placement).

    Args:
        layers: one FusedMoE or a sequence of them (one EplbState covers them all).
        config: EplbConfig.
        logical_weights: per layer, ExpertWeights with all E experts; default: each layer's
            own weights (it must still hold all E experts, i.e. a single-process layer).
        worker_group: see EplbState (async mode).
    Returns:
        the EplbState: call its step() after every forward step, on every rank.
    """
    if isinstance(layers, FusedMoE):
        layers = [layers]
    layers = list(layers)
    if not layers or not all(isinstance(m, FusedMoE) for m in layers):
        raise TypeError("layers must be a FusedMoE or a non-empty sequence of FusedMoE")
    if not isinstance(config, EplbConfig):
        raise TypeError(f"config must be an EplbConfig, got {type(config).__name__}")
    E = layers[0].num_experts
    for i, m in enumerate(layers):
        if m.num_experts != E:
            raise ValueError(f"every layer must have E={E} experts, layer {i} has {m.num_experts}")
        if m.runner.eplb is not None:
            raise ValueError(f"layer {i} ({m.layer_name}) already has EPLB enabled")
    if logical_weights is not None and len(logical_weights) != len(layers):
        raise ValueError(f"logical_weights must give one ExpertWeights per layer ({len(layers)}), "
                         f"got {len(logical_weights)}")
    parallel = _split_of(layers)
    group = None if parallel is None else (parallel.group or dist.group.WORLD)
    P = 1 if parallel is None else parallel.ep_size
    rank = 0 if parallel is None else parallel.ep_rank
    config.check_fits(E, P)
    R = E + config.num_redundant
    phy2log = initial_placement(len(layers), E, R)
    slots = local_slots(R, P, rank)
    resized = []  # every layer checked and built before any is changed
    for i, m in enumerate(layers):
        logical = m.experts.expert_weights() if logical_weights is None else logical_weights[i]
        if logical.num_experts != E:
            raise ValueError(f"layer {i}: logical weights must hold E={E} experts, got {logical.num_experts} "
                             "(pass logical_weights for expert-parallel or already resized layers)")
        resized.append(_resized(m.experts, logical, phy2log[i, slots.start:slots.stop]))
    for m, new in zip(layers, resized):
        _assign(m.experts, new)
    state = EplbState([m.experts.expert_weights for m in layers], E, config, group=group, phy2log=phy2log,
                      worker_group=worker_group)
    for i, m in enumerate(layers):
        if parallel is not None:
            from ..parallel.registry import build_dispatcher  # noqa: PLC0415

            m.runner.dispatcher = build_dispatcher(replace(parallel, placement="linear"), R, m.routing.top_k)
            m.expert_map = state.expert_map()
        m.runner.eplb = state.hook(i)
    return state

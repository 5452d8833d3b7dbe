"""A patched block's state_dict in the names and layout of the transformers block it replaced.

An MoEBlock holds a FusedMoE (moe.gate.weight, moe.experts.w13 [E, 2I, H], ...), but its
state_dict, and so `save_pretrained`, carries the replaced block's tensors under their
transformers names and in their layout, and `load_state_dict` takes them back:

    moe.gate.weight, moe.gate.bias    {router}.weight [E, H], {router}.bias [E]
    moe.e_score_correction_bias       the family's correction_bias ({router}.e_score_correction_bias) [E]
    moe.experts.w13, moe.experts.b13  experts.gate_up_proj [E, 2I, H], experts.gate_up_proj_bias [E, 2I]
                                      (non-gated: up_proj, up_proj_bias); transposed ([E, H, 2I])
                                      and gate/up interleaved when the block stored them so
    moe.experts.w2, moe.experts.b2    experts.down_proj [E, H, I] ([E, I, H] transposed), down_proj_bias [E, H]
    moe.shared.gate_up                {shared}.gate_proj.weight [I_s, H] and {shared}.up_proj.weight [I_s, H]
    moe.shared.down                   {shared}.down_proj.weight [H, I_s]
    moe.shared.gate                   {shared_gate}.weight [1, H]

A tensor under "moe." without such a name (quantization scales, EPLB's physical slots)
makes state_dict raise rather than write something transformers cannot read. Loading takes
the transformers names (a tensor under its FusedMoE name is loaded as it is); a missing
transformers tensor is reported under its own name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Sequence, Tuple

import torch
import torch.nn as nn

from ..activations import is_gated
from .checkpoint import deinterleave_gate_up, interleave_gate_up

__all__ = ["Rename", "renames", "save_hook", "load_pre_hook", "load_post_hook"]

_MOE = "moe."


def _same(t: torch.Tensor) -> Tuple[torch.Tensor, ...]:
    return (t,)


def _only(ts: Sequence[torch.Tensor]) -> torch.Tensor:
    return ts[0]


def _as_row(t: torch.Tensor) -> Tuple[torch.Tensor, ...]:
    return (t.view(1, -1),)


def _flat(ts: Sequence[torch.Tensor]) -> torch.Tensor:
    return ts[0].reshape(-1)


@dataclass(frozen=True)
class Rename:
    """One FusedMoE tensor and the transformers tensors it is stored as.

    Fields:
        internal: its name under the block ("moe.experts.w13").
        names: the transformers names under the block, in the order `split` returns them.
        shape: the FusedMoE tensor's shape (all E logical experts).
        split: FusedMoE tensor -> transformers tensors (views where the layout allows).
        join: transformers tensors -> FusedMoE tensor (the inverse of split).
    """

    internal: str
    names: Tuple[str, ...]
    shape: Tuple[int, ...]
    split: Callable[[torch.Tensor], Tuple[torch.Tensor, ...]] = _same
    join: Callable[[Sequence[torch.Tensor]], torch.Tensor] = _only

    def names_shapes(self) -> Dict[str, Tuple[int, ...]]:
        """transformers name -> its shape, from `shape` (nothing computed: meta tensors)."""
        parts = self.split(torch.empty(self.shape, device="meta"))
        return {n: tuple(p.shape) for n, p in zip(self.names, parts)}


def _experts_renames(moe: nn.Module, layout) -> List[Rename]:
    E, H, I = moe.num_experts, moe.hidden_size, moe.intermediate_size
    rows = 2 * I if layout.gated else I
    up = "gate_up_proj" if layout.gated else "up_proj"
    mix = layout.interleaved

    def w13_split(t):  # [E, 2I, H] -> gate_up_proj
        t = interleave_gate_up(t) if mix else t
        return (t.transpose(1, 2) if layout.transposed else t,)

    def w13_join(ts):  # gate_up_proj -> [E, 2I, H]
        t = ts[0].transpose(1, 2) if layout.transposed else ts[0]
        return (deinterleave_gate_up(t) if mix else t).contiguous()

    def w2_split(t):  # [E, H, I] -> down_proj
        return (t.transpose(1, 2) if layout.transposed else t,)

    def w2_join(ts):
        return (ts[0].transpose(1, 2) if layout.transposed else ts[0]).contiguous()

    out = [Rename("moe.experts.w13", (f"experts.{up}",), (E, rows, H), w13_split, w13_join),
           Rename("moe.experts.w2", ("experts.down_proj",), (E, H, I), w2_split, w2_join)]
    if moe.experts.b13 is not None:
        out.append(Rename("moe.experts.b13", (f"experts.{up}_bias",), (E, rows),
                          (lambda t: (interleave_gate_up(t),)) if mix else _same,
                          (lambda ts: deinterleave_gate_up(ts[0])) if mix else _only))
    if moe.experts.b2 is not None:
        out.append(Rename("moe.experts.b2", ("experts.down_proj_bias",), (E, H)))
    return out


def _shared_renames(moe: nn.Module, family) -> List[Rename]:
    sh, s, H = moe.shared, family.shared, moe.hidden_size
    I_s = sh.down.shape[1]
    if is_gated(sh.activation):
        out = [Rename("moe.shared.gate_up", (f"{s}.gate_proj.weight", f"{s}.up_proj.weight"), (2 * I_s, H),
                      lambda t: (t[:I_s], t[I_s:]), torch.cat)]
    else:
        out = [Rename("moe.shared.gate_up", (f"{s}.up_proj.weight",), (I_s, H))]
    out.append(Rename("moe.shared.down", (f"{s}.down_proj.weight",), (H, I_s)))
    if sh.gate is not None:
        out.append(Rename("moe.shared.gate", (f"{family.shared_gate}.weight",), (1, H)))
    return out


def renames(block: nn.Module) -> List[Rename]:
    """Every FusedMoE tensor of an MoEBlock with its transformers names (family and layout of the block)."""
    moe, family = block.moe, block.family
    E, H, r = moe.num_experts, moe.hidden_size, family.router
    out = [Rename("moe.gate.weight", (f"{r}.weight",), (E, H))]
    if moe.gate.bias is not None:
        out.append(Rename("moe.gate.bias", (f"{r}.bias",), (E,)))
    if moe.e_score_correction_bias is not None:
        as_row = family.correction_bias_2d  # Ernie-4.5 stores the [E] bias as [1, E]
        out.append(Rename("moe.e_score_correction_bias", (family.correction_bias,), (E,),
                          _as_row if as_row else _same, _flat if as_row else _only))
    out += _experts_renames(moe, block.layout)
    if moe.shared is not None:
        out += _shared_renames(moe, family)
    return out


@torch.no_grad()
def save_hook(block: nn.Module, state_dict: Dict[str, torch.Tensor], prefix: str, local_metadata) -> None:
    """state_dict post-hook: the block's FusedMoE tensors -> transformers names and layout, in place."""
    for rn in renames(block):
        key = prefix + rn.internal
        if key not in state_dict:
            continue
        t = state_dict.pop(key)
        if tuple(t.shape) != rn.shape:
            raise ValueError(
                f"{key} has shape {list(t.shape)}; transformers' layout of {prefix}{rn.names[0]} needs the "
                f"{list(rn.shape)} of all E={block.moe.num_experts} experts (EPLB slots or an expert-parallel "
                "part have no transformers name)")
        for name, part in zip(rn.names, rn.split(t)):
            state_dict[prefix + name] = part
    left = [k for k in state_dict if k.startswith(prefix + _MOE)]
    if left:
        raise ValueError(
            f"{left[0]} has no name in transformers' layout of the block it replaced ({block.family.name}); "
            "a patched block's state_dict holds only float router, experts and shared experts "
            "(quantized experts or EPLB state cannot be written as a transformers checkpoint)")


@torch.no_grad()
def load_pre_hook(block: nn.Module, state_dict: Dict[str, torch.Tensor], prefix: str, local_metadata, strict,
                  missing_keys: List[str], unexpected_keys: List[str], error_msgs: List[str]) -> None:
    """load_state_dict pre-hook: transformers names and layout -> the block's FusedMoE tensors, in place.

    A FusedMoE tensor whose transformers tensors are all absent stays absent (torch reports it
    missing and load_post_hook renames it); with some absent, those are the missing ones.
    """
    missing: Dict[str, Tuple[str, ...]] = {}
    for rn in renames(block):
        internal = prefix + rn.internal
        expected = rn.names_shapes()
        keys = [prefix + n for n in rn.names]
        given = [k for k in keys if k in state_dict]
        if not given:
            missing[internal] = tuple(keys)
            continue
        if internal in state_dict:
            error_msgs.append(f"both {internal} and its transformers name {given[0]} are given; pass one of them")
            continue
        tensors = [state_dict.pop(k) for k in given]
        if len(given) < len(keys):
            missing[internal] = tuple(k for k in keys if k not in given)
            continue
        wrong = [(k, tuple(t.shape), expected[n]) for k, t, n in zip(keys, tensors, rn.names)
                 if tuple(t.shape) != expected[n]]
        if wrong:  # worded as torch words its own size mismatches
            error_msgs += [f"size mismatch for {k}: copying a param with shape {got} from checkpoint, the shape in "
                           f"current model is {want}." for k, got, want in wrong]
            missing[internal] = ()  # reported here, not as missing
            continue
        state_dict[internal] = rn.join(tensors)
    block._missing_names = missing


def load_post_hook(block: nn.Module, incompatible_keys) -> None:
    """load_state_dict post-hook: report each missing FusedMoE tensor by its transformers names."""
    names, block._missing_names = block._missing_names, {}
    missing = incompatible_keys.missing_keys
    renamed = [n for key in missing for n in (names[key] if key in names else (key,))]
    missing[:] = renamed

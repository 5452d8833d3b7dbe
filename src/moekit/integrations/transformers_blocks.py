"""Whole-block replacement: swap transformers' sparse-MoE blocks for moekit FusedMoE layers.

`patch_model(model)` replaces each sparse-MoE block of the given model (router + routed
experts + shared experts) by an `MoEBlock` wrapping a FusedMoE with the family's routing,
activation, biases and shared experts. The weights are adopted, not copied, when they
already are in the canonical layout. Only the given model changes: no class, function or
global of transformers is touched.

Families reproduced exactly (ROUTING.md): Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V2,
DeepSeek-V3, MiniMax-M2, Jamba, HunYuan-V3, Laguna, Lara-mini, MiMo-V2-Flash, MiniCPM-5-MoE,
Granite-MoE, Ernie-4.5-MoE, Cohere2-MoE, GPT-OSS; and any other family whose block, router and
shared-MLP forward code is the same as one of these (comments, docstrings, annotations and
names aside), e.g. MiniMax (as Mixtral), FlexOlmo (as OLMoE), GLM-4-MoE and dots1 (as
DeepSeek-V3). Anything else with an `experts` child is refused by name, before the model is
modified.

Differences by design: moekit computes routing weights, expert outputs and the shared
experts in fp32 and casts once at the end, where transformers rounds routing weights
(Qwen, OLMoE) and partial sums to the model dtype; in bf16 the two agree within 2e-2.
`output_router_logits` is not available on patched models (the router modules that
transformers' output recorder hooks are gone), so a model configured with it is refused.

A patched model's state_dict, and so save_pretrained, keeps the replaced blocks' transformers
names and layout, and load_state_dict takes them (moekit.integrations.transformers_state):
transformers and moekit.hf.from_pretrained both read the saved folder back.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn as nn

from ..config import SharedExpertsConfig
from ..layer import FusedMoE
from ..routing import route
from .checkpoint import MoEKeys, canonical_layout
from .transformers import ExpertsLayout, activation_name, experts_layout, source_signature
from .transformers_families import FAMILIES, BlockFamily
from .transformers_state import load_post_hook, load_pre_hook, save_hook

__all__ = ["MoEBlock", "family_of", "patch_model", "moe_blocks"]


@dataclass(frozen=True)
class _Installed:
    """A family's classes in the installed transformers and their code signatures."""

    block_cls: type
    block_sig: Optional[str]
    router_sig: Optional[str]
    shared_sig: Optional[str]


_installed: Dict[str, Optional[_Installed]] = {}


def _installed_family(family: BlockFamily) -> Optional[_Installed]:
    if family.name not in _installed:
        try:
            mod = importlib.import_module(f"transformers.models.{family.module}.modeling_{family.module}")
            block_cls = getattr(mod, family.block)
            router_cls = getattr(mod, family.router_cls)
            shared_cls = getattr(mod, family.shared_cls) if family.shared_cls else None
        except (ImportError, AttributeError):
            _installed[family.name] = None
        else:
            _installed[family.name] = _Installed(
                block_cls, source_signature(block_cls.forward), source_signature(router_cls.forward),
                None if shared_cls is None else source_signature(shared_cls.forward))
    return _installed[family.name]


def _same_code(module: Optional[nn.Module], sig: Optional[str]) -> bool:
    return module is not None and sig is not None and source_signature(type(module).forward) == sig


def family_of(block: nn.Module) -> Optional[BlockFamily]:
    """The BlockFamily whose structure `block` has (its class, or a code-identical clone), or None."""
    cls = type(block)
    for family in FAMILIES:
        inst = _installed_family(family)
        if inst is not None and cls is inst.block_cls:
            return family
    sig = source_signature(cls.forward)
    for family in FAMILIES:
        inst = _installed_family(family)
        if inst is None or sig is None or sig != inst.block_sig:
            continue
        if not _same_code(getattr(block, family.router, None), inst.router_sig):
            continue
        if family.shared and not _same_code(getattr(block, family.shared, None), inst.shared_sig):
            continue
        return family
    return None


class MoEBlock(nn.Module):
    """A transformers sparse-MoE block replaced by a FusedMoE; same call and return contract.

    forward(hidden_states [B, S, H]) -> [B, S, H], or (that, router_scores [B*S, k]) for the
    families whose block returns the scores (gpt-oss). state_dict (and so save_pretrained) and
    load_state_dict use the replaced block's transformers names and layout
    (moekit.integrations.transformers_state).
    """

    def __init__(self, moe: FusedMoE, family: BlockFamily, layout: ExpertsLayout, jitter_noise: float = 0.0) -> None:
        super().__init__()
        self.moe = moe
        self.family = family
        self.layout = layout
        self.jitter_noise = jitter_noise
        self._missing_names: Dict[str, Tuple[str, ...]] = {}  # load_pre_hook -> load_post_hook
        self.register_state_dict_post_hook(save_hook)
        self.register_load_state_dict_pre_hook(load_pre_hook)
        self.register_load_state_dict_post_hook(load_post_hook)

    def checkpoint_keys(self, name: str) -> MoEKeys:
        """Where this block's tensors live in a transformers checkpoint, given its module name."""
        prefixes = [name + "."]
        if self.family.legacy_block and "." in name:
            prefixes.append(name.rsplit(".", 1)[0] + "." + self.family.legacy_block + ".")
        return MoEKeys(tuple(prefixes), router=self.family.router, correction_bias=self.family.correction_bias,
                       correction_bias_2d=self.family.correction_bias_2d, shared=self.family.shared,
                       shared_gate=self.family.shared_gate, transposed=self.layout.transposed,
                       interleaved=self.layout.interleaved)

    def forward(self, hidden_states: torch.Tensor):
        if self.training and self.jitter_noise > 0:
            raise RuntimeError(
                f"{self.moe.layer_name}: router jitter noise (training mode, jitter_noise={self.jitter_noise}) "
                "is not reproduced by moekit; call model.eval()")
        out = self.moe(hidden_states)
        if not self.family.returns_scores:
            return out
        return out, self._router_scores(hidden_states).to(hidden_states.dtype)

    def _router_scores(self, x: torch.Tensor) -> torch.Tensor:
        """The routing weights [T, k] of this call (the runner keeps the last chunk's)."""
        T = x.numel() // x.shape[-1]
        last = self.moe.runner.last_topk
        if last is not None and last.weights.shape[0] == T:
            return last.weights
        gate = self.moe.gate
        dt = self.moe.router_dtype or x.dtype
        x2 = x.reshape(T, -1).to(dt)
        logits = nn.functional.linear(x2, gate.weight.to(dt), None if gate.bias is None else gate.bias.to(dt))
        return route(logits, self.moe.routing, self.moe.e_score_correction_bias).weights

    def extra_repr(self) -> str:
        return f"family={self.family.name}"


def _adopt(module: nn.Module, attr: str, tensor: torch.Tensor, like: torch.Tensor) -> None:
    """Make `tensor` the module's parameter `attr` (the same object when it is a Parameter)."""
    if not isinstance(tensor, nn.Parameter):
        tensor = nn.Parameter(tensor.detach(), requires_grad=like.requires_grad)
    setattr(module, attr, tensor)


def _check(owner: str, what: str, t: Optional[torch.Tensor], shape) -> torch.Tensor:
    if t is None or tuple(t.shape) != tuple(shape):
        got = None if t is None else list(t.shape)
        raise ValueError(f"{owner}: {what} must have shape {list(shape)}, got {got}")
    return t


def _shared_mlp(block: nn.Module, family: BlockFamily, owner: str):
    """SharedExpertsConfig and (gate_up [2I_s, H], down [H, I_s], gate [1, H] or None) of the block."""
    mlp = getattr(block, family.shared)
    for lin in (mlp.gate_proj, mlp.up_proj, mlp.down_proj):
        if lin.bias is not None:
            raise ValueError(f"{owner}: shared experts with biases are not reproduced by moekit")
    act = activation_name(mlp.act_fn, True, owner + "." + family.shared)
    gate = None
    if family.shared_gate is not None:
        gate_lin = getattr(block, family.shared_gate)
        if gate_lin.bias is not None:
            raise ValueError(f"{owner}: a shared-expert gate with a bias is not reproduced by moekit")
        gate = gate_lin.weight
    I_s = mlp.gate_proj.weight.shape[0]
    config = SharedExpertsConfig(intermediate_size=I_s, gated=gate is not None, activation=act)
    gate_up = torch.cat((mlp.gate_proj.weight, mlp.up_proj.weight)).detach()
    return config, (gate_up, mlp.down_proj.weight, gate)


def build_moe(block: nn.Module, family: BlockFamily, name: str, backend: str = "auto",
              eager_graphs: int = 0) -> MoEBlock:
    """A MoEBlock computing what `block` computes, adopting its tensors.

    Args:
        block: the transformers sparse-MoE block.  family: its BlockFamily.
        name: the block's module name (used for logs).  backend: FusedMoE backend.
        eager_graphs: FusedMoE's eager_graphs.
    """
    owner = f"{name} ({type(block).__name__})"
    why = None if family.refuse is None else family.refuse(block)
    if why is not None:
        raise ValueError(why)  # patch_model names the block
    router = getattr(block, family.router)
    layout = experts_layout(block.experts)
    if not hasattr(type(block.experts).forward, "__wrapped__"):  # the interface's dispatcher wraps the eager forward
        raise ValueError(f"{owner}: {type(block.experts).__name__} overrides the forward of transformers' experts "
                         "interface (e.g. to add a per-expert norm); moekit does not reproduce it")
    ex = block.experts
    up = ex.gate_up_proj if layout.gated else ex.up_proj
    up_bias = (ex.gate_up_proj_bias if layout.gated else ex.up_proj_bias) if layout.bias else None
    w = canonical_layout(up, ex.down_proj, up_bias, ex.down_proj_bias if layout.bias else None,
                         transposed=layout.transposed, interleaved=layout.interleaved)
    E, H, I = w.w2.shape
    has_shared = family.shared is not None and getattr(block, family.shared, None) is not None
    shared_cfg, shared = _shared_mlp(block, family, owner) if has_shared else (None, None)
    routing = family.routing(router)
    if family.output_scale is not None:
        routing = dataclasses.replace(routing, routed_scaling_factor=float(getattr(block, family.output_scale)),
                                      scale_on="output")
    moe = FusedMoE(
        E, H, I, routing, activation=layout.activation, bias=layout.bias,
        shared_experts=shared_cfg, dtype=w.w13.dtype, device="meta", backend=backend,
        activation_params=layout.activation_params, gate=True, gate_bias=family.router_bias,
        router_dtype=family.router_dtype, correction_bias=family.correction_bias is not None, name=name,
        eager_graphs=eager_graphs,
    )
    _adopt(moe.experts, "w13", w.w13, up)
    _adopt(moe.experts, "w2", w.w2, ex.down_proj)
    if layout.bias:
        _adopt(moe.experts, "b13", w.b13, up_bias)
        _adopt(moe.experts, "b2", w.b2, ex.down_proj_bias)
    _adopt(moe.gate, "weight", _check(owner, "router weight", router.weight, (E, H)), router.weight)
    if family.router_bias:
        _adopt(moe.gate, "bias", _check(owner, "router bias", router.bias, (E,)), router.bias)
    if family.correction_bias is not None:
        bias = functools.reduce(getattr, family.correction_bias.split("."), block)
        if family.correction_bias_2d:
            bias = _check(owner, family.correction_bias, bias, (1, E)).view(E)
        moe.e_score_correction_bias = _check(owner, family.correction_bias, bias, (E,))
    if shared is not None:
        gate_up, down, gate = shared
        _adopt(moe.shared, "gate_up", gate_up, down)
        _adopt(moe.shared, "down", down, down)
        if gate is not None:
            _adopt(moe.shared, "gate", _check(owner, "shared expert gate", gate, (1, H)), gate)
    return MoEBlock(moe, family, layout, float(getattr(block, "jitter_noise", 0.0) or 0.0))


def moe_blocks(model: nn.Module) -> Dict[str, MoEBlock]:
    """Every MoEBlock of a patched model, by module name."""
    return {n: m for n, m in model.named_modules() if isinstance(m, MoEBlock)}


def _candidates(model: nn.Module) -> List[Tuple[str, nn.Module]]:
    """Modules with an `experts` child, outside already patched blocks and FusedMoE layers."""
    found, patched = [], []
    for name, module in model.named_modules():
        if isinstance(module, (MoEBlock, FusedMoE)):
            patched.append(name + ".")
            continue
        if any(name.startswith(p) for p in patched):
            continue
        if isinstance(getattr(module, "experts", None), nn.Module):
            found.append((name, module))
    return found


def patch_model(model: nn.Module, backend: str = "auto", eager_graphs: int = 0) -> List[str]:
    """Replace every sparse-MoE block of `model` by a FusedMoE-backed MoEBlock, in place.

    Args:
        model: a transformers model (e.g. a *ForCausalLM).
        backend: the FusedMoE backend ("auto": the oracle picks per call).
        eager_graphs: FusedMoE's eager_graphs: decode steps of generate() (which runs eagerly)
            replay a CUDA graph per batch size, after the first two calls of each.
    Returns:
        The module names of the replaced blocks.
    Raises:
        ValueError naming each block moekit cannot reproduce exactly (nothing is changed then),
        or when the model has no sparse-MoE block.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    config = getattr(model, "config", None)
    if getattr(config, "output_router_logits", False):
        raise ValueError("model.config.output_router_logits=True: router logits are not recorded by patched blocks; "
                         "set it to False (or use experts_implementation='moekit', which keeps transformers' routers)")
    candidates = _candidates(model)
    if not candidates and not moe_blocks(model):
        raise ValueError(f"{type(model).__name__} has no sparse-MoE block (no module with an `experts` child)")
    refused, built = [], []
    for name, block in candidates:
        family = family_of(block)
        if family is None:
            refused.append(f"{name} ({type(block).__name__}): not a block structure moekit reproduces exactly")
            continue
        try:
            built.append((name, build_moe(block, family, name, backend, eager_graphs)))
        except ValueError as err:
            refused.append(f"{name} ({type(block).__name__}): {err}")
    if refused:
        raise ValueError("cannot patch these sparse-MoE blocks (the model was not changed):\n  " + "\n  ".join(refused))
    for name, new in built:
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, new)
    return [name for name, _ in built]

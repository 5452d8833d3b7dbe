"""The "moekit" experts implementation for Hugging Face transformers 5.x.

transformers 5.x stores the routed experts of most MoE families in one module decorated
with `@use_experts_implementation` (parameters gate_up_proj and down_proj, optionally
transposed, interleaved or biased) and picks the function that runs it from a registry,
`ExpertsInterface`, by the name in `config._experts_implementation`. Registering
`moekit_experts_forward` there under "moekit" makes

    AutoModelForCausalLM.from_pretrained(path, experts_implementation="moekit")
    model.set_experts_implementation("moekit")

run every such experts module through moekit's `fused_experts` (the oracle picks the
backend). The router, shared experts and everything else stay transformers' own.

Layouts (E experts, H hidden, I expert intermediate size):
    canonical   gate_up_proj [E, 2I, H] gate rows then up rows, down_proj [E, H, I]: used in place.
    transposed  gate_up_proj [E, H, 2I], down_proj [E, I, H] (Aria, gpt-oss).
    interleaved gate and up alternate along 2I (gpt-oss: gate = even, up = odd columns).
Transposed or interleaved weights are repacked to the canonical layout once and cached on
the module; the cache is keyed on each parameter's data_ptr, version (experts.base.version_of), dtype and shape, so
loading or editing a weight invalidates it. Under autograd the repack is recomputed per
call so gradients reach the original parameters.
"""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import itertools
import textwrap
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

import torch
import torch.nn as nn

from ..activations import is_gated
from ..config import ActivationParams
from ..experts.api import fused_experts
from ..experts.base import ExpertWeights, held_weights, version_of
from .checkpoint import canonical_layout

try:
    import transformers as _hf
except ModuleNotFoundError as _err:
    if _err.name != "transformers":
        raise
    raise ModuleNotFoundError(
        "moekit's transformers integration needs Hugging Face transformers 5.x: pip install 'moekit[hf]'",
        name="transformers") from None
try:
    from transformers import activations as _hf_act
    from transformers.integrations import moe as _hf_moe

    _ExpertsInterface = _hf_moe.ExpertsInterface
except (ImportError, AttributeError) as _err:
    raise ImportError(f"moekit's transformers integration needs transformers 5.x (its experts interface), "
                      f"found transformers {_hf.__version__}: {_err}") from _err

# The gate every experts class gets unless it defines its own (absent in early 5.x releases).
_DEFAULT_GATE = getattr(_hf_moe, "_default_apply_gate", None)

__all__ = [
    "EXPERTS_IMPLEMENTATION",
    "ExpertsLayout",
    "experts_layout",
    "prepared_weights",
    "moekit_experts_forward",
    "register_experts_implementation",
    "source_signature",
]

EXPERTS_IMPLEMENTATION = "moekit"

_owner_ids = itertools.count()


@dataclass(frozen=True)
class ExpertsLayout:
    """How one transformers experts module stores its weights and what it computes.

    Fields:
        activation: moekit activation name (gated ones take [.., 2I] gate | up).
        transposed: gate_up_proj is [E, H, 2I] and down_proj [E, I, H].
        interleaved: gate and up alternate along the 2I axis (gate even, up odd).
        bias: gate_up_proj_bias [E, 2I] and down_proj_bias [E, H] exist.
        activation_params: alpha/limit of swigluoai, None otherwise.
    """

    activation: str
    transposed: bool
    interleaved: bool
    bias: bool
    activation_params: Optional[ActivationParams] = None

    @property
    def gated(self) -> bool:
        return is_gated(self.activation)

    @property
    def in_place(self) -> bool:
        """Whether the module's own tensors already are the canonical layout."""
        return not (self.transposed or self.interleaved)


def source_signature(fn) -> Optional[str]:
    """A normalised form of a function's code: comments, docstrings, annotations, decorators and
    its name removed. Two functions with the same signature compute the same thing from the same
    attributes. None when the source cannot be read."""
    try:
        src = textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError):
        return None
    node = ast.parse(src).body[0]
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return None
    node.decorator_list = []
    node.returns = None
    node.name = "_"
    for sub in ast.walk(node):
        if isinstance(sub, ast.arg):
            sub.annotation = None
        body = getattr(sub, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) \
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            sub.body = body[1:] or [ast.Pass()]
    return ast.dump(node)


# -- activations ---------------------------------------------------------------------------

# transformers activation module type -> (gated moekit name, non-gated moekit name or None)
_ACT_TYPES: Dict[type, Tuple[Optional[str], Optional[str]]] = {
    nn.SiLU: ("silu", "silu_no_mul"),
    _hf_act.SiLUActivation: ("silu", "silu_no_mul"),
    _hf_act.GELUTanh: ("gelu_tanh", None),
    _hf_act.NewGELUActivation: ("gelu_tanh", None),
    _hf_act.FastGELUActivation: ("gelu_tanh", None),
    _hf_act.ReLUSquaredActivation: (None, "relu2_no_mul"),
}


# torch functions some families use as act_fn directly (LFM2-MoE: F.silu)
_ACT_FUNCTIONS: Dict[Callable, Tuple[Optional[str], Optional[str]]] = {
    nn.functional.silu: ("silu", "silu_no_mul"),
    nn.functional.gelu: ("gelu", "gelu_no_mul"),  # called as act_fn(x): the erf form
}


def activation_name(act_fn, gated: bool, owner: str) -> str:
    """The moekit activation computing transformers' `act_fn` (gated: act(gate) * up).

    Args:
        act_fn: an activation module of transformers or torch, or F.silu / F.gelu.
    Raises ValueError naming `owner` when moekit has no exact equivalent.
    """
    kind = type(act_fn)
    names: Tuple[Optional[str], Optional[str]] = (None, None)
    if not isinstance(act_fn, nn.Module) and act_fn in _ACT_FUNCTIONS:
        names = _ACT_FUNCTIONS[act_fn]
    elif kind is _hf_act.GELUActivation:  # erf gelu, in C or in Python
        names = ("gelu", "gelu_no_mul")
    elif kind is nn.GELU:
        names = ("gelu", "gelu_no_mul") if act_fn.approximate == "none" else ("gelu_tanh", None)
    elif kind in _ACT_TYPES:
        names = _ACT_TYPES[kind]
    name = names[0] if gated else names[1]
    if name is None:
        form = "gated act(gate) * up" if gated else "non-gated"
        what = kind.__name__ if isinstance(act_fn, nn.Module) else getattr(act_fn, "__name__", repr(act_fn))
        raise ValueError(f"{owner}: activation {what} in the {form} form has no exact moekit equivalent")
    return name


# -- custom gate functions ---------------------------------------------------------------------

@dataclass(frozen=True)
class _KnownGate:
    """A transformers `_apply_gate` moekit reproduces.

    Fields:
        activation: the moekit activation it computes; None: the module's act_fn as in the
            default gate (a gate that only computes it in fp32, which moekit's backends do).
        interleaved: gate and up alternate along 2I.
        alpha_attr, limit_attr: the module attributes holding ActivationParams' alpha / limit.
        silu_act_fn: the gate calls the module's act_fn where the formula has silu, so that
            act_fn must be SiLU.
        limit_optional: a limit of None clamps nothing (the default gate of act_fn).
    """

    activation: Optional[str] = None
    interleaved: bool = False
    alpha_attr: Optional[str] = None
    limit_attr: Optional[str] = None
    silu_act_fn: bool = False
    limit_optional: bool = False


_SWIGLU_LIMIT = _KnownGate("swiglu_limit", limit_attr="swiglu_limit")
# act_fn, then the clamps; a per-layer limit of None (0 in the config) clamps nothing
_SWIGLUSTEP = _KnownGate("swiglustep", limit_attr="limit", silu_act_fn=True, limit_optional=True)


@functools.lru_cache(maxsize=None)
def _known_gates() -> Dict[str, _KnownGate]:
    """Signatures of the custom `_apply_gate` functions of the installed transformers that moekit
    computes exactly: swigluoai interleaved (gpt-oss) or concatenated (OpenAI privacy filter,
    MiniMax-M3), SwiGLU with clamps only (DeepSeek-V4, GLM-5-Next, HunYuan-V4), the default
    gate in fp32 (Beam), SwiGLU clamped after the SiLU (Step-3.7, Bailing-hybrid)."""
    found: Dict[str, _KnownGate] = {}
    for module, cls, gate in (
        ("gpt_oss", "GptOssExperts", _KnownGate("swigluoai", True, "alpha", "limit")),
        ("openai_privacy_filter", "OpenAIPrivacyFilterExperts", _KnownGate("swigluoai", False, "alpha", "limit")),
        ("minimax_m3_vl", "MiniMaxM3VLExperts", _KnownGate("swigluoai", False, "swiglu_alpha", "swiglu_limit")),
        ("deepseek_v4", "DeepseekV4Experts", _KnownGate("swiglu_limit", limit_attr="limit", silu_act_fn=True)),
        ("glm5_next", "Glm5NextTextExperts", _SWIGLU_LIMIT),
        ("hy_v4", "HYV4Experts", _SWIGLU_LIMIT),
        ("hy_v4_vl", "HYV4VLExperts", _SWIGLU_LIMIT),
        ("beam", "BeamExperts", _KnownGate()),
        ("step3p7", "Step3p7Experts", _SWIGLUSTEP),
        ("bailing_hybrid", "BailingHybridExperts", _SWIGLUSTEP),
    ):
        try:
            experts_cls = getattr(importlib.import_module(f"transformers.models.{module}.modeling_{module}"), cls)
        except (ImportError, AttributeError):
            continue
        sig = source_signature(getattr(experts_cls, "_apply_gate", None))
        if sig is not None:
            found[sig] = gate
    return found


def _gate_of(cls: type) -> Optional[_KnownGate]:
    return _known_gates().get(source_signature(cls._apply_gate))


# -- layout ------------------------------------------------------------------------------------

def experts_layout(module: nn.Module) -> ExpertsLayout:
    """Describe a transformers experts module, or raise ValueError naming its class and why
    moekit cannot reproduce it exactly.

    Args:
        module: an instance of a class decorated with transformers' `@use_experts_implementation`.
    """
    cls = type(module)
    owner = cls.__name__
    if not hasattr(module, "has_gate") or not hasattr(module, "is_transposed"):
        raise ValueError(f"{owner} does not use transformers' experts interface (@use_experts_implementation)")
    if getattr(module, "has_post_expert_norm", False):
        raise ValueError(f"{owner}: a norm after each expert (has_post_expert_norm) is not reproduced by moekit")
    if getattr(module, "_is_expert_parallel", False):
        raise ValueError(
            f"{owner}: transformers' own expert parallelism is enabled; moekit does not take its sentinel ids")
    gated = bool(module.has_gate)
    transposed = bool(module.is_transposed)
    bias = bool(getattr(module, "has_bias", False))
    apply_gate = getattr(cls, "_apply_gate", None)
    if not gated or apply_gate is None or apply_gate is _DEFAULT_GATE:
        name = activation_name(module.act_fn, gated, owner)
        return ExpertsLayout(name, transposed, False, bias)
    known = _gate_of(cls)
    if known is None:
        raise ValueError(f"{owner}._apply_gate is a custom gate function moekit does not reproduce exactly")
    if known.activation is None or (known.limit_optional and getattr(module, known.limit_attr) is None):
        return ExpertsLayout(activation_name(module.act_fn, True, owner), transposed, known.interleaved, bias)
    if known.silu_act_fn and activation_name(module.act_fn, True, owner) != "silu":
        raise ValueError(f"{owner}._apply_gate with act_fn {type(module.act_fn).__name__}: moekit's "
                         f"{known.activation} takes SiLU")
    params = ActivationParams(**{field: float(getattr(module, attr)) for field, attr in
                                 (("alpha", known.alpha_attr), ("limit", known.limit_attr)) if attr is not None})
    return ExpertsLayout(known.activation, transposed, known.interleaved, bias, params)


def _module_tensors(module: nn.Module, layout: ExpertsLayout):
    up = module.gate_up_proj if layout.gated else module.up_proj
    up_bias = (module.gate_up_proj_bias if layout.gated else module.up_proj_bias) if layout.bias else None
    down_bias = module.down_proj_bias if layout.bias else None
    return up, module.down_proj, up_bias, down_bias


def prepared_weights(module: nn.Module, layout: ExpertsLayout) -> ExpertWeights:
    """The module's experts in the canonical layout: its own tensors when they already are,
    else a repacked copy cached on the module (see the module docstring)."""
    tensors = _module_tensors(module, layout)
    if layout.in_place:  # one object while the module holds these tensors (experts.base.held_weights)
        return held_weights(module, tensors, lambda: ExpertWeights(*tensors))
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        return canonical_layout(*tensors, transposed=layout.transposed, interleaved=layout.interleaved)
    key = tuple(None if t is None else (t.data_ptr(), version_of(t), t.dtype, t.device, tuple(t.shape)) for t in tensors)
    cache = module.__dict__.get("_moekit_prepared")
    if cache is None or cache[0] != key:
        with torch.no_grad():
            weights = canonical_layout(*tensors, transposed=layout.transposed, interleaved=layout.interleaved)
        cache = (key, weights)
        module.__dict__["_moekit_prepared"] = cache
    return cache[1]


def _layout_and_owner(module: nn.Module) -> Tuple[ExpertsLayout, str]:
    state = module.__dict__.get("_moekit_layout")
    if state is None:
        state = (experts_layout(module), f"{type(module).__name__}.{next(_owner_ids)}")
        module.__dict__["_moekit_layout"] = state
    return state


def moekit_experts_forward(
    self: nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """transformers' experts signature over moekit's `fused_experts`.

    Args:
        self: the transformers experts module.
        hidden_states: [T, H].  top_k_index: [T, k] expert ids.  top_k_weights: [T, k] any float
            dtype (their values are used as given, so a family that rounds its routing weights to
            the model dtype keeps that rounding).
    Returns:
        [T, H] in hidden_states' dtype.
    """
    layout, owner = _layout_and_owner(self)
    weights = prepared_weights(self, layout)
    return fused_experts(
        hidden_states, weights, None, top_k_weights, top_k_index.to(torch.int32),
        activation=layout.activation, activation_params=layout.activation_params, owner=owner,
    )


def register_experts_implementation(name: str = EXPERTS_IMPLEMENTATION,
                                    fn: Callable = moekit_experts_forward) -> None:
    """Add `fn` to transformers' ExpertsInterface under `name` (idempotent)."""
    _ExpertsInterface.register(name, fn)


register_experts_implementation()  # idempotent; `import moekit` triggers this lazily (hf_hook)

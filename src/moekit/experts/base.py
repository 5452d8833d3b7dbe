"""The contract every experts backend keeps: weights, the problem description, capabilities.

A backend computes, for hidden states x [T, H] and a routing result (weights [T, k] fp32,
ids [T, k] int32):

    out[t] = sum_j w[t, j] * expert_{ids[t, j]}(x[t])            (default)
    out[t] = sum_j expert_{ids[t, j]}(w[t, j] * x[t])            (apply_router_weight_on_input)

with expert_e(x) = W2_e act(W13_e x + b13_e) + b2_e, accumulating in fp32 and returning
x's dtype. Experts mapped to -1 by an expert_map contribute zero.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Dict, Iterator, Optional, Tuple

import torch

from ..config import ActivationParams

logger = logging.getLogger("moekit")

__all__ = [
    "ExpertWeights",
    "ExpertsProblem",
    "ExpertsBackend",
    "BACKENDS",
    "register_backend",
    "get_backend",
    "cached_for",
    "held_weights",
    "version_of",
]


_DERIVED: Dict[int, tuple] = {}  # id(obj) -> (weakref to obj, {purpose: (key, value)})


def cached_for(obj: Any, purpose: str, key: tuple, compute: Callable[[], Any]) -> Any:
    """compute(), kept while obj lives (one value per purpose) and reused while key holds the
    same items (objects by identity: tensors, schemes, libraries; ints and strings by value).

    For what backends derive from weights on every call (a decode step is short and runs
    cold: reading the scheme and describing the projections again took ~60 us of it). Kept
    beside obj, not on it, so copies and pickles of obj carry nothing derived.
    """
    if torch.compiler.is_compiling():  # traced code: no host-side cache to consult
        return compute()
    entry = _DERIVED.get(id(obj))
    if entry is None or entry[0]() is not obj:
        entry = (weakref.ref(obj), {})
        _DERIVED[id(obj)] = entry
        weakref.finalize(obj, _DERIVED.pop, id(obj), None)
    hit = entry[1].get(purpose)
    if (hit is not None and len(hit[0]) == len(key)
            and all(a is b or (isinstance(a, (int, str)) and a == b) for a, b in zip(hit[0], key))):
        return hit[1]
    value = compute()
    entry[1][purpose] = (key, value)
    return value


def version_of(t: torch.Tensor) -> object:
    """t's version counter (bumped by in-place writes), for keys of what is derived from t.

    Inference tensors (made under torch.inference_mode) have none: a fresh object stands in,
    so a key holding it never matches and what derives from t is built again on every call
    (in-place writes to them could not be seen otherwise). That costs time on every call, so it
    is said once, at WARNING on the "moekit" logger.
    """
    if not t.is_inference():
        return t._version
    global _warned_inference
    if not _warned_inference:
        _warned_inference = True
        logger.warning("moekit: weights made under torch.inference_mode have no version counter, so what is "
                       "derived from them (fp32 biases, repacked int4 weights, the fused shared experts) is "
                       "rebuilt on every call; build the layer outside inference_mode and call it inside")
    return object()


_warned_inference = False


def held_weights(holder: Any, tensors: tuple, build: Callable[[], "ExpertWeights"]) -> "ExpertWeights":
    """The ExpertWeights a module builds from its tensors, one object while they are the same ones.

    A layer asks for its weights on every call; one object for as long as the module holds the
    same tensors (by identity: a replaced parameter or buffer, or a .to() that swaps buffers,
    builds a new one) lets what backends derive from it (cached_for) live across calls.
    In-place writes keep the object: the derived values key on data pointers and versions.
    """
    if torch.compiler.is_compiling():  # traced code: no host-side state to keep
        return build()
    held = holder.__dict__.get("_held_weights")
    if held is None or len(held[0]) != len(tensors) or any(a is not b for a, b in zip(held[0], tensors)):
        held = (tensors, build())
        holder.__dict__["_held_weights"] = held
    return held[1]


@dataclass(frozen=True)
class ExpertWeights:
    """All per-expert tensors of one layer, canonical layout (ARCHITECTURE.md).

    w13: [E, 2I, H] (gated: rows 0..I-1 gate, I..2I-1 up) or [E, I, H] (non-gated).
    w2:  [E, H, I].
    b13: [E, 2I] or [E, I], optional.  b2: [E, H], optional.
    scales: quantization tensors keyed by name, each with E as its first dimension.
    quant: the quantization scheme name, or None for unquantized weights.
    """

    w13: torch.Tensor
    w2: torch.Tensor
    b13: Optional[torch.Tensor] = None
    b2: Optional[torch.Tensor] = None
    scales: Dict[str, torch.Tensor] = field(default_factory=dict)
    quant: Optional[str] = None

    @property
    def num_experts(self) -> int:
        return self.w13.shape[0]

    def per_expert_tensors(self) -> Iterator[Tuple[str, torch.Tensor]]:
        """Every tensor whose first dimension indexes experts (EPLB moves them together)."""
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor):
                yield f.name, value
        for name, value in self.scales.items():
            yield name, value


@dataclass(frozen=True)
class ExpertsProblem:
    """What a backend needs to know to say whether it can serve a call."""

    device: str  # "cpu", "cuda", ...
    dtype: torch.dtype  # activation dtype
    weight_dtype: torch.dtype
    activation: str
    has_bias: bool
    has_expert_map: bool
    apply_router_weight_on_input: bool
    num_experts: int  # local E
    hidden_size: int  # H
    intermediate_size: int  # I
    top_k: int
    quant: Optional[str] = None
    requires_grad: bool = False
    capturing: bool = False  # the call is being captured in a CUDA graph
    static_scales: bool = False  # quantized with static per-tensor activation scales (a13_scale / a2_scale)

    def describe(self) -> str:
        """One line for logs and refusals: device, dtype, scheme, activation and sizes."""
        q = self.quant or "unquantized"
        return (
            f"{self.device} {str(self.dtype).replace('torch.', '')} {q} act={self.activation} "
            f"E={self.num_experts} H={self.hidden_size} I={self.intermediate_size} k={self.top_k}"
        )


class ExpertsBackend:
    """Base class of experts backends. Subclasses set `name` and implement `unsupported`
    (a sentence saying why not, or None) and `apply`."""

    name: str = ""
    description: str = ""
    # Whether the forward can be captured in a CUDA graph (no host synchronisation).
    graph_safe: bool = False
    # Whether autograd flows through `apply` to x, the weights, the biases and topk_weights.
    # Backends that cannot backpropagate (custom kernels without a backward, quantized
    # weights) set False; the oracle then refuses them when an input requires grad.
    differentiable: bool = True

    def available(self) -> Optional[str]:
        """Why this backend cannot run on this machine at all, or None."""
        return None

    def unsupported(self, problem: ExpertsProblem) -> Optional[str]:
        """Why this backend cannot serve `problem`, as a sentence, or None if it can."""
        raise NotImplementedError

    def apply(
        self,
        x: torch.Tensor,
        weights: ExpertWeights,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        *,
        activation: str,
        activation_params: ActivationParams,
        apply_router_weight_on_input: bool,
        expert_map: Optional[torch.Tensor],
    ) -> torch.Tensor:
        """Compute the routed output.

        Args:
            x: [T, H] activations (validated, contiguous).
            weights: ExpertWeights with E local experts.
            topk_weights: [T, k] fp32.  topk_ids: [T, k] int32 (global ids when expert_map is set).
            expert_map: [E_global] int32 global -> local id, -1 for experts held elsewhere.
        Returns:
            [T, H] fp32 (the caller casts to x's dtype once).
        """
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<experts backend {self.name}>"


BACKENDS: Dict[str, ExpertsBackend] = {}


def register_backend(backend: ExpertsBackend) -> ExpertsBackend:
    """Add a backend instance to the registry under backend.name."""
    if not backend.name:
        raise ValueError("a backend needs a non-empty name")
    BACKENDS[backend.name] = backend
    return backend


# backends registered only when their optional package imports, and the extra that installs it
OPTIONAL_BACKENDS = {"triton": "Triton: pip install 'moekit[gpu]'"}


def get_backend(name: str) -> ExpertsBackend:
    if name not in BACKENDS and name in OPTIONAL_BACKENDS:
        raise ValueError(f"backend {name!r} needs {OPTIONAL_BACKENDS[name]} (installed here: {sorted(BACKENDS)})")
    if name not in BACKENDS:
        raise ValueError(f"backend must be 'auto' or one of {sorted(BACKENDS)}, got {name!r}")
    return BACKENDS[name]

"""The oracle: which experts backend runs a call, and why.

One ordered priority list per precision and device. backend="auto" takes the first
backend that can serve the problem; an explicit backend that cannot serve it raises with
that backend's own reason (never a silent fallback). Each choice is logged once per
(layer, problem) at INFO on the "moekit" logger.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch

from .experts.base import BACKENDS, ExpertsBackend, ExpertsProblem, get_backend

__all__ = ["PRIORITIES", "Choice", "choose_backend", "explain", "refusal", "refusal_anywhere", "available_backends",
           "precision_of"]

logger = logging.getLogger("moekit")

# precision -> device -> backends in order of preference. Other modules (quantization,
# GPU kernels) add their entries at import; names not registered are skipped.
PRIORITIES: Dict[str, Dict[str, List[str]]] = {
    "unquantized": {
        "cuda": ["triton", "grouped_mm", "reference"],
        "cpu": ["cpu", "grouped_mm", "reference"],
        "other": ["reference"],
    },
}


def precision_of(quant: Optional[str]) -> str:
    """The oracle's precision key for a quantization scheme name (None = unquantized)."""
    if quant is None:
        return "unquantized"
    from .quant import precision_of_scheme  # noqa: PLC0415 (quant registers schemes lazily)

    return precision_of_scheme(quant)


@dataclass(frozen=True)
class Choice:
    """The oracle's answer: the backend and a sentence saying why it was chosen."""

    backend: ExpertsBackend
    reason: str


def _why_not(backend: ExpertsBackend, problem: ExpertsProblem) -> Optional[str]:
    reason = backend.available()
    if reason is None:
        reason = backend.unsupported(problem)
    if reason is None and problem.capturing and not backend.graph_safe:
        reason = "cannot be captured in a CUDA graph (it reads values back to the host)"
    if reason is None and problem.requires_grad and not getattr(backend, "differentiable", True):
        reason = "does not support autograd (inputs require grad)"
    return reason


def refusal(backend: ExpertsBackend, problem: ExpertsProblem) -> Optional[str]:
    """Why `backend` cannot run `problem`, or None when it can."""
    return _why_not(backend, problem)


def refusal_anywhere(backend: ExpertsBackend, problem: ExpertsProblem) -> Optional[str]:
    """Why `backend` cannot run `problem` on any device or float dtype, or None when some
    (device, dtype) would do: the facts a layer fixes at construction (scheme, activation,
    sizes, biases) already rule the backend out, whatever `.to()` does later.

    Unquantized problems move their weight dtype with the activation dtype."""
    reasons = []
    for device in ("cpu", "cuda"):
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            wdtype = dtype if problem.quant is None else problem.weight_dtype
            reason = backend.unsupported(dataclasses.replace(problem, device=device, dtype=dtype, weight_dtype=wdtype))
            if reason is None:
                return None
            if reason not in reasons:
                reasons.append(reason)
    return "; ".join(reasons)


def explain(problem: ExpertsProblem) -> List[Tuple[str, Optional[str]]]:
    """For each backend of the problem's priority list: (name, None if it can serve, else why not)."""
    prio = PRIORITIES.get(precision_of(problem.quant), {})
    names = prio.get(problem.device, prio.get("other", []))
    out = []
    for name in names:
        if name not in BACKENDS:
            out.append((name, "not installed (its module failed to import or its extra is missing)"))
        else:
            out.append((name, _why_not(BACKENDS[name], problem)))
    return out


_logged: set = set()


def choose_backend(problem: ExpertsProblem, backend: str = "auto", *, owner: str = "fused_experts") -> Choice:
    """Pick the backend for `problem`.

    Args:
        problem: the ExpertsProblem of the call.
        backend: "auto" or a registered backend name.
        owner: who asks (a layer name), used to log each choice once per owner.
    """
    if backend != "auto":
        chosen = get_backend(backend)
        reason = _why_not(chosen, problem)
        if reason is not None:
            raise ValueError(f"backend={backend!r} cannot run {problem.describe()}: {reason}")
        choice = Choice(chosen, "chosen explicitly")
    else:
        refusals = []
        choice = None
        for name, reason in explain(problem):
            if reason is None:
                choice = Choice(BACKENDS[name], _auto_reason(name, refusals))
                break
            refusals.append(f"{name}: {reason}")
        if choice is None:
            raise ValueError(f"no experts backend can run {problem.describe()}; " + "; ".join(refusals))
    key = (owner, problem, choice.backend.name)
    # torch.compile cannot trace a logger call (fullgraph would fail on it): a traced choice is
    # logged by the first eager call that makes it.
    if key not in _logged and not torch.compiler.is_compiling():
        _logged.add(key)
        logger.info("moekit: %s -> backend %s (%s) for %s", owner, choice.backend.name, choice.reason, problem.describe())
    return choice


def _auto_reason(name: str, refusals: List[str]) -> str:
    if not refusals:
        return "first in the priority list"
    return "first that supports the call; refused: " + "; ".join(refusals)


def available_backends(device: Optional[str] = None) -> Dict[str, Optional[str]]:
    """Every registered backend -> None if it can run on this machine, else why not.

    With device ("cpu", "cuda", or a torch.device) it also checks a small bf16/fp32 problem on that device;
    "cuda" on a machine without a CUDA GPU gives every backend that reason.
    """
    import torch

    if isinstance(device, torch.device):
        device = device.type
    if device not in (None, "cpu", "cuda"):
        raise ValueError(f"device must be None, 'cpu' or 'cuda', got {device!r}")
    no_gpu = device == "cuda" and not torch.cuda.is_available()
    out: Dict[str, Optional[str]] = {}
    for name, b in sorted(BACKENDS.items()):
        reason = "no CUDA GPU here (torch.cuda.is_available() is False)" if no_gpu else b.available()
        if reason is None and device is not None:
            dtype = torch.bfloat16 if device == "cuda" else torch.float32
            probe = ExpertsProblem(device, dtype, dtype, "silu", False, False, False, 8, 64, 32, 2)
            reason = b.unsupported(probe)
        out[name] = reason
    return out

"""Expert activations as pure tensor functions (ROUTING.md, "Expert activations").

Gated activations map [.., 2I] -> [.., I] with the gate in the first half and up in the
second; non-gated ones (suffix "_no_mul") map [.., I] -> [.., I].
"""

from __future__ import annotations

from typing import Callable, Dict, Optional

import torch
import torch.nn.functional as F

from .config import ActivationParams

__all__ = ["ACTIVATIONS", "GATED", "apply_activation", "is_gated", "check_activation"]


def _silu_mul(g: torch.Tensor, u: torch.Tensor, p: ActivationParams) -> torch.Tensor:
    return F.silu(g) * u


def _gelu_mul(g: torch.Tensor, u: torch.Tensor, p: ActivationParams) -> torch.Tensor:
    return F.gelu(g) * u


def _gelu_tanh_mul(g: torch.Tensor, u: torch.Tensor, p: ActivationParams) -> torch.Tensor:
    return F.gelu(g, approximate="tanh") * u


def _swigluoai(g: torch.Tensor, u: torch.Tensor, p: ActivationParams) -> torch.Tensor:
    # gpt-oss clamps the gate from above only and the up projection on both sides.
    g = g.clamp(max=p.limit)
    u = u.clamp(min=-p.limit, max=p.limit)
    return g * torch.sigmoid(p.alpha * g) * (u + 1)


def _swiglu_limit(g: torch.Tensor, u: torch.Tensor, p: ActivationParams) -> torch.Tensor:
    # SwiGLU with gpt-oss's clamps and nothing else (DeepSeek-V4, GLM-5, HunYuan-V4): silu, no +1.
    g = g.clamp(max=p.limit)
    u = u.clamp(min=-p.limit, max=p.limit)
    return F.silu(g) * u


def _swiglustep(g: torch.Tensor, u: torch.Tensor, p: ActivationParams) -> torch.Tensor:
    # Step-3.5 / Step-3.7, Bailing-hybrid: the clamp comes after the SiLU (up is clamped both ways).
    return F.silu(g).clamp(max=p.limit) * u.clamp(min=-p.limit, max=p.limit)


def _relu2(x: torch.Tensor) -> torch.Tensor:
    return torch.square(F.relu(x))


GATED: Dict[str, Callable] = {
    "silu": _silu_mul,
    "gelu": _gelu_mul,
    "gelu_tanh": _gelu_tanh_mul,
    "swigluoai": _swigluoai,
    "swiglu_limit": _swiglu_limit,
    "swiglustep": _swiglustep,
}

NON_GATED: Dict[str, Callable] = {
    "silu_no_mul": F.silu,
    "gelu_no_mul": F.gelu,
    "relu2_no_mul": _relu2,
}

ACTIVATIONS = tuple(GATED) + tuple(NON_GATED)


def check_activation(activation: str) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {list(ACTIVATIONS)}, got {activation!r}")


def is_gated(activation: str) -> bool:
    check_activation(activation)
    return activation in GATED


def apply_activation(
    h: torch.Tensor, activation: str, params: Optional[ActivationParams] = None
) -> torch.Tensor:
    """Apply `activation` to the first GEMM's output.

    Args:
        h: [N, 2I] for gated activations (gate | up), [N, I] otherwise; any float dtype.
        activation: a name from ACTIVATIONS.
        params: ActivationParams for "swigluoai" (defaults: alpha 1.702, limit 7.0),
            "swiglu_limit" and "swiglustep" (their limit).
    Returns:
        [N, I] in h's dtype.
    """
    if activation in GATED:
        inter = h.shape[-1] // 2
        return GATED[activation](h[..., :inter], h[..., inter:], params or ActivationParams())
    check_activation(activation)
    return NON_GATED[activation](h)

"""`reference`: a plain per-expert loop in fp32. The ground truth every backend is tested against.

Supports: every device, dtype and activation, biases, expert_map, weights on input,
autograd. Slow by design: it reads as the math. Quantized weights run the emulation of
moekit.quant.emulate (dequantize, then the same fp32 loop).
"""

from __future__ import annotations

from typing import Optional

import torch

from ..activations import apply_activation
from ..config import ActivationParams
from .base import ExpertsBackend, ExpertsProblem, ExpertWeights, register_backend
from .common import local_ids

__all__ = ["ReferenceBackend", "reference_experts"]

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}


def reference_experts(
    x: torch.Tensor,
    weights: ExpertWeights,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    activation: str = "silu",
    activation_params: Optional[ActivationParams] = None,
    apply_router_weight_on_input: bool = False,
    expert_map: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Routed output [T, H] fp32 by looping over experts, all in fp32."""
    T, H = x.shape
    ids_Tk = local_ids(topk_ids, expert_map)
    out = x.new_zeros((T, H), dtype=torch.float32)
    for e in range(weights.num_experts):
        t, j = (ids_Tk == e).nonzero(as_tuple=True)
        if t.numel() == 0:
            continue
        x_e = x[t].float()  # [n, H]
        w_e = topk_weights[t, j].float().unsqueeze(-1)  # [n, 1]
        if apply_router_weight_on_input:
            x_e = x_e * w_e
        h = x_e @ weights.w13[e].float().t()  # [n, 2I]
        if weights.b13 is not None:
            h = h + weights.b13[e].float()
        a = apply_activation(h, activation, activation_params)  # [n, I]
        y = a @ weights.w2[e].float().t()  # [n, H]
        if weights.b2 is not None:
            y = y + weights.b2[e].float()
        if not apply_router_weight_on_input:
            y = y * w_e
        out = out.index_add(0, t, y)
    return out


class ReferenceBackend(ExpertsBackend):
    name = "reference"
    description = "per-expert loop in fp32 (ground truth; slow)"

    def unsupported(self, problem: ExpertsProblem) -> Optional[str]:
        if problem.quant is not None:
            from ..quant.schemes import SCHEMES  # noqa: PLC0415 (quant imports the experts package)

            if problem.quant not in SCHEMES:
                return f"quantization scheme {problem.quant!r} is not registered (known: {sorted(SCHEMES)})"
            if problem.requires_grad and not SCHEMES[problem.quant].weight_only:
                return f"quant={problem.quant!r} rounds the activations, so no gradient flows (inputs require grad)"
        return None

    def apply(self, x, weights, topk_weights, topk_ids, *, activation, activation_params,
              apply_router_weight_on_input, expert_map):
        if weights.quant is not None:  # dequantize, then fp32 (moekit.quant.emulate)
            from ..quant.emulate import emulated_experts  # noqa: PLC0415

            return emulated_experts(
                x, weights, topk_weights, topk_ids, activation=activation,
                activation_params=activation_params,
                apply_router_weight_on_input=apply_router_weight_on_input, expert_map=expert_map,
            )
        return reference_experts(
            x, weights, topk_weights, topk_ids, activation=activation,
            activation_params=activation_params,
            apply_router_weight_on_input=apply_router_weight_on_input, expert_map=expert_map,
        )


register_backend(ReferenceBackend())

"""Shared experts: an MLP every token goes through beside the routed experts.

Modes (SharedExpertsConfig.mode): "separate" runs the MLP on its own; "fused" hands its
weights to the experts backend as always-selected extra experts (split into I_s / I
experts of the routed size I, each with weight 1, or 1/s when s scales the output, or the
sigmoid gate value); "overlap" runs it on a side CUDA stream while the routed experts run.
All three compute the same function.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from .activations import apply_activation, is_gated
from .config import ActivationParams, SharedExpertsConfig

__all__ = ["SharedMLP", "fused_shared_weights"]


class SharedMLP(nn.Module):
    """out = [sigmoid(x W_g^T)] * W_down act(W_gate_up x); biases none (as in every family).

    Parameters: gate_up [2I_s, H] (gate | up) or [I_s, H] non-gated; down [H, I_s];
    gate [1, H] when gated.
    """

    def __init__(self, hidden_size: int, config: SharedExpertsConfig, activation: str,
                 dtype: Optional[torch.dtype] = None, device=None,
                 activation_params: Optional[ActivationParams] = None) -> None:
        super().__init__()
        self.config = config
        self.activation = config.activation or activation
        # the layer's (swigluoai alpha / limit): mode "fused" runs the shared MLP with them too
        self.activation_params = activation_params
        I_s = config.intermediate_size
        rows = 2 * I_s if is_gated(self.activation) else I_s
        kw = dict(dtype=dtype, device=device)
        self.gate_up = nn.Parameter(torch.empty(rows, hidden_size, **kw))
        self.down = nn.Parameter(torch.empty(hidden_size, I_s, **kw))
        self.gate = nn.Parameter(torch.empty(1, hidden_size, **kw)) if config.gated else None
        for p in self.parameters():
            nn.init.normal_(p, std=hidden_size ** -0.5)

    def gate_values(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        """sigmoid(x W_g^T) [T, 1] fp32, or None when ungated."""
        if self.gate is None:
            return None
        return torch.sigmoid(x.float() @ self.gate.float().t())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H] fp32. Computed in fp32 (CPU bf16 GEMMs are slow; fp32 is exact)."""
        x32 = x.float()
        h = x32 @ self.gate_up.float().t()  # [T, 2I_s]
        y = apply_activation(h, self.activation, self.activation_params) @ self.down.float().t()  # [T, H]
        g = self.gate_values(x)
        return y if g is None else y * g


def fused_shared_weights(shared: SharedMLP, intermediate_size: int):
    """Split the shared MLP into n = I_s / I experts of the routed layout.

    Returns (w13 [n, 2I or I, H], w2 [n, H, I]) in the shared weights' dtype.
    """
    I_s = shared.down.shape[1]
    I = intermediate_size
    if I_s % I != 0:
        raise ValueError(
            f"fused shared experts need shared intermediate_size ({I_s}) to be a multiple of the "
            f"routed intermediate_size ({I})"
        )
    n = I_s // I
    H = shared.down.shape[0]
    if is_gated(shared.activation):
        gate, up = shared.gate_up[:I_s], shared.gate_up[I_s:]
        w13 = torch.cat((gate.reshape(n, I, H), up.reshape(n, I, H)), dim=1)  # [n, 2I, H]
    else:
        w13 = shared.gate_up.reshape(n, I, H)
    w2 = shared.down.reshape(H, n, I).permute(1, 0, 2)  # [n, H, I]
    return w13, w2.contiguous()

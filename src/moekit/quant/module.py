"""QuantizedRoutedExperts: the routed experts' storage for a quantized FusedMoE.

Same interface as moekit.layer.RoutedExperts (`expert_weights()`, `load_weights(...)`):
`load_weights` takes a float checkpoint and quantizes it on load; `load_quantized` takes
pre-quantized ExpertWeights (moekit.quant.checkpoint's loaders). The stored weights,
scales and zero points are buffers (so they follow device moves and state_dict) with E
first; optional biases stay float parameters. A dtype cast of the module (`.to(torch.bfloat16)`,
`.half()`, `.float()`) casts only the biases: the stored dtypes are the scheme's, and an fp32
scale rounded to bf16 would change every dequantized weight.
"""

from __future__ import annotations

from typing import Optional, Union

import torch
import torch.nn as nn

from ..activations import is_gated
from ..checks import check_float_tensor, copy_biases
from ..experts.base import ExpertWeights, held_weights
from .layout import check_quantized_weights, scheme_of
from .quantize import check_fits, quantize_experts
from .schemes import QuantScheme, get_scheme

__all__ = ["QuantizedRoutedExperts"]


def _random_experts(E: int, rows13: int, H: int, I: int, scheme: QuantScheme, device) -> ExpertWeights:
    """Gaussian experts (std H^-1/2, I^-1/2) quantized one at a time: fp32 copies of every
    expert's weights took about ten times the quantized layer's memory (4 bytes a weight)."""
    f32 = dict(dtype=torch.float32, device=device)
    parts = [quantize_experts(torch.randn((1, rows13, H), **f32) * H ** -0.5, torch.randn((1, H, I), **f32) * I ** -0.5,
                              scheme) for _ in range(E)]
    if not parts:  # no local experts
        return quantize_experts(torch.zeros((0, rows13, H), **f32), torch.zeros((0, H, I), **f32), scheme)
    return ExpertWeights(torch.cat([p.w13 for p in parts]), torch.cat([p.w2 for p in parts]),
                         scales={k: torch.cat([p.scales[k] for p in parts]) for k in parts[0].scales}, quant=scheme.name)


class QuantizedRoutedExperts(nn.Module):
    """Quantized routed experts: buffers w13, w2 (stored dtype) and one buffer per scale.

    Args:
        num_experts: E.  hidden_size: H.  intermediate_size: I.
        activation: decides 2I (gated) or I rows of w13.
        bias: hold float biases b13 [E, 2I or I] and b2 [E, H].
        scheme: a scheme name or QuantScheme (get_scheme carries group size / zero points).
        dtype: of the biases (the weights are quantized from fp32).
        device: of every tensor.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, activation: str,
                 bias: bool, scheme: Union[str, QuantScheme], dtype: Optional[torch.dtype], device) -> None:
        super().__init__()
        self.scheme = get_scheme(scheme)
        E, H, I = num_experts, hidden_size, intermediate_size
        check_fits(self.scheme, H, I)
        self.activation = activation
        self.hidden_size, self.intermediate_size = H, I
        self.rows13 = 2 * I if is_gated(activation) else I
        kw = dict(dtype=dtype, device=device)
        self.b13 = nn.Parameter(torch.zeros(E, self.rows13, **kw)) if bias else None
        self.b2 = nn.Parameter(torch.zeros(E, H, **kw)) if bias else None
        self._scale_names = []
        self._store(_random_experts(E, self.rows13, H, I, self.scheme, device))

    @property
    def shape13(self):
        """Float shape of w13 [E, 2I or I, H] (E = the slots held now; EPLB may resize them)."""
        return (self.w13.shape[0], self.rows13, self.hidden_size)

    @property
    def shape2(self):
        """Float shape of w2 [E, H, I]."""
        return (self.w13.shape[0], self.hidden_size, self.intermediate_size)

    def _store(self, q: ExpertWeights) -> None:
        """Replace the stored weights and scales (buffers) with q's tensors."""
        for name in self._scale_names:
            delattr(self, name)
        self.register_buffer("w13", q.w13)
        self.register_buffer("w2", q.w2)
        self._scale_names = sorted(q.scales)
        for name in self._scale_names:
            self.register_buffer(name, q.scales[name])

    def _apply(self, fn, recurse=True):
        """nn.Module's .to() / .cuda() / .half() / ... with the buffers kept in their dtypes.

        Each buffer gets `fn` when `fn` keeps its dtype (device moves, to_empty, share_memory),
        else only `fn`'s device (found on an empty tensor of the buffer's dtype).
        """
        stored = dict(self._buffers)
        self._buffers.clear()
        try:
            super()._apply(fn, recurse)  # the float parameters (biases) follow fn as they are
        finally:
            self._buffers.update(stored)
        for name, buf in stored.items():
            if buf is not None:
                probe = fn(buf.new_empty(0))
                self._buffers[name] = fn(buf) if probe.dtype == buf.dtype else buf.to(probe.device)
        return self

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        """nn.Module's, after adding buffers for static activation scales the state_dict holds.

        Those buffers exist only once pre-quantized weights carrying them were loaded
        (load_quantized), so a fresh layer of the same scheme had no slot for them."""
        if self.scheme.activation_granularity == "tensor":
            for name in ("a13_scale", "a2_scale"):
                if prefix + name in state_dict and name not in self._scale_names:
                    self.register_buffer(name, torch.ones(self.w13.shape[0], dtype=torch.float32,
                                                          device=self.w13.device))
                    self._scale_names = sorted(self._scale_names + [name])
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def expert_weights(self) -> ExpertWeights:
        names = self._scale_names
        scales = tuple(getattr(self, n) for n in names)
        tensors = (self.w13, self.w2, self.b13, self.b2, self.scheme, *names, *scales)
        return held_weights(self, tensors, lambda: ExpertWeights(*tensors[:4], scales=dict(zip(names, scales)),
                                                                  quant=self.scheme.name))

    @torch.no_grad()
    def load_weights(self, w13, w2, b13=None, b2=None) -> None:
        """Quantize float canonical-layout weights on load: w13 [E, 2I, H], w2 [E, H, I], biases float."""
        check_float_tensor("w13", w13, self.shape13)
        check_float_tensor("w2", w2, self.shape2)
        device = self.w13.device
        q = quantize_experts(w13.to(device), w2.to(device), self.scheme)  # refuses non-finite weights
        copy_biases(self, b13, b2)  # after quantizing: a refused call leaves the layer as it was
        self._store(q)

    @torch.no_grad()
    def load_quantized(self, weights: ExpertWeights) -> None:
        """Load pre-quantized ExpertWeights of this layer's scheme (group size and zero points included)."""
        if not isinstance(weights, ExpertWeights):
            raise TypeError(f"weights must be an ExpertWeights, got {type(weights).__name__}")
        if weights.quant is None:
            raise ValueError(f"weights must be quantized with {self.scheme.name!r}, got unquantized weights")
        got = scheme_of(weights)
        if got != self.scheme:
            raise ValueError(f"weights are quantized as {got.describe()} ({got.name!r}); this layer holds "
                             f"{self.scheme.describe()} ({self.scheme.name!r})")
        device = self.w13.device
        moved = ExpertWeights(weights.w13.to(device), weights.w2.to(device),
                              scales={k: v.to(device) for k, v in weights.scales.items()}, quant=weights.quant)
        if tuple(moved.w2.shape)[:2] != self.shape2[:2]:
            raise ValueError(f"w2 must be [E={self.shape2[0]}, H={self.shape2[1]}, ...], got {tuple(moved.w2.shape)}")
        I = check_quantized_weights(moved, self.shape2[1], self.activation)
        if I != self.shape2[2]:
            raise ValueError(f"weights have intermediate size {I}, this layer {self.shape2[2]}")
        copy_biases(self, weights.b13, weights.b2)
        self._store(moved)

    def extra_repr(self) -> str:
        return f"quant={self.scheme.name!r} ({self.scheme.describe()})"

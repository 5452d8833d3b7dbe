"""The model an elastic deployment serves, and the checkpoint its workers read experts from.

The model is a stack of L FusedMoE layers, each with its own router gate, applied with a
residual connection: h <- h + moe_l(h). Every worker holds every gate (small, replicated)
and only the expert slots of its placement.

Checkpoint: one safetensors file in transformers' stacked layout, so that the single-process
reference loads it with moekit.integrations.checkpoint.load_fused_moe and workers read just
the expert rows they need (safetensors slices; no other expert is read):

    layers.{l}.mlp.gate.weight            [E, H]
    layers.{l}.mlp.experts.gate_up_proj   [E, 2I, H]   (experts.up_proj [E, I, H] for a non-gated activation)
    layers.{l}.mlp.experts.down_proj      [E, H, I]
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Dict, Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn

from ..activations import check_activation, is_gated
from ..config import RoutingConfig
from ..layer import FusedMoE

__all__ = ["ModelSpec", "layer_prefix", "write_checkpoint", "read_experts", "read_gate",
           "build_layers", "stack_forward", "ReferenceModel"]

GATE_KEY = "gate.weight"
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _positive(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")


@dataclass(frozen=True)
class ModelSpec:
    """Shape of the served model: L layers of E experts, hidden size H, expert size I, top-k routing.

    Fields:
        num_experts: E.  hidden_size: H.  intermediate_size: I.  top_k: k.
        num_layers: L MoE layers applied with a residual connection.
        activation: the experts' activation (moekit.activations).
        dtype: parameter and activation dtype (float32, bfloat16 or float16).
        backend: experts backend of every layer ("auto": the oracle picks).
    """

    num_experts: int
    hidden_size: int
    intermediate_size: int
    top_k: int
    num_layers: int = 1
    activation: str = "silu"
    dtype: torch.dtype = torch.float32
    backend: str = "auto"

    def __post_init__(self) -> None:
        for name in ("num_experts", "hidden_size", "intermediate_size", "top_k", "num_layers"):
            _positive(name, getattr(self, name))
        check_activation(self.activation)
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {[str(d) for d in _DTYPES]}, got {self.dtype!r}")
        if self.backend != "auto":
            from ..experts.base import get_backend  # noqa: PLC0415

            get_backend(self.backend)  # unknown names fail here, not in every worker's first switch
        self.routing.validate_for(self.num_experts)

    @property
    def routing(self) -> RoutingConfig:
        return RoutingConfig(top_k=self.top_k)

    def expert_shapes(self) -> Dict[str, Tuple[int, ...]]:
        """Shape of one expert's row of each per-expert tensor (w13 [2I, H], w2 [H, I])."""
        rows = 2 * self.intermediate_size if is_gated(self.activation) else self.intermediate_size
        return {"w13": (rows, self.hidden_size), "w2": (self.hidden_size, self.intermediate_size)}

    def expert_keys(self) -> Dict[str, str]:
        """Checkpoint key of each per-expert tensor under a layer's prefix (transformers' stacked names)."""
        return {"w13": "experts.gate_up_proj" if is_gated(self.activation) else "experts.up_proj",
                "w2": "experts.down_proj"}


def layer_prefix(layer: int) -> str:
    return f"layers.{layer}.mlp."


def write_checkpoint(spec: ModelSpec, path: Union[str, Path], *, seed: int = 0) -> Path:
    """Write random weights for `spec` (gates and experts of every layer) to one safetensors file."""
    from safetensors.torch import save_file  # noqa: PLC0415

    gen = torch.Generator().manual_seed(seed)
    E, H, I = spec.num_experts, spec.hidden_size, spec.intermediate_size
    shapes, keys = spec.expert_shapes(), spec.expert_keys()
    tensors = {}
    for layer in range(spec.num_layers):
        p = layer_prefix(layer)
        tensors[p + GATE_KEY] = torch.randn(E, H, generator=gen) * H ** -0.5
        tensors[p + keys["w13"]] = torch.randn(E, *shapes["w13"], generator=gen) * H ** -0.5
        tensors[p + keys["w2"]] = torch.randn(E, *shapes["w2"], generator=gen) * I ** -0.5
    path = Path(path)
    save_file({k: v.to(spec.dtype).contiguous() for k, v in tensors.items()}, str(path))
    return path


def _open(path: Union[str, Path]):
    from safetensors import safe_open  # noqa: PLC0415

    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"checkpoint {p} does not exist (it holds the experts to load)")
    return safe_open(str(p), framework="pt", device="cpu")


def read_experts(path: Union[str, Path], spec: ModelSpec, layer: int,
                 experts: Sequence[int]) -> Dict[str, torch.Tensor]:
    """Read some experts of one layer: per-expert tensor name -> [n, ...] rows in `experts` order."""
    bad = [e for e in experts if not 0 <= e < spec.num_experts]
    if bad:
        raise ValueError(f"experts must lie in [0, E={spec.num_experts}), got {bad}")
    out = {}
    with _open(path) as f:
        for name, key in spec.expert_keys().items():
            full = layer_prefix(layer) + key
            expected = (spec.num_experts,) + spec.expert_shapes()[name]
            stored = f.get_slice(full)
            if tuple(stored.get_shape()) != expected:
                raise ValueError(f"checkpoint tensor {full!r} must be {list(expected)}, got {stored.get_shape()}")
            rows = [stored[e:e + 1] for e in experts]
            out[name] = (torch.cat(rows) if rows else torch.empty((0,) + expected[1:])).to(spec.dtype)
    return out


def read_gate(path: Union[str, Path], spec: ModelSpec, layer: int) -> torch.Tensor:
    """The router gate weight of one layer: [E, H]."""
    with _open(path) as f:
        gate = f.get_tensor(layer_prefix(layer) + GATE_KEY)
    if tuple(gate.shape) != (spec.num_experts, spec.hidden_size):
        raise ValueError(f"checkpoint gate of layer {layer} must be [{spec.num_experts}, {spec.hidden_size}], "
                         f"got {list(gate.shape)}")
    return gate.to(spec.dtype)


def build_layers(spec: ModelSpec, parallel=None) -> nn.ModuleList:
    """The L FusedMoE layers of `spec` (gates owned), split by `parallel` (a ParallelConfig) if given."""
    return nn.ModuleList(
        FusedMoE(spec.num_experts, spec.hidden_size, spec.intermediate_size, spec.routing, activation=spec.activation,
                 dtype=spec.dtype, backend=spec.backend, gate=True, name=f"layer{i}", parallel=parallel)
        for i in range(spec.num_layers))


def stack_forward(layers: nn.ModuleList, x: torch.Tensor) -> torch.Tensor:
    """h <- h + moe_l(h) over the layers. x: [T, H] -> [T, H]."""
    h = x
    for layer in layers:
        h = h + layer(h)
    return h


class ReferenceModel(nn.Module):
    """The whole model in one process, loaded from the checkpoint: the ground truth for served batches.

    Args:
        spec: ModelSpec.  checkpoint: the safetensors file written by write_checkpoint.
        backend: experts backend to use instead of spec.backend (e.g. "reference").
    """

    def __init__(self, spec: ModelSpec, checkpoint: Union[str, Path], backend: Optional[str] = None) -> None:
        super().__init__()
        from ..integrations.checkpoint import MoEKeys, load_fused_moe  # noqa: PLC0415

        self.spec = spec if backend is None else replace(spec, backend=backend)
        self.layers = build_layers(self.spec)
        for i, layer in enumerate(self.layers):
            load_fused_moe(layer, checkpoint, MoEKeys(prefixes=(layer_prefix(i),)))

    @torch.no_grad()
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H]."""
        return stack_forward(self.layers, x)

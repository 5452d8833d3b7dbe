"""Read and check the stored layout of quantized ExpertWeights (shapes, dtypes, scales).

The scheme name in ExpertWeights.quant fixes the format; the group size and the presence
of zero points of weight-only schemes are read off the stored scales, so a checkpoint
carries everything needed to run it.
"""

from __future__ import annotations

from typing import Dict, Tuple

import torch

from ..activations import is_gated
from ..checks import check_float_tensor
from ..experts.base import ExpertWeights, cached_for
from .quantize import check_fits
from .schemes import GROUP_SIZES, QuantScheme, get_scheme

__all__ = ["SCALE_KEYS", "scheme_of", "logical_intermediate_size", "check_quantized_weights", "expected_scales"]

SCALE_KEYS = ("w13_scale", "w2_scale", "w13_zero", "w2_zero", "a13_scale", "a2_scale")


def scheme_of(weights: ExpertWeights) -> QuantScheme:
    """The full QuantScheme of quantized weights (group size and zero points read off the scales).

    Kept while the weights live (backends ask every call; experts.base.cached_for) and read
    again when the scheme name or the w13 scales change."""
    key = (weights.quant, weights.scales.get("w13_scale"), weights.scales.get("w13_zero"), weights.w2)
    return cached_for(weights, "scheme", key, lambda: _read_scheme(weights))


def _read_scheme(weights: ExpertWeights) -> QuantScheme:
    base = get_scheme(weights.quant)
    if base.weight_granularity != "group":
        return base
    scale = weights.scales.get("w13_scale")
    if not isinstance(scale, torch.Tensor) or scale.dim() != 3 or scale.shape[-1] == 0:
        raise ValueError(f"quant={base.name!r} needs scales['w13_scale'] [E, N, K/g], got "
                         f"{tuple(scale.shape) if isinstance(scale, torch.Tensor) else scale!r}")
    H = weights.w2.shape[1]
    if H % scale.shape[-1] or H // scale.shape[-1] not in GROUP_SIZES:
        raise ValueError(f"scales['w13_scale'] has {scale.shape[-1]} groups over H={H}: quant={base.name!r} needs "
                         f"groups of {list(GROUP_SIZES)} columns")
    return get_scheme(base, group_size=H // scale.shape[-1], symmetric="w13_zero" not in weights.scales)


def logical_intermediate_size(weights: ExpertWeights) -> int:
    """I of quantized (possibly int4-packed) weights."""
    return weights.w2.shape[2] * get_scheme(weights.quant).pack


def expected_scales(scheme: QuantScheme, E: int, H: int, I: int,
                    n13: int) -> Dict[str, Tuple[Tuple[int, ...], torch.dtype]]:
    """name -> (shape, dtype) of every scale tensor the scheme stores (static activation scales excluded)."""
    def shape(N: int, K: int) -> Tuple[int, ...]:
        if scheme.weight_granularity == "tensor":
            return (E,)
        if scheme.weight_granularity == "channel":
            return (E, N)
        if scheme.weight_granularity == "block":
            bn, bk = scheme.weight_block
            return (E, N // bn, K // bk)
        return (E, N, K // scheme.group_size)

    out = {"w13_scale": (shape(n13, H), torch.float32), "w2_scale": (shape(H, I), torch.float32)}
    if not scheme.symmetric:
        out["w13_zero"] = (shape(n13, H), torch.uint8)
        out["w2_zero"] = (shape(H, I), torch.uint8)
    return out


def check_quantized_weights(weights: ExpertWeights, hidden_size: int, activation: str) -> int:
    """Raise ValueError/TypeError naming the tensor for any malformed quantized storage or float bias.

    Args:
        weights: ExpertWeights with quant set.  hidden_size: H of the activations.
        activation: decides whether w13 holds 2I (gated) or I rows.
    Returns:
        I, the logical intermediate size.
    """
    scheme = scheme_of(weights)
    w13, w2 = weights.w13, weights.w2
    for name, t in (("w13", w13), ("w2", w2)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            raise ValueError(f"{name} must be a 3-D tensor, got {type(t).__name__}")
        if t.dtype != scheme.storage_dtype():
            raise TypeError(
                f"{name} must be stored as {scheme.storage_dtype()} for quant={scheme.name!r}, got {t.dtype}")
    E, H, Ip = w2.shape
    I = Ip * scheme.pack
    if H != hidden_size:
        raise ValueError(f"w2 must be [E, H={hidden_size}, I/{scheme.pack}], got {tuple(w2.shape)}")
    n13 = 2 * I if is_gated(activation) else I
    if tuple(w13.shape) != (E, n13, H // scheme.pack):
        raise ValueError(f"w13 must be [E={E}, {n13}, {H // scheme.pack}] for quant={scheme.name!r} and activation "
                         f"{activation!r}, got {tuple(w13.shape)}")
    check_fits(scheme, H, I)
    for name, t, shape in (("b13", weights.b13, (E, n13)), ("b2", weights.b2, (E, H))):
        if t is not None:
            check_float_tensor(name, t, shape)
            if t.device != w13.device:
                raise ValueError(f"{name} is on {t.device}, expected {w13.device} (the device of w13)")
    expected = expected_scales(scheme, E, H, I, n13)
    if scheme.activation_granularity == "tensor":
        for name in ("a13_scale", "a2_scale"):
            if name in weights.scales:
                expected[name] = ((E,), torch.float32)
    for name in weights.scales:
        if name not in expected:
            raise ValueError(f"scales[{name!r}] is not part of quant={scheme.name!r} (expected {sorted(expected)})")
    for name, (shape, dtype) in expected.items():
        t = weights.scales.get(name)
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"quant={scheme.name!r} needs scales[{name!r}] {list(shape)} {dtype}, got none")
        if tuple(t.shape) != shape or t.dtype != dtype:
            raise ValueError(f"scales[{name!r}] must be {list(shape)} {dtype}, got {list(t.shape)} {t.dtype}")
        if t.device != w13.device:
            raise ValueError(f"scales[{name!r}] is on {t.device}, expected {w13.device} (the device of w13)")
    return I

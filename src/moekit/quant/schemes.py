"""Quantization schemes as data: what is stored for the weights and what happens to the activations.

A scheme is a frozen QuantScheme: weight dtype x weight granularity, activation dtype x
activation granularity. Schemes are looked up by name in SCHEMES; weight-only schemes take
a group size (32, 64 or 128) and a symmetric / zero-point choice through `get_scheme`.

Storage of one projection W [E, N, K] (N output rows, K input columns; K = H for w13,
K = I for w2). Scales are dequantization multipliers (w ~= q * scale), fp32, E first:

| weight granularity | q dtype and shape | scale shape | zero point |
|---|---|---|---|
| "tensor" (fp8) | float8_e4m3fn [E, N, K] | [E] | - |
| "channel" (fp8, int8) | float8_e4m3fn / int8 [E, N, K] | [E, N] | - |
| "block" 128x128 (fp8) | float8_e4m3fn [E, N, K] | [E, N/128, K/128] | - |
| "group" int8, symmetric | int8 [E, N, K] | [E, N, K/g] | - |
| "group" int8, zero points | uint8 [E, N, K] | [E, N, K/g] | uint8 [E, N, K/g] |
| "group" int4 | uint8 [E, N, K/2] | [E, N, K/g] | uint8 [E, N, K/g] if not symmetric |

int4 values are stored offset-binary (u = q + 8 for symmetric, so w = (u - 8) * scale;
w = (u - zero) * scale with zero points), two per byte along K: byte j holds column 2j in
its low nibble and column 2j+1 in its high nibble.
"""

from __future__ import annotations

import functools

from dataclasses import dataclass, replace
from typing import Dict, Optional, Tuple, Union

import torch

__all__ = [
    "QuantScheme",
    "SCHEMES",
    "GROUP_SIZES",
    "LAYER_ERROR_BOUND",
    "register_scheme",
    "get_scheme",
    "precision_of_scheme",
    "scheme_names",
]

GROUP_SIZES = (32, 64, 128)
_WEIGHT_DTYPES = ("fp8_e4m3", "int8", "int4")
_WEIGHT_GRANULARITIES = ("tensor", "channel", "block", "group")
_ACT_GRANULARITIES = ("tensor", "token", "group")

FP8_MAX = 448.0  # largest finite float8_e4m3fn value


def _is_group_size(g) -> bool:
    # an int: 64.0 == 64 would pass `in GROUP_SIZES` and break every view by the group size
    return isinstance(g, int) and not isinstance(g, bool) and g in GROUP_SIZES


@dataclass(frozen=True)
class QuantScheme:
    """One quantization scheme (see the module docstring for the stored layout).

    Fields:
        name: the registry key, also the `quant` string of ExpertWeights and ExpertsProblem.
        precision: the oracle's priority-list key ("fp8", "int8", "int8_w8a16", "int4_w4a16").
        weight_dtype: "fp8_e4m3" | "int8" | "int4".
        weight_granularity: "tensor" | "channel" | "block" | "group".
        weight_block: (rows, cols) of one weight scale for "block", else None.
        group_size: input columns per scale for "group", else None.
        symmetric: False stores an integer zero point per scale ("group" only).
        activation_dtype: "fp8_e4m3" | "int8", or None for weight-only (activations stay float).
        activation_granularity: "tensor" (static per-expert scales if given, else one dynamic
            scale per call) | "token" (dynamic per row) | "group" (dynamic per row and
            activation_group columns), or None for weight-only.
        activation_group: columns per activation scale for "group", else None.
    """

    name: str
    precision: str
    weight_dtype: str
    weight_granularity: str
    weight_block: Optional[Tuple[int, int]] = None
    group_size: Optional[int] = None
    symmetric: bool = True
    activation_dtype: Optional[str] = None
    activation_granularity: Optional[str] = None
    activation_group: Optional[int] = None

    def __post_init__(self) -> None:
        if self.weight_dtype not in _WEIGHT_DTYPES:
            raise ValueError(f"weight_dtype must be one of {list(_WEIGHT_DTYPES)}, got {self.weight_dtype!r}")
        if self.weight_granularity not in _WEIGHT_GRANULARITIES:
            raise ValueError(
                f"weight_granularity must be one of {list(_WEIGHT_GRANULARITIES)}, got {self.weight_granularity!r}")
        if (self.weight_granularity == "block") != (self.weight_block is not None):
            raise ValueError(f"weight_block must be set exactly for 'block' granularity, got {self.weight_block!r}")
        if self.weight_granularity == "group":
            if not _is_group_size(self.group_size):
                raise ValueError(f"group_size must be one of {list(GROUP_SIZES)}, got {self.group_size!r}")
        elif self.group_size is not None:
            raise ValueError(f"group_size applies to 'group' weight granularity only, got {self.group_size!r}")
        if not self.symmetric and (self.weight_granularity != "group" or self.weight_dtype == "fp8_e4m3"):
            raise ValueError("zero points (symmetric=False) apply to int8/int4 'group' weights only")
        if self.weight_dtype == "int4" and self.weight_granularity != "group":
            raise ValueError(f"int4 weights need 'group' granularity, got {self.weight_granularity!r}")
        if (self.activation_dtype is None) != (self.activation_granularity is None):
            raise ValueError("activation_dtype and activation_granularity must be set together")
        if self.activation_granularity is not None and self.activation_granularity not in _ACT_GRANULARITIES:
            raise ValueError(
                f"activation_granularity must be one of {list(_ACT_GRANULARITIES)}, "
                f"got {self.activation_granularity!r}")
        if (self.activation_granularity == "group") != (self.activation_group is not None):
            raise ValueError(
                f"activation_group must be set exactly for 'group' activations, got {self.activation_group!r}")

    @property
    def weight_only(self) -> bool:
        """Activations stay in the model's float dtype (w*a16 schemes)."""
        return self.activation_dtype is None

    @property
    def pack(self) -> int:
        """Weight values per stored element along K (2 for int4, else 1)."""
        return 2 if self.weight_dtype == "int4" else 1

    @property
    def column_multiple(self) -> int:
        """H and I must be multiples of this (1 when any size fits)."""
        if self.weight_granularity == "group":
            return self.group_size
        if self.weight_granularity == "block":
            return max(self.weight_block[1], self.activation_group or 1)
        return self.activation_group or 1

    def storage_dtype(self) -> torch.dtype:
        """dtype of the stored weight tensor q."""
        if self.weight_dtype == "fp8_e4m3":
            return torch.float8_e4m3fn
        if self.weight_dtype == "int8" and self.symmetric:
            return torch.int8
        return torch.uint8

    def describe(self) -> str:
        """The stored layout in words, e.g. "int4 weights per group of 128 columns, float activations"."""
        w = f"{self.weight_dtype} weights per {self.weight_granularity}"
        if self.weight_block is not None:
            w += f" {self.weight_block[0]}x{self.weight_block[1]}"
        if self.group_size is not None:
            w += f" of {self.group_size} columns" + ("" if self.symmetric else " with zero points")
        if self.weight_only:
            return w + ", float activations"
        a = f"{self.activation_dtype} activations per {self.activation_granularity}"
        if self.activation_group is not None:
            a += f" of 1x{self.activation_group}"
        return f"{w}, {a}"


SCHEMES: Dict[str, QuantScheme] = {}

# Relative error ||out_q - out_bf16|| / ||out_bf16|| of a FusedMoE quantized from a bf16
# layer's weights, on Gaussian weights (std H^-1/2, I^-1/2) and inputs with SwiGLU, about 1.25x
# the worst of six seeds (tests/quant/test_quant_layer.py checks them). Round-to-nearest
# int4 is coarse on such weights: about 0.21 at group 128, 0.17 at 32, 0.14 at 32 with zero points.
LAYER_ERROR_BOUND: Dict[str, float] = {
    "fp8_w8a8": 0.08, "fp8_w8a8_channel": 0.08, "fp8_w8a8_block128": 0.08,
    "int8_w8a8": 0.03, "int8_w8a16": 0.02, "int4_w4a16": 0.26,
}


def register_scheme(scheme: QuantScheme) -> QuantScheme:
    """Add a scheme to the registry under scheme.name."""
    if not isinstance(scheme, QuantScheme):
        raise TypeError(f"scheme must be a QuantScheme, got {type(scheme).__name__}")
    SCHEMES[scheme.name] = scheme
    return scheme


def scheme_names() -> Tuple[str, ...]:
    """The registered scheme names, sorted."""
    return tuple(sorted(SCHEMES))


def get_scheme(scheme: Union[str, QuantScheme], *, group_size: Optional[int] = None,
               symmetric: Optional[bool] = None) -> QuantScheme:
    """The QuantScheme for a name (or a QuantScheme, returned as is unless options are given).

    Args:
        scheme: a registered name, e.g. "int4_w4a16", or a QuantScheme.
        group_size: 32, 64 or 128 for weight-only schemes (default 128).
        symmetric: False adds zero points (weight-only schemes; default True).
    """
    if isinstance(scheme, QuantScheme):
        _check_registered(scheme)
        base = scheme
    elif isinstance(scheme, str):
        if scheme not in SCHEMES:
            raise ValueError(f"quant must be one of {list(scheme_names())}, got {scheme!r}")
        base = SCHEMES[scheme]
    else:
        raise TypeError(f"quant must be a scheme name (str) or a QuantScheme, got {type(scheme).__name__}")
    if group_size is None and symmetric is None:
        return base
    if base.weight_granularity != "group":
        raise ValueError(f"group_size and symmetric apply to weight-only schemes, not {base.name!r}")
    if group_size is not None and not _is_group_size(group_size):
        raise ValueError(f"group_size must be one of {list(GROUP_SIZES)}, got {group_size!r}")
    if symmetric is not None and not isinstance(symmetric, bool):
        raise TypeError(f"symmetric must be a bool, got {type(symmetric).__name__}")
    return _variant(base, group_size or base.group_size, base.symmetric if symmetric is None else symmetric)


def _check_registered(scheme: QuantScheme) -> None:
    """Raise ValueError unless scheme is a registered one (or its group size / zero-point variant):
    weights carry only the name, so backends run the registered scheme of that name."""
    base = SCHEMES.get(scheme.name)
    if base is None:
        raise ValueError(f"QuantScheme {scheme.name!r} is not registered (moekit.quant.register_scheme): "
                         f"backends look schemes up by name, one of {list(scheme_names())}")
    if scheme == base or (base.weight_granularity == scheme.weight_granularity == "group"
                          and replace(base, group_size=scheme.group_size, symmetric=scheme.symmetric) == scheme):
        return
    raise ValueError(f"QuantScheme {scheme.name!r} ({scheme.describe()}) differs from the registered scheme of that "
                     f"name ({base.describe()}) beyond group_size / symmetric; register it under a name of its own")


@functools.lru_cache(maxsize=256)
def _variant(base: QuantScheme, group_size: int, symmetric: bool) -> QuantScheme:
    """One object per (scheme, options): backends read the scheme off the weights every call."""
    return replace(base, group_size=group_size, symmetric=symmetric)


def precision_of_scheme(name: str) -> str:
    """The oracle's precision key of a scheme name ("fp8", "int8", "int8_w8a16", "int4_w4a16")."""
    return get_scheme(name).precision


register_scheme(QuantScheme("fp8_w8a8", "fp8", "fp8_e4m3", "tensor",
                            activation_dtype="fp8_e4m3", activation_granularity="tensor"))
register_scheme(QuantScheme("fp8_w8a8_channel", "fp8", "fp8_e4m3", "channel",
                            activation_dtype="fp8_e4m3", activation_granularity="token"))
register_scheme(QuantScheme("fp8_w8a8_block128", "fp8", "fp8_e4m3", "block", weight_block=(128, 128),
                            activation_dtype="fp8_e4m3", activation_granularity="group", activation_group=128))
register_scheme(QuantScheme("int8_w8a8", "int8", "int8", "channel",
                            activation_dtype="int8", activation_granularity="token"))
register_scheme(QuantScheme("int8_w8a16", "int8_w8a16", "int8", "group", group_size=128))
register_scheme(QuantScheme("int4_w4a16", "int4_w4a16", "int4", "group", group_size=128))

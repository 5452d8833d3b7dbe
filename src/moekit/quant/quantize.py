"""Quantize and dequantize expert weights and activations: pure tensor functions, one per step.

Weights W [E, N, K] (N output rows, K input columns) map to (q, scale, zero) in the layout
of moekit.quant.schemes; activations x [n, K] map to (q, scale) per the scheme's activation
granularity. Every function here rounds to nearest (ties to even) and saturates at the
format's range, which only matters for static activation scales (dynamic and weight scales
are computed so that nothing saturates).

`quantize_experts` turns float w13 [E, 2I, H] and w2 [E, H, I] into an ExpertWeights whose
`scales` holds every scale and zero point with E first (EPLB moves them with the weights):
"w13_scale", "w2_scale", "w13_zero", "w2_zero" (zero points), "a13_scale", "a2_scale"
(static per-expert activation scales [E], per-tensor fp8 only).
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Tuple, Union

import torch

from ..checks import check_float_tensor
from ..experts.base import ExpertWeights
from .schemes import FP8_MAX, GROUP_SIZES, QuantScheme, get_scheme

__all__ = [
    "QuantizedWeight",
    "check_fits",
    "quantize_weight",
    "dequantize_weight",
    "pack_int4",
    "unpack_int4",
    "quantize_activation",
    "dequantize_activation",
    "fake_quantize_activation",
    "quantize_experts",
]

_FLOAT = (torch.float32, torch.bfloat16, torch.float16)


class QuantizedWeight(NamedTuple):
    """q [E, N, K / pack], scale (shape per granularity) fp32, zero uint8 [E, N, K/g] or None."""

    q: torch.Tensor
    scale: torch.Tensor
    zero: Optional[torch.Tensor]


def _int_range(scheme: QuantScheme) -> Tuple[int, int]:
    """(qmax of the symmetric signed range, qmax of the unsigned zero-point range)."""
    return (7, 15) if scheme.weight_dtype == "int4" else (127, 255)


def _safe(scale: torch.Tensor) -> torch.Tensor:
    # An all-zero slice gets scale 1: its values quantize to 0 and dequantize exactly.
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def check_fits(scheme: QuantScheme, hidden_size: int, intermediate_size: int) -> None:
    """Raise ValueError when H or I does not fit the scheme's groups or blocks (never left unquantized)."""
    m = scheme.column_multiple
    if hidden_size % m == 0 and intermediate_size % m == 0:
        return
    hint = ""
    if scheme.weight_granularity == "group":
        what = f"weight groups of {m} input columns"
        fits = [g for g in GROUP_SIZES if g < m and hidden_size % g == 0 and intermediate_size % g == 0]
        if fits:  # a smaller group of the same scheme takes these sizes
            zeros = "" if scheme.symmetric else ", symmetric=False"
            hint = f"; get_scheme({scheme.name!r}, group_size={fits[-1]}{zeros}) fits them"
    elif scheme.weight_granularity == "block":
        bn, bk = scheme.weight_block
        what = f"{bn}x{bk} weight blocks and 1x{scheme.activation_group} activation groups"
    else:
        what = f"1x{m} activation groups"
    raise ValueError(
        f"quant={scheme.name!r} needs hidden_size and intermediate_size to be multiples of {m} "
        f"({what}), got H={hidden_size}, I={intermediate_size}{hint}")


def pack_int4(u: torch.Tensor) -> torch.Tensor:
    """Pack 4-bit values two per byte along the last dim: column 2j low nibble, 2j+1 high.

    Args:
        u: [..., K] uint8 with values in [0, 15], K even.
    Returns:
        [..., K/2] uint8.
    """
    if u.dtype != torch.uint8:
        raise TypeError(f"u must be uint8, got {u.dtype}")
    if u.shape[-1] % 2:
        raise ValueError(f"the last dim of u must be even to pack two per byte, got {u.shape[-1]}")
    if u.numel() and int(u.max()) > 15:  # a high bit would land in the neighbouring value's nibble
        raise ValueError(f"u must hold 4-bit values in [0, 15], got a maximum of {int(u.max())}")
    return u[..., 0::2] | (u[..., 1::2] << 4)


def unpack_int4(p: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_int4: [..., K/2] uint8 -> [..., K] uint8 in [0, 15]."""
    if p.dtype != torch.uint8:
        raise TypeError(f"p must be uint8, got {p.dtype}")
    return torch.stack((p & 15, p >> 4), dim=-1).flatten(-2)


@torch.no_grad()  # not differentiable: weights that require grad (parameters) give plain tensors
def quantize_weight(w: torch.Tensor, scheme: QuantScheme) -> QuantizedWeight:
    """Quantize one projection per the scheme's weight dtype and granularity.

    Args:
        w: [E, N, K] float. K (and N for blocks) must fit the scheme (see check_fits).
    Returns:
        QuantizedWeight in the layout of moekit.quant.schemes.
    """
    if w.dim() != 3:
        raise ValueError(f"w must be 3-D [E, N, K], got shape {tuple(w.shape)}")
    E, N, K = w.shape
    rows, cols = scheme.weight_block or (1, scheme.group_size or 1)
    if N % rows or K % cols:
        raise ValueError(f"quant={scheme.name!r} needs w [E, N, K] with N a multiple of {rows} and K of {cols}, "
                         f"got {tuple(w.shape)}")
    # contiguous fp32: the stored q and scales follow w's layout, and kernels need them contiguous
    w = w.contiguous().float()
    if scheme.weight_granularity == "tensor":
        scale = _safe(w.abs().amax(dim=(1, 2)) / FP8_MAX)  # [E]
        return QuantizedWeight(_to_fp8(w / scale[:, None, None]), scale, None)
    if scheme.weight_granularity == "channel":
        amax = w.abs().amax(dim=2)  # [E, N]
        if scheme.weight_dtype == "fp8_e4m3":
            scale = _safe(amax / FP8_MAX)
            return QuantizedWeight(_to_fp8(w / scale[..., None]), scale, None)
        scale = _safe(amax / 127.0)
        return QuantizedWeight(_to_int8(w / scale[..., None]), scale, None)
    if scheme.weight_granularity == "block":
        bn, bk = scheme.weight_block
        w5 = w.view(E, N // bn, bn, K // bk, bk)
        scale = _safe(w5.abs().amax(dim=(2, 4)) / FP8_MAX)  # [E, N/bn, K/bk]
        q = _to_fp8(w5 / scale[:, :, None, :, None]).view(E, N, K)
        return QuantizedWeight(q, scale, None)
    g = scheme.group_size
    w4 = w.view(E, N, K // g, g)
    sym_max, uns_max = _int_range(scheme)
    if scheme.symmetric:
        scale = _safe(w4.abs().amax(dim=3) / sym_max)  # [E, N, K/g]
        q = torch.round(w4 / scale[..., None]).clamp_(-sym_max - 1, sym_max).view(E, N, K)
        if scheme.weight_dtype == "int8":
            return QuantizedWeight(q.to(torch.int8), scale, None)
        return QuantizedWeight(pack_int4((q + 8).to(torch.uint8)), scale, None)
    lo = w4.amin(dim=3).clamp(max=0.0)  # the range always holds 0, so 0 is exact
    hi = w4.amax(dim=3).clamp(min=0.0)
    span = hi - lo  # inf when hi and -lo are both near the fp32 maximum: then divide before subtracting
    scale = _safe(torch.where(torch.isfinite(span), span / uns_max, hi / uns_max - lo / uns_max))  # [E, N, K/g]
    zero = torch.round(-lo / scale).clamp_(0, uns_max)
    u = (torch.round(w4 / scale[..., None]) + zero[..., None]).clamp_(0, uns_max).to(torch.uint8).view(E, N, K)
    if scheme.weight_dtype == "int4":
        u = pack_int4(u)
    return QuantizedWeight(u, scale, zero.to(torch.uint8))


def _to_fp8(v: torch.Tensor) -> torch.Tensor:
    return v.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def _to_int8(v: torch.Tensor) -> torch.Tensor:
    """v: a temporary (rounded in place)."""
    return v.round_().clamp_(-127, 127).to(torch.int8)


def dequantize_weight(q: torch.Tensor, scale: torch.Tensor, zero: Optional[torch.Tensor],
                      scheme: QuantScheme) -> torch.Tensor:
    """Inverse of quantize_weight: (q, scale, zero) -> fp32 [E, N, K].

    Args:
        q: [E, N, K / pack] stored weights.  scale, zero: as quantize_weight returns them.
    """
    if scheme.weight_dtype == "int4":
        q = unpack_int4(q)
    E, N, K = q.shape
    qf = q.float()
    if scheme.weight_granularity == "tensor":
        return qf * scale[:, None, None]
    if scheme.weight_granularity == "channel":
        return qf * scale[..., None]
    if scheme.weight_granularity == "block":
        bn, bk = scheme.weight_block
        return (qf.view(E, N // bn, bn, K // bk, bk) * scale[:, :, None, :, None]).view(E, N, K)
    g = scheme.group_size
    qf = qf.view(E, N, K // g, g)
    if zero is not None:
        qf = qf - zero.float()[..., None]
    elif scheme.weight_dtype == "int4":
        qf = qf - 8.0
    return (qf * scale[..., None]).view(E, N, K)


def _act_max(scheme: QuantScheme) -> float:
    return FP8_MAX if scheme.activation_dtype == "fp8_e4m3" else 127.0


def quantize_activation(x: torch.Tensor, scheme: QuantScheme,
                        scale: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Quantize GEMM input rows per the scheme's activation granularity.

    Args:
        x: [n, K] float.
        scale: a static per-tensor scale (0-d or [1] fp32), "tensor" granularity only;
            None computes the scale from x (dynamic).
    Returns:
        q [n, K] (float8_e4m3fn or int8) and scale fp32: [1, 1] ("tensor"),
        [n, 1] ("token") or [n, K / activation_group] ("group").
    """
    if scheme.weight_only:
        raise ValueError(f"quant={scheme.name!r} is weight-only: activations are not quantized")
    G = scheme.activation_group or 1
    if x.dim() != 2 or x.shape[1] % G:
        raise ValueError(f"x must be 2-D [n, K] with K a multiple of {G} for quant={scheme.name!r}, "
                         f"got shape {tuple(x.shape)}")
    x = x.float()
    qmax = _act_max(scheme)
    gran = scheme.activation_granularity
    if scale is not None:
        if gran != "tensor":
            raise ValueError(f"a static activation scale applies to 'tensor' granularity, not {gran!r}")
        s = scale.float().reshape(1, 1)
    elif gran == "tensor":
        s = _safe(x.abs().amax().reshape(1, 1) / qmax) if x.numel() else x.new_ones(1, 1)
    elif gran == "token":
        s = _safe(x.abs().amax(dim=1, keepdim=True) / qmax)  # [n, 1]
    else:
        n, K = x.shape
        G = scheme.activation_group
        s = _safe(x.view(n, K // G, G).abs().amax(dim=2) / qmax)  # [n, K/G]
    q = _to_fp8(_div(x, s, scheme)) if scheme.activation_dtype == "fp8_e4m3" else _to_int8(_div(x, s, scheme))
    return q, s


def _div(x: torch.Tensor, s: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    if scheme.activation_granularity != "group":
        return x / s
    n, K = x.shape
    G = scheme.activation_group
    return (x.view(n, K // G, G) / s[..., None]).view(n, K)


def dequantize_activation(q: torch.Tensor, scale: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    """Inverse of quantize_activation: fp32 [n, K]."""
    qf = q.float()
    if scheme.activation_granularity != "group":
        return qf * scale
    n, K = qf.shape
    G = scheme.activation_group
    return (qf.view(n, K // G, G) * scale[..., None]).view(n, K)


def fake_quantize_activation(x: torch.Tensor, scheme: QuantScheme,
                             scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """dequantize(quantize(x)): what a w8a8 GEMM sees of x [n, K], as fp32."""
    q, s = quantize_activation(x, scheme, scale)
    return dequantize_activation(q, s, scheme)


def _check_float(name: str, t) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _FLOAT:
        raise TypeError(f"{name} must be a float32/bfloat16/float16 tensor to quantize, got {t.dtype}")
    if t.numel() and not torch.isfinite(t).all():
        raise ValueError(f"{name} contains non-finite values (inf or NaN); they cannot be quantized")
    return t


def quantize_experts(
    w13: torch.Tensor,
    w2: torch.Tensor,
    scheme: Union[str, QuantScheme],
    *,
    group_size: Optional[int] = None,
    symmetric: Optional[bool] = None,
    b13: Optional[torch.Tensor] = None,
    b2: Optional[torch.Tensor] = None,
    a13_scale: Optional[torch.Tensor] = None,
    a2_scale: Optional[torch.Tensor] = None,
) -> ExpertWeights:
    """Quantize float expert weights into an ExpertWeights with quant=scheme name.

    Args:
        w13: [E, 2I, H] (gated) or [E, I, H] float.  w2: [E, H, I] float.
        scheme: a scheme name ("fp8_w8a8", "int4_w4a16", ...) or a QuantScheme.
        group_size: 32, 64 or 128 (weight-only schemes).  symmetric: False adds zero points.
        b13: [E, 2I] or [E, I], b2: [E, H]: optional float biases, kept as they are (shape and
            dtype checked).
        a13_scale, a2_scale: [E] fp32 static activation scales ("fp8_w8a8" only; without
            them the activation scale is computed per call).
    Returns:
        ExpertWeights(w13=q13, w2=q2, b13, b2, scales={...}, quant=name).
    """
    s = get_scheme(scheme, group_size=group_size, symmetric=symmetric)
    _check_float("w13", w13)
    _check_float("w2", w2)
    if w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"w13 and w2 must be 3-D, got w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)}")
    E, H, I = w2.shape
    if H < 1 or I < 1:
        raise ValueError(f"w2 must be [E, H, I] with H >= 1 and I >= 1, got {tuple(w2.shape)}")
    if w13.shape[0] != E or w13.shape[2] != H or w13.shape[1] not in (I, 2 * I):
        raise ValueError(f"w13 must be [E={E}, 2I={2 * I} or I={I}, H={H}] to match w2 {tuple(w2.shape)}, "
                         f"got {tuple(w13.shape)}")
    check_fits(s, H, I)
    for name, t, shape in (("b13", b13, (E, w13.shape[1])), ("b2", b2, (E, H))):
        if t is not None:  # kept float beside the quantized weights: checked here, not at the first call
            check_float_tensor(name, t, shape)
    q13, q2 = quantize_weight(w13, s), quantize_weight(w2, s)
    scales = {"w13_scale": q13.scale, "w2_scale": q2.scale}
    if q13.zero is not None:
        scales.update(w13_zero=q13.zero, w2_zero=q2.zero)
    for name, t in (("a13_scale", a13_scale), ("a2_scale", a2_scale)):
        if t is None:
            continue
        if s.activation_granularity != "tensor":
            raise ValueError(f"{name} (static activation scales) applies to per-tensor fp8 schemes, not {s.name!r}")
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != (E,) or not t.is_floating_point():
            raise ValueError(f"{name} must be a float tensor [E={E}], got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
        if not bool((t > 0).all()) or not bool(torch.isfinite(t).all()):
            raise ValueError(f"{name} must be finite and > 0")
        scales[name] = t.detach().float().to(w13.device)
    return ExpertWeights(q13.q, q2.q, b13, b2, scales=scales, quant=s.name)

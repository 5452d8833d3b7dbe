"""`cpu_wo`: weight-only int4 / int8 experts on CPU ("int4_w4a16", "int8_w8a16").

Two compute paths, chosen per call by a fixed rule (both tested against the emulation):

- int4 kernel (int4 weights, bf16 activations, torch with `_weight_int4pack_mm_for_cpu`):
  torch's CPU int4 GEMM, which unpacks int4 in registers and accumulates in fp32. It wants
  its own packing and one bf16 (scale, offset) pair per group, so the weights are repacked
  once per weight tensor and cached (about the stored int4 bytes again); a change to the
  weights (a new tensor or an in-place write) repacks. Its inputs and outputs are bf16:
  the bf16 GEMM inputs and bf16 group scales add about 2^-9 relative error.
- fp32 blocks (every other case: int8 weights, or fp32/fp16 activations): each expert's
  weights are dequantized in blocks of output rows (about BLOCK_BYTES of fp32, in one
  reused buffer that stays in L2) and used at once by fp32 GEMMs; int4 is unpacked per block.
  Exact fp32 apart from rounding order.

Why two: at decode (M=1) the fp32 path spends its time converting weights (int4 -> fp32
costs about what bf16 -> fp32 does), so it cannot beat a bf16 layer by more than the
bandwidth saved; torch's int4 kernel skips the conversion but is fast only on bf16 inputs
(fp32 and fp16 inputs take a scalar loop, 30-50x slower, measured).

Supports: CPU, fp32/bf16/fp16 activations, group sizes 32/64/128, symmetric or zero
points, every activation, biases, expert_map, weights on input. No autograd.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch.utils.weak import WeakTensorKeyDictionary

from ..activations import apply_activation
from ..quant.layout import scheme_of
from ..quant.schemes import QuantScheme
from .base import ExpertsBackend, ExpertsProblem, ExpertWeights, register_backend
from .common import loop_over_experts

__all__ = ["CPUWeightOnlyBackend", "BLOCK_BYTES", "int4_kernel_available"]

# fp32 bytes of one dequantized weight block (rows x K); sized for a 1-2 MB L2.
BLOCK_BYTES = 512 * 1024

_SCHEMES = ("int8_w8a16", "int4_w4a16")
_NIBBLES = 0x0F0F0F0F  # a low-nibble mask for each byte of an int32


def int4_kernel_available() -> bool:
    """Whether this torch has the CPU int4 GEMM the int4 kernel path uses."""
    ops = torch.ops.aten
    return hasattr(ops, "_weight_int4pack_mm_for_cpu") and hasattr(ops, "_convert_weight_to_int4pack_for_cpu")


def _unpacked_int4(p: torch.Tensor) -> torch.Tensor:
    """[N, K/2] uint8 (two int4 per byte) -> [N, K] int32 values in [0, 15]."""
    return torch.stack((p & 15, p >> 4), dim=-1).flatten(-2).to(torch.int32)


def _repack_int4(q: torch.Tensor, scale: torch.Tensor, zero: Optional[torch.Tensor], group: int):
    """One projection [E, N, K/2] into torch's CPU int4 layout.

    torch's kernel computes w = (u - 8) * s + offset per group; moekit stores w = (u - z) * s,
    so offset = (8 - z) * s (0 for symmetric weights).
    Returns: packed [E, N, K/2] uint8 and scale_offset [E, K/g, N, 2] bf16.
    """
    packed = torch.stack([torch.ops.aten._convert_weight_to_int4pack_for_cpu(_unpacked_int4(q[e]), 2)
                          for e in range(q.shape[0])])
    offset = torch.zeros_like(scale) if zero is None else (8.0 - zero.float()) * scale  # [E, N, K/g]
    scale_offset = torch.stack((scale, offset), dim=-1).transpose(1, 2).contiguous().to(torch.bfloat16)
    return packed, scale_offset


class _Int4Repacked:
    """The cache of repacked int4 weights, keyed by the stored w13 tensor (dropped with it)."""

    def __init__(self) -> None:
        self._cache = WeakTensorKeyDictionary()

    def get(self, weights: ExpertWeights, scheme: QuantScheme):
        tensors = (weights.w13, weights.w2) + tuple(weights.scales[n] for n in sorted(weights.scales))
        version = tuple((t.data_ptr(), t._version) for t in tensors)
        hit = self._cache.get(weights.w13)
        if hit is None or hit[0] != version:
            s = weights.scales
            hit = (version,
                   _repack_int4(weights.w13, s["w13_scale"], s.get("w13_zero"), scheme.group_size),
                   _repack_int4(weights.w2, s["w2_scale"], s.get("w2_zero"), scheme.group_size))
            self._cache[weights.w13] = hit
        return hit[1], hit[2]


def _dequantize_rows(q: torch.Tensor, scale: torch.Tensor, zero: Optional[torch.Tensor],
                     scheme: QuantScheme, out: torch.Tensor) -> torch.Tensor:
    """Dequantize rows of one expert's projection into out.

    Args:
        q: [n, K / pack] stored rows.  scale: [n, K/g] fp32.  zero: [n, K/g] uint8 or None.
        out: [n, K] fp32 buffer, overwritten and returned.
    """
    n, K = out.shape
    g = scheme.group_size
    if scheme.weight_dtype == "int4":
        # Unpack through int32 views: one mask and one shift for 8 values at a time.
        p32 = q.view(torch.int32)  # [n, K/8]
        pairs = out.view(n, K // 2, 2)
        pairs[:, :, 0].copy_((p32 & _NIBBLES).view(torch.uint8))
        pairs[:, :, 1].copy_(((p32 >> 4) & _NIBBLES).view(torch.uint8))
    else:
        out.copy_(q)
    groups = out.view(n, K // g, g)
    if zero is not None:
        groups.sub_(zero.unsqueeze(-1))
    elif scheme.weight_dtype == "int4":
        groups.sub_(8.0)
    groups.mul_(scale.unsqueeze(-1))
    return out


def _blocked_linear(rows: torch.Tensor, weights: ExpertWeights, name: str, e: int, scheme: QuantScheme,
                    buf: torch.Tensor) -> torch.Tensor:
    """rows [n, K] fp32 @ dequantized W_e^T -> [n, N] fp32, block by block over N."""
    q = getattr(weights, name)[e]  # [N, K / pack]
    scale = weights.scales[f"{name}_scale"][e]  # [N, K/g]
    zero = weights.scales.get(f"{name}_zero")
    zero = None if zero is None else zero[e]
    N, K = q.shape[0], rows.shape[1]
    nb = max(1, min(N, BLOCK_BYTES // (4 * K)))
    out = rows.new_empty((rows.shape[0], N))
    for r0 in range(0, N, nb):
        r1 = min(N, r0 + nb)
        w = _dequantize_rows(q[r0:r1], scale[r0:r1], None if zero is None else zero[r0:r1], scheme,
                             buf[:(r1 - r0) * K].view(r1 - r0, K))
        out[:, r0:r1] = rows @ w.t()
    return out


class CPUWeightOnlyBackend(ExpertsBackend):
    name = "cpu_wo"
    description = ("weight-only int4/int8 on CPU: torch's int4 kernel on bf16 inputs, else fp32 GEMMs "
                   "from weights dequantized in cache-sized blocks")
    differentiable = False

    def __init__(self) -> None:
        self._repacked = _Int4Repacked()

    def unsupported(self, problem: ExpertsProblem) -> Optional[str]:
        if problem.device != "cpu":
            return f"runs on CPU tensors only, got device {problem.device!r}"
        if problem.quant not in _SCHEMES:
            return f"runs weight-only schemes {list(_SCHEMES)}, got quant={problem.quant!r}"
        return None

    @staticmethod
    def uses_int4_kernel(x_dtype: torch.dtype, scheme: QuantScheme) -> bool:
        """The path rule of the module docstring."""
        return scheme.weight_dtype == "int4" and x_dtype == torch.bfloat16 and int4_kernel_available()

    def apply(self, x, weights, topk_weights, topk_ids, *, activation, activation_params,
              apply_router_weight_on_input, expert_map):
        scheme = scheme_of(weights)
        if self.uses_int4_kernel(x.dtype, scheme):
            expert, row_dtype = self._int4_kernel_expert(weights, scheme, activation, activation_params)
        else:
            expert, row_dtype = self._blocked_expert(weights, scheme, activation, activation_params), torch.float32
        return loop_over_experts(x, topk_weights, topk_ids, expert_map, weights.num_experts,
                                 apply_router_weight_on_input, expert, row_dtype)

    def _int4_kernel_expert(self, weights, scheme, activation, activation_params) -> Tuple:
        (p13, so13), (p2, so2) = self._repacked.get(weights, scheme)
        g = scheme.group_size
        mm = torch.ops.aten._weight_int4pack_mm_for_cpu

        def expert(e: int, rows: torch.Tensor) -> torch.Tensor:
            h = mm(rows, p13[e], g, so13[e]).float()  # [n, 2I]
            if weights.b13 is not None:
                h = h + weights.b13[e].float()
            a = apply_activation(h, activation, activation_params).to(torch.bfloat16)  # [n, I]
            y = mm(a, p2[e], g, so2[e]).float()  # [n, H]
            return y if weights.b2 is None else y + weights.b2[e].float()

        return expert, torch.bfloat16

    @staticmethod
    def _blocked_expert(weights, scheme, activation, activation_params):
        H = weights.w2.shape[1]
        I = weights.w2.shape[2] * scheme.pack
        buf = torch.empty(max(H, I, BLOCK_BYTES // 4), dtype=torch.float32)  # one block, reused

        def expert(e: int, rows: torch.Tensor) -> torch.Tensor:
            h = _blocked_linear(rows, weights, "w13", e, scheme, buf)  # [n, 2I]
            if weights.b13 is not None:
                h = h + weights.b13[e].float()
            a = apply_activation(h, activation, activation_params)  # [n, I]
            y = _blocked_linear(a, weights, "w2", e, scheme, buf)  # [n, H]
            return y if weights.b2 is None else y + weights.b2[e].float()

        return expert


register_backend(CPUWeightOnlyBackend())

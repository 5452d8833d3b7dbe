"""`cpu_wo`: weight-only int4 / int8 experts on CPU ("int4_w4a16", "int8_w8a16").

Compute paths, chosen per call by a fixed rule (each tested against the emulation):

- native (where moekit's native kernels build: moekit.native): decode (at most
  DIRECT_ASSIGNMENTS assignments) runs every token's FFN in one native call
  (NativeLibrary.decode), straight from the stored int4 / int8 weights and fp32 group scales,
  any activation dtype; on CPUs with VNNI (AVX-512 or AVX-VNNI), and for int4 on any AVX2 CPU,
  the products are integer dot products against x in 16-bit fixed point per group (x's
  rounding at most 2^-14 of its group's max |x|, finer than bf16's for all but the values 2^5
  below that max), else fp32.
  Sorted calls that would take the fp32 blocks run on the same kernel up to NATIVE_ROWS rows
  an expert, bf16 int4 ones with integer products up to NATIVE_ROWS_INT4_INTEGER (up to
  BF16_ROWS where the bf16 kernels below take over). At E=64, k=8,
  H=1024, I=512, M=1 (bench/cpu_quant.py): int4 0.57 ms against 1.10 through torch's int4
  kernel, 2.7x the bf16 `cpu` backend, on a 2-core AVX-512 VNNI host; on a 2-core AVX2 host
  (AMD Zen 3) 0.43-0.48 ms against 1.4-1.5, 2.1-2.6x the bf16 backend (bench/NOTES-cpu.md).
- int4 kernel (int4 weights, bf16 activations, torch with `_weight_int4pack_mm_for_cpu`):
  torch's CPU int4 GEMM, which unpacks int4 in registers and accumulates in fp32. It wants
  its own packing and one bf16 (scale, offset) pair per group, so the weights are repacked
  once per weight tensor and cached (about the stored int4 bytes again); a change to the
  weights (a new tensor or an in-place write) repacks. Its inputs and outputs are bf16:
  the bf16 GEMM inputs and bf16 group scales add about 2^-9 relative error.
- bf16 kernels (CPUs with AVX-512 BF16 and no AMX, more than BF16_ROWS rows an expert): the
  stored weights dequantized to bf16 a block at a time in L1 and multiplied by moekit's
  vdpbf16ps kernels, GEMM1 with its activation (NativeLibrary.bf16_gate_up / bf16_gemm); the
  bf16 weights, inputs and GEMM1 output add about 2^-9 relative error, as the int4 kernel's.
- fp32 blocks (every other case: int8 weights, or fp32/fp16 activations): each expert's
  weights are dequantized in blocks of output rows (about BLOCK_BYTES of fp32, in one
  reused buffer that stays in L2) and used at once by fp32 GEMMs; int4 is unpacked per block.
  Exact fp32 apart from rounding order.

Why the last two, where the native decode does not run: at decode (M=1) the fp32 path spends
its time converting weights (int4 -> fp32 costs about what bf16 -> fp32 does), so it cannot
beat a bf16 layer by more than the bandwidth saved; torch's int4 kernel skips the conversion
but is fast only on bf16 inputs (fp32 and fp16 inputs take a scalar loop, about 45x slower,
measured).

Supports: CPU, fp32/bf16/fp16 activations, group sizes 32/64/128, symmetric or zero
points, every activation, biases, expert_map, weights on input. No autograd.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
from torch.utils.weak import WeakTensorKeyDictionary

from .. import native
from ..activations import apply_activation
from ..quant.layout import scheme_of
from ..quant.schemes import QuantScheme
from .base import ExpertsBackend, ExpertsProblem, ExpertWeights, register_backend, version_of
from .common import (add_bias_by_span, bf16_sorted, decode_by_token, native_decode, sort_rows, span_segments,
                     unsort_rows)
from .cpu import bf16_without_amx

__all__ = ["CPUWeightOnlyBackend", "BLOCK_BYTES", "int4_kernel_available"]

# fp32 bytes of one dequantized weight block (rows x K): about the L2 of both cores together;
# 0.25-8 MB measured within noise of each other on the benchmark shape, 2 MB the best.
BLOCK_BYTES = 2 * 1024 * 1024

# At most this many (token, slot) assignments skip the sort (decode).
DIRECT_ASSIGNMENTS = 16

# Sorted calls that would take the fp32 blocks (int8 weights, or int4 with fp32 / fp16 inputs)
# run on moekit's native kernel up to this many rows an expert (on average over the experts
# with rows): it streams each expert's weights once for all its rows, but recomputes each
# weight for every row, so the blocks' fp32 GEMMs win beyond (bench/NOTES-cpu.md).
NATIVE_ROWS = 16

# Sorted bf16 int4 calls (torch's int4 kernel otherwise) run on the native kernel up to this many
# rows an expert (on average), by the native build's instruction set (NativeLibrary.isa), where
# its products are integer products (E=64, k=8, H=1024, I=512, bench/NOTES-cpu.md):
# - "avx512_vnni" (a 2-core AVX-512 VNNI Xeon): 6.4 against 7.9 ms at M=16 (2 rows an expert),
#   10.7 against 11.5 at M=32, 12.6 against 13.0 at M=40, 14.6 against 14.4 at M=48, 18.6
#   against 18.0 at M=64: 5;
# - "avx2" (vpmaddubsw for int4; a 2-core AMD EPYC, Zen 3): 0.48-0.65x torch's kernel from half
#   a row to 8 rows an expert, 0.70 / 0.71 / 0.76x at 16 / 32 / 64 (M = 128 / 256 / 512): up to
#   64, the largest measured;
# - "avx2_vnni" not measured: torch's kernel.
NATIVE_ROWS_INT4_INTEGER = {"avx512_vnni": 5, "avx2": 64}

# On CPUs with AVX-512 BF16 and no AMX (bf16_without_amx: AMD Zen 4 / 5), sorted calls of more
# than BF16_ROWS rows an expert (on average; by weight dtype) run on moekit's vdpbf16ps kernels,
# the weights dequantized to bf16 (rounded to nearest even: 2^-9 relative, as torch's int4
# kernel's bf16 scales) a block at a time in L1 (NativeLibrary.bf16_gate_up / bf16_gemm), and
# fewer on the native integer products (bf16 int4 ones too: torch's int4 kernel lost to them at
# every size there). A 2-core AMD EPYC (Zen 5), E=64, k=8, H=1024, I=512, bf16 x, the layer's
# ms (bench/NOTES-cpu.md): int4 integer / torch's int4 kernel / bf16 2.2 / 3.1 / 6.2 at 2 rows an
# expert, 6.4-6.7 / 7.9-8.1 / 8.6-9.0 at 8, 9.3-9.6 / 10.7-10.8 / 9.8 at 12, 12.6 / 14.0 / 11.2
# at 16, 24.0 / 25.0 / 15.3 at 32; int8_w8a16 integer / bf16 5.1 / 9.5 at 4, 11.5 / 12.1 at 8,
# 18.1 / 12.9 at 12.
BF16_ROWS = {"int4": 12, "int8": 8}

_SCHEMES = ("int8_w8a16", "int4_w4a16")
_NIBBLES = 0x0F0F0F0F  # a low-nibble mask for each byte of an int32


@functools.lru_cache(maxsize=1)
def int4_kernel_available() -> bool:
    """Whether this torch has the CPU int4 GEMM the int4 kernel path uses."""
    ops = torch.ops.aten
    return hasattr(ops, "_weight_int4pack_mm_for_cpu") and hasattr(ops, "_convert_weight_to_int4pack_for_cpu")


def _unpacked_int4(p: torch.Tensor) -> torch.Tensor:
    """[N, K/2] uint8 (two int4 per byte) -> [N, K] int32 values in [0, 15]."""
    return torch.stack((p & 15, p >> 4), dim=-1).flatten(-2).to(torch.int32)


def _repack_int4(q: torch.Tensor, scale: torch.Tensor, zero: Optional[torch.Tensor]):
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

    def get(self, weights: ExpertWeights):
        tensors = (weights.w13, weights.w2) + tuple(weights.scales[n] for n in sorted(weights.scales))
        version = tuple((t.data_ptr(), version_of(t)) for t in tensors)  # never equal for inference tensors
        hit = self._cache.get(weights.w13)
        if hit is None or hit[0] != version:
            s = weights.scales
            hit = (version,
                   _repack_int4(weights.w13, s["w13_scale"], s.get("w13_zero")),
                   _repack_int4(weights.w2, s["w2_scale"], s.get("w2_zero")))
            self._cache[weights.w13] = hit
        return hit[1], hit[2]


def _dequantize_rows(q: torch.Tensor, scale: torch.Tensor, zero: Optional[torch.Tensor],
                     scheme: QuantScheme, out: torch.Tensor) -> torch.Tensor:
    """Dequantize rows of one expert's projection into out: w = q * s - z * s, one fused op per half.

    Args:
        q: [n, K / pack] stored rows.  scale: [n, K/g] fp32.  zero: [n, K/g] uint8 or None.
        out: [n, K] fp32 buffer, overwritten and returned.
    """
    n, K = out.shape
    g = scheme.group_size
    s = scale.unsqueeze(-1)  # [n, K/g, 1]
    if zero is not None:
        neg_zs = -(zero.unsqueeze(-1) * s)  # [n, K/g, 1]
    elif scheme.weight_dtype == "int4":
        neg_zs = -8.0 * s  # symmetric int4 is stored offset by 8
    else:
        neg_zs = None
    if scheme.weight_dtype == "int8":
        if neg_zs is None:
            return torch.mul(q.view(n, K // g, g), s, out=out.view(n, K // g, g)).view(n, K)
        return torch.addcmul(neg_zs, q.view(n, K // g, g), s, out=out.view(n, K // g, g)).view(n, K)
    # int4: unpack through int32 views (one mask, one shift for 8 values at a time); the low
    # nibbles are the even columns, the high ones the odd columns, g/2 of each per group.
    p32 = q.view(torch.int32)  # [n, K/8]
    halves = out.view(n, K // g, g // 2, 2)
    for i, nib in enumerate((p32 & _NIBBLES, (p32 >> 4) & _NIBBLES)):
        u = nib.view(torch.uint8).view(n, K // g, g // 2)
        torch.addcmul(neg_zs, u, s, out=halves[..., i])
    return out


class CPUWeightOnlyBackend(ExpertsBackend):
    name = "cpu_wo"
    description = ("weight-only int4/int8 on CPU: moekit's native integer products at decode and few rows an expert, "
                   "its vdpbf16ps kernels on AVX-512 BF16 without AMX, torch's int4 kernel on bf16 inputs, else fp32 "
                   "GEMMs from weights dequantized in cache-sized blocks")
    differentiable = False

    # decode and few-row products through moekit's native kernel where it is available
    # (moekit.native); False keeps the other paths (tests compare them)
    native_products = True
    # decode: each token's whole FFN in one native call (common.decode_by_token's `fused`);
    # False keeps one native call per GEMM (tests and benchmarks compare them)
    native_decode = True

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

    def native_library(self, weights: ExpertWeights, scheme: QuantScheme):
        """moekit's native library where this backend may use it for these weights, else None."""
        if not self.native_products or scheme.group_size % 32:
            return None
        tensors = (weights.w13, weights.w2, *weights.scales.values())
        return native.load() if all(t.is_contiguous() for t in tensors) else None

    def apply(self, x, weights, topk_weights, topk_ids, *, activation, activation_params,
              apply_router_weight_on_input, expert_map):
        T, k = topk_ids.shape
        scheme = scheme_of(weights)
        kernel = self.uses_int4_kernel(x.dtype, scheme)
        if T * k <= DIRECT_ASSIGNMENTS:
            lib = self.native_library(weights, scheme)
            if lib is not None:
                fused = native_decode(lib, weights, "int4" if scheme.weight_dtype == "int4" else "int8",
                                      scheme.group_size) if self.native_decode else None
                return decode_by_token(self._native_products(lib, weights, scheme), torch.float32, x, weights,
                                    topk_weights, topk_ids, activation, activation_params,
                                    apply_router_weight_on_input, expert_map, fused)
            if kernel:
                return decode_by_token(self._int4_kernel_products(weights, scheme), torch.bfloat16, x, weights,
                                    topk_weights, topk_ids, activation, activation_params,
                                    apply_router_weight_on_input, expert_map)
        lib = self.native_library(weights, scheme)
        bf16_kernels = lib is not None and lib.bf16_dot and bf16_without_amx()
        if bf16_kernels and T * k > BF16_ROWS[scheme.weight_dtype] * min(weights.num_experts, T * k):
            # AVX-512 BF16 without AMX: the weights dequantized to bf16 in L1, on vdpbf16ps
            sr = sort_rows(x, topk_weights, topk_ids, expert_map, weights.num_experts,
                           apply_router_weight_on_input, torch.bfloat16)
            return bf16_sorted(lib, sr, weights, T, k, activation, activation_params, apply_router_weight_on_input,
                               scheme)
        rows_limit = NATIVE_ROWS
        if kernel:  # sorted bf16 int4: torch's int4 kernel, but for a few rows an expert of VNNI products
            rows_limit = (BF16_ROWS["int4"] if bf16_kernels
                          else NATIVE_ROWS_INT4_INTEGER.get(lib.isa, 0) if lib is not None else 0)
            kernel = T * k > rows_limit * min(weights.num_experts, T * k)
        sr = sort_rows(x, topk_weights, topk_ids, expert_map, weights.num_experts,
                       apply_router_weight_on_input, torch.bfloat16 if kernel else torch.float32)
        if not kernel and sr.rows.shape[0] > rows_limit * len(sr.spans):
            lib = None  # routing crowded the rows onto fewer experts
            if self.uses_int4_kernel(x.dtype, scheme):  # the same rows, rounded last as sort_rows does
                kernel, sr = True, sr._replace(rows=sr.rows.to(torch.bfloat16))
        if kernel:
            linear = self._int4_kernel_linear(weights, scheme)
        elif lib is not None:
            linear = self._native_linear(lib, weights, scheme, span_segments(sr.spans))
        else:
            linear = self._blocked_linear(weights, scheme)
        h = add_bias_by_span(linear(sr.rows, "w13", sr.spans), weights.b13, sr.spans)  # [n, 2I] fp32
        a = apply_activation(h, activation, activation_params)  # [n, I]
        y = add_bias_by_span(linear(a.to(sr.rows.dtype), "w2", sr.spans), weights.b2, sr.spans)  # [n, H]
        return unsort_rows(y, sr, T, k, apply_router_weight_on_input)

    @staticmethod
    def _native_products(lib, weights, scheme):
        """All of a token's products of one GEMM in one call of moekit's native kernel (fp32)."""
        s, int4, g = weights.scales, scheme.weight_dtype == "int4", scheme.group_size

        def products(name, rows, es, e_idx, out):
            return lib.wo_gemm(getattr(weights, name), s[f"{name}_scale"], s.get(f"{name}_zero"), e_idx, rows, out,
                               int4=int4, group_size=g, trusted=True)

        return products

    def _int4_kernel_products(self, weights, scheme):
        """A token's products of one GEMM through torch's int4 kernel, one call a slot (bf16)."""
        packed = dict(zip(("w13", "w2"), self._repacked.get(weights)))
        mm, g = torch.ops.aten._weight_int4pack_mm_for_cpu, scheme.group_size

        def products(name, rows, es, e_idx, out):
            p, so = packed[name]
            for i, e in enumerate(es):
                out[i:i + 1] = mm(rows[i:i + 1] if rows.shape[0] > 1 else rows, p[e], g, so[e])
            return out

        return products

    @staticmethod
    def _native_linear(lib, weights, scheme, segments):
        """(rows [n, K] fp32, projection name, spans) -> [n, N] fp32 in one call of moekit's native kernel."""
        s, int4, g = weights.scales, scheme.weight_dtype == "int4", scheme.group_size
        experts, starts = segments

        def linear(rows: torch.Tensor, name: str, spans) -> torch.Tensor:
            w = getattr(weights, name)
            out = rows.new_empty((rows.shape[0], w.shape[1]))
            return lib.wo_gemm(w, s[f"{name}_scale"], s.get(f"{name}_zero"), experts, rows.contiguous(), out,
                               int4=int4, group_size=g, starts=starts, trusted=True)

        return linear

    def _int4_kernel_linear(self, weights, scheme):
        """(rows [n, K] bf16, projection name, spans) -> [n, N] fp32 through torch's int4 kernel."""
        packed = dict(zip(("w13", "w2"), self._repacked.get(weights)))
        mm = torch.ops.aten._weight_int4pack_mm_for_cpu

        def linear(rows: torch.Tensor, name: str, spans) -> torch.Tensor:
            p, so = packed[name]  # [E, N, K/2] uint8, [E, K/g, N, 2] bf16
            parts = [mm(rows[a:b], p[e], scheme.group_size, so[e]) for e, a, b in spans]
            if not parts:
                return rows.new_zeros((0, p.shape[1]), dtype=torch.float32)
            return torch.cat(parts).float()

        return linear

    @staticmethod
    def _blocked_linear(weights, scheme):
        """(rows [n, K] fp32, projection name, spans) -> [n, N] fp32 from blocks dequantized in one buffer."""
        H = weights.w2.shape[1]
        I = weights.w2.shape[2] * scheme.pack
        buf = torch.empty(max(H, I, BLOCK_BYTES // 4), dtype=torch.float32)  # one block, reused

        def linear(rows: torch.Tensor, name: str, spans) -> torch.Tensor:
            q_all = getattr(weights, name)  # [E, N, K / pack]
            scale, zero = weights.scales[f"{name}_scale"], weights.scales.get(f"{name}_zero")
            N, K = q_all.shape[1], rows.shape[1]
            nb = max(1, min(N, BLOCK_BYTES // (4 * K)))  # rows of W per block
            out = rows.new_empty((rows.shape[0], N))
            for e, a, b in spans:
                for r0 in range(0, N, nb):
                    r1 = min(N, r0 + nb)
                    w = _dequantize_rows(q_all[e, r0:r1], scale[e, r0:r1], None if zero is None else zero[e, r0:r1],
                                         scheme, buf[:(r1 - r0) * K].view(r1 - r0, K))
                    out[a:b, r0:r1] = rows[a:b] @ w.t()
            return out

        return linear


register_backend(CPUWeightOnlyBackend())

"""`cpu_int8`: int8 W8A8 experts on CPU through torch's exact int8 GEMM (torch._int_mm).

Weights: "int8_w8a8", int8 [E, N, K] with one fp32 scale per output channel. Each GEMM
input row is quantized to int8 with its own dynamic scale (amax / 127, round to nearest),
multiplied as int8 x int8 -> int32 (exact), and rescaled in fp32:

    h = (q_x @ q_w13^T) * s_x * s_w13 (+ b13) -> act -> same for GEMM2 with q_a, s_a, w2

Why this path: on CPUs with VNNI int8 dot products (AVX512-VNNI, AVX-VNNI) torch._int_mm
reads 1 byte per weight and needs no conversion pass, so decode (weight streaming) runs
faster than any float path. Measured on a 2-core AVX-512 VNNI CPU (bench/cpu_quant.py): fp32
compute from int8 weights dequantized in cache-sized blocks (cpu_wo's int8_w8a16 path) was
3-4x slower than _int_mm at M=1 and 32, and slower than bf16 weights, so there is no such
path here.

Decode (at most DIRECT_ASSIGNMENTS assignments) runs every token's FFN in one call of moekit's
native kernels where they are available (moekit.native: compiled on first use for this CPU; x
quantized and the exact int32 products rescaled inside them, the same values as the torch
path: a decode step 0.80 ms against 2.1 through torch._int_mm at E=64, k=8, H=1024, I=512 on
the host above), else through torch._int_mm; sorted calls of up to NATIVE_ROWS rows an expert
(by instruction set: NATIVE_ROWS_BY_ISA where the CPU has AMX; all of them without AMX, where
torch._int_mm ran 1.3-20x slower) take the native products too.

Accumulation is exact for K * 127 * 127 < 2^31 (K < 133,000), checked in `unsupported`.
Supports: CPU, fp32/bf16/fp16 activations, every activation, biases, expert_map, weights
on input. No autograd (activations are rounded).
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import native
from ..activations import apply_activation
from ..quant.quantize import quantize_activation
from ..quant.schemes import get_scheme
from .base import ExpertsBackend, ExpertsProblem, register_backend
from .common import add_bias_by_span, decode_by_token, native_decode, sort_rows, span_segments, unsort_rows
from .cpu import cpu_flags

__all__ = ["CPUInt8Backend", "MAX_K", "NATIVE_ROWS", "NATIVE_ROWS_BY_ISA", "NATIVE_ROWS_VNNI", "SWAP_ROWS",
           "native_rows"]

# Rows of one expert up to which the int8 GEMM runs as q_w q_x^T (transposed back): measured
# 1.2-1.7x faster than q_x q_w^T at 1-128 rows on weights of 1024-7168 x 512-3584 on a 2-core
# AVX-512 VNNI / AMX CPU (bench/NOTES-cpu.md).
SWAP_ROWS = 128

# At most this many (token, slot) assignments take the decode path (no sort; one token's k
# products per GEMM with their scales, bias and activation applied to all k at once).
DIRECT_ASSIGNMENTS = 16

# Sorted calls with at most this many rows an expert (on average over the experts with rows)
# run their products on moekit's native kernel, which streams each expert's weights once for
# all its rows; torch._int_mm's GEMMs win from 16 rows an expert (bench/NOTES-cpu.md). The
# kernel's AVX-512 VNNI build (vpdpbusd, 64 products an instruction) leads up to 32 rows: at
# E=64, k=8, H=1024, I=512 M=32 8.9 against 13.4 ms, M=128 20.5 / 24.9, M=256 (32 rows) 37.4 /
# 39.9, M=512 72.3 / 71.9.
# On AVX2 CPUs without VNNI the kernel (vpmaddubsw on |w| and x with w's sign) leads torch._int_mm
# at every size measured: on a 2-core AMD EPYC (Zen 3) 0.04-0.05x its time from 4 to 256 rows an
# expert (M=32: 11.4 against 218 ms, M=2048: 0.54 against 10.2 s), so there it takes every call.
# Those limits hold where torch._int_mm has AMX tiles (the Xeon above); without them (an AMD
# Zen 5, AVX-512 VNNI, no AMX) the native kernel led at every size measured, 0.34x torch._int_mm's
# time at 1 row an expert, 0.35x at 4, 0.56x at 16, 0.76x at 64, so there it takes every call too
# (native_rows).
NATIVE_ROWS = 8
NATIVE_ROWS_VNNI = 32
NATIVE_ROWS_BY_ISA = {"avx512_vnni": NATIVE_ROWS_VNNI, "avx2": float("inf")}


def native_rows(isa: str) -> float:
    """Rows an expert up to which sorted calls take the native products on a build of `isa`."""
    if "amx_int8" not in cpu_flags():
        return float("inf")
    return NATIVE_ROWS_BY_ISA.get(isa, NATIVE_ROWS)

# int32 accumulation of K products of two values in [-127, 127] stays exact below this K.
MAX_K = (2 ** 31 - 1) // (127 * 127)

_SCHEME = get_scheme("int8_w8a8")


def _int8_gemm(rows: torch.Tensor, q_w: torch.Tensor, s_w: torch.Tensor, sr_spans, native_segments=None) -> torch.Tensor:
    """All experts' rows [n, K] float -> [n, N] fp32: per-row int8 quantization, exact int8 GEMMs, rescale.

    Args:
        q_w: [E, N, K] int8 weights.  s_w: [E, N] fp32 per-channel scales.
        sr_spans: (e, start, end) row ranges per expert.
        native_segments: (library, experts, starts) to run the products
            in one call of moekit's native kernel; None: torch._int_mm per expert.
    """
    if native_segments is not None:  # quantized and rescaled in the kernel, the same values as below
        lib, experts, starts = native_segments
        out = rows.new_empty((rows.shape[0], q_w.shape[1]), dtype=torch.float32)
        s_x = rows.new_empty((rows.shape[0], 1), dtype=torch.float32)
        return lib.int8_gemm(q_w, experts, rows.float().contiguous(), out, starts, scales=s_x, w_scale=s_w,
                             trusted=True)
    acc = torch.empty((rows.shape[0], q_w.shape[1]), dtype=torch.int32, device=rows.device)
    q_x, s_x = quantize_activation(rows, _SCHEME)  # [n, K] int8, [n, 1]: all rows at once
    N, K = q_w.shape[1:]
    for e, a, b in sr_spans:  # exact int32
        if min(K, N) == 1:
            # torch._int_mm on CPU returns garbage with a size-1 dim (K = 1 in either operand
            # order, N = 1 in the swapped one); an int32 matmul is exact and these GEMMs are tiny.
            acc[a:b] = q_x[a:b].int() @ q_w[e].int().t()
        elif b - a <= SWAP_ROWS:
            acc[a:b] = torch._int_mm(q_w[e], q_x[a:b].t().contiguous()).t()
        else:
            torch._int_mm(q_x[a:b], q_w[e].t(), out=acc[a:b])
    out = acc.float().mul_(s_x)
    for e, a, b in sr_spans:
        out[a:b].mul_(s_w[e])
    return out


class CPUInt8Backend(ExpertsBackend):
    name = "cpu_int8"
    description = ("int8 W8A8 on CPU: dynamic per-token int8 activations, exact int8 products (moekit's native "
                   "kernels at decode and few rows an expert, else torch._int_mm)")
    differentiable = False
    # decode and few-row products through moekit's native kernel where it is available
    # (moekit.native); False keeps torch._int_mm (tests compare the two)
    native_products = True
    # decode: each token's whole FFN in one native call (common.decode_by_token's `fused`);
    # False keeps one native call per GEMM (tests and benchmarks compare them)
    native_decode = True

    def available(self) -> Optional[str]:
        if not hasattr(torch, "_int_mm"):
            return "this torch has no torch._int_mm (int8 GEMM)"
        return None

    def unsupported(self, problem: ExpertsProblem) -> Optional[str]:
        if problem.device != "cpu":
            return f"runs on CPU tensors only, got device {problem.device!r}"
        if problem.quant != "int8_w8a8":
            return f"runs quant='int8_w8a8' only, got quant={problem.quant!r}"
        K = max(problem.hidden_size, problem.intermediate_size)
        if K > MAX_K:
            return f"int32 accumulation is exact up to K={MAX_K} products, got H or I = {K}"
        return None

    def apply(self, x, weights, topk_weights, topk_ids, *, activation, activation_params,
              apply_router_weight_on_input, expert_map):
        T, k = topk_ids.shape
        if T * k <= DIRECT_ASSIGNMENTS:
            return self._direct(x, weights, topk_weights, topk_ids, activation, activation_params,
                                apply_router_weight_on_input, expert_map)
        sr = sort_rows(x, topk_weights, topk_ids, expert_map, weights.num_experts,
                       apply_router_weight_on_input, torch.float32)
        s = weights.scales
        lib = self._library(weights)
        segs = None
        limit = native_rows(lib.isa) if lib is not None else 0
        if lib is not None and sr.rows.shape[0] <= limit * len(sr.spans):
            segs = (lib, *span_segments(sr.spans))
        h = _int8_gemm(sr.rows, weights.w13, s["w13_scale"], sr.spans, segs)
        h = add_bias_by_span(h, weights.b13, sr.spans)  # [n, 2I]
        a = apply_activation(h, activation, activation_params)  # [n, I]
        y = add_bias_by_span(_int8_gemm(a, weights.w2, s["w2_scale"], sr.spans, segs), weights.b2, sr.spans)  # [n, H]
        return unsort_rows(y, sr, T, k, apply_router_weight_on_input)

    def _library(self, weights):
        """moekit's native library where this backend may use it for these weights, else None."""
        tensors = (weights.w13, weights.w2, weights.scales["w13_scale"], weights.scales["w2_scale"])
        if not (self.native_products and all(t.is_contiguous() for t in tensors)):
            return None
        return native.load()

    def _direct(self, x, weights, topk_weights, topk_ids, activation, activation_params, on_input, expert_map):
        """Decode path, token by token (common.decode_by_token): [T, H] fp32.

        At a few tokens a call is a weight stream plus many small operations: here each GEMM's
        products over a token's n local slots come from one native call (x quantized and the
        int32 products rescaled in it), else from one q_w q_x^T a slot into an [n, N] int32
        accumulator, and the biases, activation and GEMM2's input run once over the n slots.
        The same values either way, and as the sorted path.
        """
        lib = self._library(weights)

        def products(name, rows, es, e_idx, out):  # rows [1 or n, K] fp32 -> out [n, N] fp32
            w, s_w = getattr(weights, name), weights.scales[f"{name}_scale"]
            if lib is not None:
                return lib.int8_gemm(w, e_idx, rows, out, scales=rows.new_empty((rows.shape[0], 1)), w_scale=s_w,
                                     trusted=True)
            q, s_x = quantize_activation(rows, _SCHEME)
            acc = torch.empty(out.shape, dtype=torch.int32)
            cols = q.view(-1, q.shape[1], 1).unbind(0)  # one column, or one a slot
            for i, (e, a) in enumerate(zip(es, acc.view(len(es), -1, 1).unbind(0))):
                torch._int_mm(w[e], cols[i if len(cols) > 1 else 0], out=a)
            return torch.mul(acc, s_x, out=out).mul_(s_w.index_select(0, e_idx))

        fused = native_decode(lib, weights, "int8_w8a8") if lib is not None and self.native_decode else None
        return decode_by_token(products, torch.float32, x, weights, topk_weights, topk_ids, activation,
                               activation_params, on_input, expert_map, fused)


register_backend(CPUInt8Backend())

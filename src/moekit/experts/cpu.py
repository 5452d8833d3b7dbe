"""`cpu`: the fast CPU path, adapted to what the processor computes natively.

Two compute modes, chosen per call from the weights' dtype and the CPU's features:
- native: GEMMs straight on the weights (fp32 weights, or bf16/fp16 weights on CPUs with
  AVX-512 BF16/FP16 or AMX, where oneDNN runs them at full speed). No conversion pass.
  bf16 weights: per expert, the weight is the left operand (W x^T, transposed back) for
  few rows (_swapped) and one row is a matrix-vector product: oneDNN streams a bf16 weight
  past a few columns 1.2-1.8x faster than it multiplies x W^T (and torch's grouped GEMM
  runs x W^T per group). bf16 weights on CPUs without AMX (AVX-512 BF16 only): moekit's own
  vdpbf16ps kernels, GEMM1 fused with its activation (NATIVE_ROWS_BF16_NO_AMX). fp32 weights
  (and bf16 ones without AMX where those kernels are missing): where torch's grouped GEMM takes
  the shape, one grouped GEMM per projection replaces the per-expert loop (its Python overhead
  dominates at small M); fp16 and fp32 GEMMs gain nothing from either form.
- blocked fp32: on AVX2-only CPUs torch's bf16 matmul is 10-100x slower than fp32, while
  an fp32 copy of all experts would double memory and the bytes streamed per token. Each
  expert's weights are converted to fp32 one block of the intermediate dimension at a time
  (about BLOCK_BYTES, sized to stay in L2/L3) into reused buffers (a fresh allocation per
  block costs page faults), used at once by fp32 GEMMs. Where moekit's native kernel has pair
  blocks (AVX2 builds: bf16 / fp16 weights widened in registers once for four x rows) every
  sorted bf16 / fp16 call takes them instead: no conversion pass, 2.2-2.8x the row-at-a-time
  kernel from 8 rows an expert (bf16), faster than the converted blocks' fp32 GEMMs alone.
Both cores work through torch's intra-op threads.

Decode (at most DIRECT_ASSIGNMENTS assignments) and sorted calls of up to NATIVE_ROWS rows an
expert run on moekit's native kernel instead where it builds (moekit.native) and nothing
needs a gradient: fp32, bf16 or fp16 weights widened in registers against fp32 rows (fp32
accumulation, as oneDNN's bf16 products); at decode every token's whole FFN in one native call
(NativeLibrary.decode), for sorted calls each GEMM's products over all the call's experts in
one call, the biases, activation and sum over k as in the other paths. At E=64, k=8, H=1024,
I=512, M=1 on the 2-core AVX-512 BF16 host: bf16 1.98 against 2.91 ms, fp16 2.0 against 3.5,
fp32 3.05 against 3.45 (bench/NOTES-cpu.md).

Pipeline: stable sort of (t, j) assignments by expert (one bincount, one host read of the
counts: fine on CPU) -> per active expert, per I-block: h = x_e W13_blk^T -> act ->
y_e += a W2_blk^T -> weight -> deterministic sum over k.

Supports: CPU, fp32/bf16/fp16 activations and weights, biases, expert_map, every
activation, weights on input, autograd.
"""

from __future__ import annotations

import functools
import os
import threading
from typing import Optional

import torch
import torch.nn.functional as F

from .. import native
from ..activations import apply_activation, is_gated
from .base import ExpertsBackend, ExpertsProblem, register_backend
from .common import (add_bias_by_span, bf16_sorted, decode_by_token, local_ids, native_decode, sort_rows,
                     span_segments, unsort_rows)
from .grouped_mm import GroupedMMBackend

_GROUPED = GroupedMMBackend()

__all__ = ["CPUBackend", "BLOCK_BYTES", "bf16_without_amx", "cpu_flags", "native_dtypes"]

# At most this many (token, slot) assignments take the direct decode path (no sort).
DIRECT_ASSIGNMENTS = 16

# Rows an expert (on average over the experts with rows) up to which sorted calls run on
# moekit's native kernel (moekit.native: fp32 accumulation), by weight dtype. Measured on the
# 2-core AVX-512 BF16 host at E=64, k=8, H=1024, I=512 (bench/NOTES-cpu.md): bf16 1.1x torch's
# swapped bf16 products at 4 rows, 0.78x at 8; fp32 1.2x at 8 and 16; fp16 1.1-1.8x up to 16.
# Where bf16 is emulated (the same host under AVX2 caps) the native kernel won 1.4-2.2x up to
# 16 rows, so that limit applies there (NATIVE_ROWS_EMULATED). Builds with pair blocks (AVX2
# without AVX-512: 16-bit weights widened once for 4 x rows) take every sorted bf16 / fp16 call
# where they are emulated. bf16 on a 2-core AMD EPYC (Zen 3): 0.65x the row-at-a-time kernel's
# time at 4 rows an expert, 0.36-0.46x at 8-128, 94-105 GFLOP/s from 64 rows, where the blocked
# fp32 path's GEMMs ran at 75-96 GFLOP/s before its conversions (bench/NOTES-cpu.md).
EMULATED_PAIR_DTYPES = (torch.bfloat16, torch.float16)
NATIVE_ROWS = {torch.bfloat16: 4, torch.float32: 16, torch.float16: 16}
NATIVE_ROWS_EMULATED = 16

# bf16 weights on CPUs with AVX-512 BF16 but no AMX (AMD Zen 4 / 5), where oneDNN's bf16 GEMMs
# run on vdpbf16ps rather than AMX tiles: sorted calls of up to NATIVE_ROWS_BF16_NO_AMX rows an
# expert take the fp32-row native kernel, larger ones moekit's vdpbf16ps kernels
# (NativeLibrary.bf16_gate_up, GEMM1 with its activation, and bf16_gemm), or where those are
# missing one grouped GEMM per projection (torch._grouped_mm) instead of the per-expert loop.
# 2-core AMD EPYC (Zen 5), bf16 x, E=64, k=8, H=1024, I=512 (bench/NOTES-cpu.md): vdpbf16ps
# against grouped 0.59x at 2 rows an expert, 0.56-0.69x at 4-32, 0.71-0.82x at 64-128; against
# the fp32-row kernel 1.01x at 2 rows, 0.97x at 4, 0.57x at 16. E=8, k=2, I=3584: 0.58-0.81x
# grouped from 4 to 512 rows an expert.
NATIVE_ROWS_BF16_NO_AMX = 2

# Rows of one expert up to which bf16 GEMMs take the weight w [N, K] as the left operand:
# SWAP_ROWS, or twice that where K <= N. Measured on AVX-512 BF16 / AMX with 2 threads
# (bench/NOTES-cpu.md; weights 1024-7168 x 512-3584): (w x^T)^T against x w^T 1.2-1.8x at
# 4-128 rows; at 256 rows 1.4-1.7x where K <= N and 0.95x for K = 3.5 N; at 512 rows
# x w^T wins on the square and wide-K weights. One row: torch.mv, 1.2-1.6x.
SWAP_ROWS = 128


def _swapped(r: int, w: torch.Tensor) -> bool:
    N, K = w.shape
    return r <= SWAP_ROWS or (r <= 2 * SWAP_ROWS and K <= N)


# fp32 bytes of one converted weight block (w13 rows + w2 columns of one I-slice).
BLOCK_BYTES = 3 * 1024 * 1024


def _block_size(H: int, I: int, gated: bool) -> int:
    per_i = (3 if gated else 2) * H * 4  # fp32 bytes per intermediate index
    ib = max(16, BLOCK_BYTES // per_i)
    if ib >= I:
        return I
    return max(16, (ib // 16) * 16)


def _product(a: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor], native: bool = True) -> torch.Tensor:
    """a [r, K] times w [N, K]^T (+ b [N]) in w's dtype, [r, N]: for natively multiplied bf16
    weights torch.mv at one row and (w a^T)^T (a transposed view) for few rows (see
    SWAP_ROWS), else x w^T."""
    r = a.shape[0]
    if w.dtype != torch.bfloat16 or not native or r == 0 or not _swapped(r, w):
        return F.linear(a, w, b)
    h = torch.mv(w, a[0]).unsqueeze(0) if r == 1 else (w @ a.t()).t()
    return h if b is None else h + b


def _f32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.float32 else t.float()


class _BlockBuffers:
    """Reused fp32 buffers for converted weight blocks.

    A fresh multi-MB allocation per block is returned to the OS and faulted in again on the
    next one, which made the conversion several times slower than the copy itself. Under
    autograd the blocks are saved for backward, so every block then gets its own tensor.
    """

    def __init__(self) -> None:
        self._local = threading.local()  # one set of buffers per calling thread

    def get(self, name: str, shape) -> torch.Tensor:
        bufs = self._local.__dict__.setdefault("bufs", {})
        buf = bufs.get(name)
        numel = shape[0] * shape[1]
        # A buffer made under torch.inference_mode cannot be written outside it: a new one then.
        stale = buf is not None and buf.is_inference() and not torch.is_inference_mode_enabled()
        if buf is None or buf.numel() < numel or stale:
            buf = bufs[name] = torch.empty(numel, dtype=torch.float32)
        return buf[:numel].view(shape)

    def convert(self, name: str, *parts: torch.Tensor) -> torch.Tensor:
        """The row-wise concatenation of `parts` in fp32, in a reused buffer when allowed."""
        if torch.is_grad_enabled() and any(p.requires_grad for p in parts):
            return torch.cat([_f32(p) for p in parts]) if len(parts) > 1 else _f32(parts[0])
        if len(parts) == 1 and parts[0].dtype == torch.float32:
            return parts[0]
        rows = sum(p.shape[0] for p in parts)
        out = self.get(name, (rows, parts[0].shape[1]))
        r = 0
        for p in parts:
            out[r:r + p.shape[0]].copy_(p)
            r += p.shape[0]
        return out


# ISA caps a user can set for torch / oneDNN; at AVX2 or below bf16/fp16 GEMMs are emulated.
_ISA_ENV = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")
_LOW_ISA = ("default", "sse41", "sse42", "avx", "avx2", "avx2_vnni", "avx2_vnni_2")


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset:
    """/proc/cpuinfo's flags (empty off Linux)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def bf16_without_amx() -> bool:
    """Whether bf16 GEMMs run natively here but not on AMX tiles (NATIVE_ROWS_BF16_NO_AMX)."""
    return torch.bfloat16 in native_dtypes() and "amx_bf16" not in cpu_flags()


@functools.lru_cache(maxsize=1)
def native_dtypes() -> frozenset:
    """Weight dtypes this CPU multiplies at full speed (read once from /proc/cpuinfo and the
    ISA caps ATEN_CPU_CAPABILITY / ONEDNN_MAX_CPU_ISA)."""
    if any(os.environ.get(v, "").lower() in _LOW_ISA for v in _ISA_ENV):
        return frozenset({torch.float32})
    flags = cpu_flags()  # non-Linux: none, so only fp32 counts as fast
    out = {torch.float32}
    if flags & {"avx512_bf16", "amx_bf16"}:
        out.add(torch.bfloat16)
    if flags & {"avx512_fp16", "amx_fp16"}:
        out.add(torch.float16)
    return frozenset(out)


class CPUBackend(ExpertsBackend):
    name = "cpu"
    description = ("native bf16/fp16/fp32 GEMMs (bf16 on moekit's vdpbf16ps kernels where the CPU has AVX-512 BF16 "
                   "but no AMX), or on AVX2 moekit's pair blocks (16-bit weights widened in registers) or fp32 "
                   "GEMMs from weights converted in cache-sized blocks (CPU)")
    # decode and few-row products through moekit's native kernel where it is available
    # (moekit.native) and nothing needs a gradient; False keeps torch's GEMMs (tests compare them)
    native_products = True
    # decode: each token's whole FFN in one native call (common.decode_by_token's `fused`);
    # False keeps one native call per GEMM (tests and benchmarks compare them)
    native_decode = True

    def unsupported(self, problem: ExpertsProblem) -> Optional[str]:
        if problem.device != "cpu":
            return f"runs on CPU tensors only, got device {problem.device!r}"
        if problem.quant is not None:
            return f"unquantized weights only, got quant={problem.quant!r}"
        return None

    def apply(self, x, weights, topk_weights, topk_ids, *, activation, activation_params,
              apply_router_weight_on_input, expert_map):
        T, k = topk_ids.shape
        H = x.shape[1]
        E = weights.num_experts
        gated = is_gated(activation)
        I = weights.w2.shape[2]
        native = weights.w13.dtype in native_dtypes() and weights.w2.dtype == weights.w13.dtype
        lib = self._native_library(x, weights, topk_weights)
        if lib is not None and T * k <= DIRECT_ASSIGNMENTS:
            return decode_by_token(self._native_products(lib, weights), torch.float32, x, weights, topk_weights,
                                   topk_ids, activation, activation_params, apply_router_weight_on_input,
                                   expert_map, native_decode(lib, weights, "float") if self.native_decode else None)
        bf16_no_amx = native and weights.w13.dtype == torch.bfloat16 and bf16_without_amx()
        rows_limit = (NATIVE_ROWS_BF16_NO_AMX if bf16_no_amx else NATIVE_ROWS.get(weights.w13.dtype, 0)) if native \
            else NATIVE_ROWS_EMULATED
        if not native and lib is not None and lib.pair_blocks and weights.w13.dtype in EMULATED_PAIR_DTYPES:
            rows_limit = T * k  # every sorted call: no expert has more rows than the call
        sr = None  # fp32 rows sorted for the native kernel, reused below when their experts have more rows
        if lib is not None and T * k <= rows_limit * min(E, T * k):
            sr = sort_rows(x, topk_weights, topk_ids, expert_map, E, apply_router_weight_on_input, torch.float32)
            if sr.rows.shape[0] <= rows_limit * len(sr.spans):
                return self._native_sorted(lib, sr, weights, T, k, activation, activation_params,
                                           apply_router_weight_on_input)
        if bf16_no_amx and lib is not None and lib.bf16_dot:
            # bf16 products on AVX-512 BF16 without AMX: vdpbf16ps on the rows in bf16 (the
            # other paths round them to the weights' dtype too)
            if sr is None:
                sr = sort_rows(x, topk_weights, topk_ids, expert_map, E, apply_router_weight_on_input, torch.bfloat16)
            else:  # the same rows, rounded last as sort_rows does
                sr = sr._replace(rows=sr.rows.to(torch.bfloat16))
            return bf16_sorted(lib, sr, weights, T, k, activation, activation_params, apply_router_weight_on_input)
        if T * k <= DIRECT_ASSIGNMENTS and weights.w2.dtype == weights.w13.dtype:
            # Also where 16-bit GEMMs are emulated: one row in the weights' dtype took 0.5-0.67x
            # the time of converting the expert's weights to fp32 first (AVX2, bench/NOTES-cpu.md).
            return self._direct(x, weights, topk_weights, topk_ids, activation, activation_params,
                                apply_router_weight_on_input, expert_map, native)
        if ((bf16_no_amx or (native and weights.w13.dtype == torch.float32)) and x.dtype == weights.w13.dtype
                and _GROUPED.unsupported(self._problem(x, weights, k, activation)) is None):
            # fp32, or bf16 without AMX, and aligned rows: one grouped GEMM per projection beats
            # a per-expert loop.
            return _GROUPED.apply(x, weights, topk_weights, topk_ids, activation=activation,
                                  activation_params=activation_params,
                                  apply_router_weight_on_input=apply_router_weight_on_input, expert_map=expert_map)
        ib = I if native else _block_size(H, I, gated)
        cdt = weights.w13.dtype if native else torch.float32  # compute dtype
        if sr is None:
            sr = sort_rows(x, topk_weights, topk_ids, expert_map, E, apply_router_weight_on_input, cdt)
        else:  # the same rows: sort_rows rounds fp32 rows to the compute dtype last too
            sr = sr._replace(rows=sr.rows.to(cdt))
        y = sr.rows.new_empty((T * k, H), dtype=torch.float32)  # [T*k, H]: local rows, then zeros
        y[sr.rows.shape[0]:].zero_()
        for e, start, end in sr.spans:
            y[start:end] = self._expert(
                sr.rows[start:end], weights, e, I, ib, gated, activation, activation_params, native)
        return unsort_rows(y, sr, T, k, apply_router_weight_on_input)

    def _native_library(self, x, weights, topk_weights):
        """moekit's native library where it may run this call's products (fp32 / bf16 / fp16
        weights of one dtype, contiguous, nothing that needs a gradient), else None."""
        w13, w2 = weights.w13, weights.w2
        if (not self.native_products or w13.dtype != w2.dtype or w13.dtype not in NATIVE_ROWS
                or not (w13.is_contiguous() and w2.is_contiguous())):
            return None
        tensors = (x, w13, w2, weights.b13, weights.b2, topk_weights)
        if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
            return None
        return native.load()

    @staticmethod
    def _native_products(lib, weights):
        """A token's products of one GEMM in one call of moekit's native kernel (fp32 out)."""
        def products(name, rows, es, e_idx, out):
            return lib.float_gemm(getattr(weights, name), e_idx, rows, out, trusted=True)

        return products

    @staticmethod
    def _native_sorted(lib, sr, weights, T, k, activation, activation_params, on_input):
        """Sorted rows of a few tokens: each GEMM in one call of moekit's native kernel, fp32 out."""
        experts, starts = span_segments(sr.spans)
        h = lib.float_gemm(weights.w13, experts, sr.rows, sr.rows.new_empty((sr.rows.shape[0], weights.w13.shape[1])),
                           starts, trusted=True)
        a = apply_activation(add_bias_by_span(h, weights.b13, sr.spans), activation, activation_params).contiguous()
        y = lib.float_gemm(weights.w2, experts, a, a.new_empty((a.shape[0], weights.w2.shape[1])), starts,
                           trusted=True)
        return unsort_rows(add_bias_by_span(y, weights.b2, sr.spans), sr, T, k, on_input)

    @staticmethod
    def _direct(x, weights, topk_weights, topk_ids, activation, activation_params, on_input, expert_map, native):
        """Decode path: one GEMV pair per (token, slot), no sort. Returns [T, H] fp32.

        For a handful of assignments the sort/gather/scatter machinery costs more than the
        GEMVs; slots are summed in order j = 0..k-1 (deterministic).
        """
        T, k = topk_ids.shape
        ids = local_ids(topk_ids, expert_map).tolist()
        cdt = weights.w13.dtype
        out = x.new_zeros((T, x.shape[1]), dtype=torch.float32)  # [T, H]
        for t in range(T):
            x_t = x[t:t + 1]  # [1, H]
            for j, e in enumerate(ids[t]):
                if e < 0:
                    continue  # expert held by another rank
                w_tj = topk_weights[t, j]
                x_in = (x_t.float() * w_tj).to(cdt) if on_input else x_t.to(cdt)
                b13 = None if weights.b13 is None else weights.b13[e]
                b2 = None if weights.b2 is None else weights.b2[e]
                a = apply_activation(_product(x_in, weights.w13[e], b13, native), activation, activation_params)
                y = _product(a, weights.w2[e], b2, native).float()  # [1, H]
                out[t:t + 1] += y if on_input else y * w_tj
        return out

    @staticmethod
    def _problem(x, weights, k, activation) -> ExpertsProblem:
        return ExpertsProblem("cpu", x.dtype, weights.w13.dtype, activation, False, False, False,
                              weights.num_experts, x.shape[1], weights.w2.shape[2], k)

    @staticmethod
    def _expert(x_e, weights, e, I, ib, gated, activation, activation_params, native):
        """One expert's output [n, H] for its rows x_e [n, H]: in the weights' dtype (native, no
        bias; possibly a transposed view), else fp32 and block by block over I."""
        w13_e, w2_e = weights.w13[e], weights.w2[e]  # [2I or I, H], [H, I]
        if native:  # GEMMs in the weights' dtype (fp32 accumulation inside)
            b13_e = None if weights.b13 is None else weights.b13[e]
            a = apply_activation(_product(x_e, w13_e, b13_e), activation, activation_params)  # [n, I]
            y = _product(a, w2_e, None)  # [n, H]
            return y if weights.b2 is None else y.float() + weights.b2[e].float()
        b13_e = None if weights.b13 is None else _f32(weights.b13[e])
        y = None
        for i0 in range(0, I, ib):
            i1 = min(I, i0 + ib)
            if gated:  # gate rows i0..i1 and the matching up rows, as one [2ib, H] block
                w_blk = _BUFFERS.convert("w13", w13_e[i0:i1], w13_e[I + i0:I + i1])
                b_blk = None if b13_e is None else torch.cat((b13_e[i0:i1], b13_e[I + i0:I + i1]))
            else:
                w_blk = _BUFFERS.convert("w13", w13_e[i0:i1])  # [ib, H]
                b_blk = None if b13_e is None else b13_e[i0:i1]
            h = x_e @ w_blk.t() if b_blk is None else torch.addmm(b_blk, x_e, w_blk.t())  # [n, 2ib]
            a = apply_activation(h, activation, activation_params)  # [n, ib]
            w2_blk = _BUFFERS.convert("w2", w2_e[:, i0:i1])  # [H, ib]
            part = a @ w2_blk.t()  # [n, H]
            y = part if y is None else y.add_(part)
        if weights.b2 is not None:
            y = y + _f32(weights.b2[e])
        return y


_BUFFERS = _BlockBuffers()
register_backend(CPUBackend())

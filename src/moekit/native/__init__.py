"""Native CPU kernels, compiled on first use with this machine's C compiler.

What: `int8_gemm`, `wo_gemm` and `float_gemm` (int8, int4 / int8 group-scaled, and fp32 / bf16
/ fp16 weights), products of rows grouped by expert (a decode token's slots, or the sorted
rows of a few tokens) in one call each (cpu_kernels.c says how); and a decode
token's whole FFN (both GEMMs on those kernels, biases, activation, the weighted sum over its
slots) in one parallel region, `decode` (every token of a decode step in one call). The `cpu`, `cpu_int8` and `cpu_wo` backends use
them for decode and calls of a few rows an expert. torch offers
one int8 GEMM per expert (torch._int_mm): at one token each is a short weight stream with its
own parallel region, and the CPU int8 backend's decode spent about 1.1 ms of 1.5 in 16 of
them (E=64, k=8, H=1024, I=512 on a 2-core AVX-512 VNNI host); the kernel here streams the
same weights in 0.8 ms (bench/NOTES-cpu.md).

How: cpu_kernels.c ships with the package. On first use it is compiled for this CPU
(`-O3 -march=native -fopenmp`) with $CC, else cc, gcc or clang, into $MOEKIT_CACHE_DIR
(default ~/.cache/moekit) under a name keyed by the source, compiler and flags, and loaded
with ctypes; with GNU OpenMP (the runtime torch's pip wheels ship) the kernel binds to the
libgomp torch already loaded (same soname), so the kernel and torch share one thread pool; a
torch on another OpenMP runtime gets a second pool of the same size. x86-64 Linux only. Anything that fails (no compiler, no
OpenMP, no AVX2) leaves the kernels unavailable with the reason (`status()`, shown by
`moekit info`), and the backends keep torch's operators. MOEKIT_NATIVE=0 turns them off.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

__all__ = ["ACTIVATION_CODES", "FAST_ISAS", "NativeLibrary", "Projection", "build", "compile_cached", "load",
           "projection", "reset", "status"]

SOURCE = Path(__file__).with_name("cpu_kernels.c")

# Instruction sets whose kernels beat torch's operators (measured); "scalar" builds exist for tests.
FAST_ISAS = ("avx512_vnni", "avx512", "avx2_vnni", "avx2")

_ISA_FLAGS = {
    "native": ["-march=native"],
    "avx2": ["-mavx2", "-mfma", "-mf16c", "-mno-avx512f"],  # the AVX2 path on an AVX-512 machine (tests)
    "avx2_vnni": ["-mavx2", "-mfma", "-mf16c", "-mavxvnni", "-mno-avx512f"],  # AVX2 with AVX-VNNI (tests)
    "avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c", "-mno-avx512vnni",
               "-mno-avxvnni"],  # AVX-512 without VNNI (tests)
    "avx2_rows4": ["-mavx2", "-mfma", "-mf16c", "-mno-avx512f", "-DMOEKIT_ROW_GROUP=4"],  # four rows a pass (tests)
    # this CPU's instructions with either decode row order (tests; "native" picks one by vendor)
    "native_rows1": ["-march=native", "-DMOEKIT_ROW_GROUP=1"],
    "native_rows4": ["-march=native", "-DMOEKIT_ROW_GROUP=4"],
    "scalar": ["-mno-avx2", "-mno-avx512f"],
}


# moekit.activations' names -> moekit_decode's activation codes
ACTIVATION_CODES = {"silu": 0, "gelu": 1, "gelu_tanh": 2, "swigluoai": 3, "swiglu_limit": 4, "swiglustep": 5,
                    "silu_no_mul": 6, "gelu_no_mul": 7, "relu2_no_mul": 8}
GATED_CODES = 6  # codes below it are the gated activations (cpu_kernels.c: GATED_ACTS)


class _ProjectionStruct(ctypes.Structure):
    _fields_ = [("kind", ctypes.c_int32), ("wtype", ctypes.c_int32), ("w", ctypes.c_void_p),
                ("scale", ctypes.c_void_p), ("zero", ctypes.c_void_p), ("N", ctypes.c_int64), ("K", ctypes.c_int64),
                ("g", ctypes.c_int64)]


@dataclass(frozen=True)
class Projection:
    """One GEMM's weights for `NativeLibrary.decode`, checked once (`projection` builds it);
    it holds its tensors, so they live as long as it does."""
    kind: str
    E: int
    N: int
    K: int
    tensors: tuple
    struct: _ProjectionStruct


_PROJECTION_KINDS = ("float", "int8_w8a8", "int4", "int8")


def projection(w: torch.Tensor, kind: str, *, scale: Optional[torch.Tensor] = None,
               zero: Optional[torch.Tensor] = None, group_size: int = 0) -> Projection:
    """Describe one projection's stored weights for `NativeLibrary.decode`.

    Args:
        w: [E, N, K] (int4: [E, N, K/2] uint8, two a byte), contiguous.
        kind: "float" (fp32 / bf16 / fp16 weights, no scales), "int8_w8a8" (int8 weights, scale
            [E, N] fp32 per output channel; x quantized per row as the int8 kernel does), "int4"
            or "int8" (weight-only, as `wo_gemm`: scale [E, N, K/g] fp32, zero uint8 or None).
        group_size: g of the weight-only kinds.
    """
    if kind not in _PROJECTION_KINDS:
        raise ValueError(f"kind must be one of {list(_PROJECTION_KINDS)}, got {kind!r}")
    tensors = tuple(t for t in (w, scale, zero) if t is not None)
    if w.dim() != 3 or not all(t.is_contiguous() for t in tensors):
        raise ValueError(f"projection wants a contiguous [E, N, K] w and contiguous scales, got w {tuple(w.shape)}")
    E, N, K = w.shape
    if kind == "float":
        wtype = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}.get(w.dtype)
        if wtype is None or scale is not None or zero is not None:
            raise TypeError(f"a float projection wants fp32 / bf16 / fp16 w and no scales, got {w.dtype}")
        return Projection(kind, E, N, K, tensors, _ProjectionStruct(0, wtype, w.data_ptr(), None, None, N, K, 0))
    if scale is None or scale.dtype != torch.float32:
        raise TypeError(f"a {kind} projection wants an fp32 scale, got {None if scale is None else scale.dtype}")
    if kind == "int8_w8a8":
        if w.dtype != torch.int8 or zero is not None or tuple(scale.shape) != (E, N):
            raise ValueError(f"an int8_w8a8 projection wants int8 w and an [E, N] scale, no zero; got {w.dtype}, "
                             f"scale {tuple(scale.shape)}")
        return Projection(kind, E, N, K, tensors, _ProjectionStruct(1, 0, w.data_ptr(), scale.data_ptr(), None, N, K, 0))
    K = K * 2 if kind == "int4" else K
    wtype = 0 if kind == "int4" else (1 if w.dtype == torch.int8 else 2)
    if (w.dtype != (torch.uint8 if kind == "int4" else w.dtype) or w.dtype not in (torch.int8, torch.uint8)
            or (wtype == 2 and (zero is None or zero.dtype != torch.uint8))):
        raise TypeError(f"a {kind} projection wants {'uint8' if kind == 'int4' else 'int8 (or uint8 with zero)'} w, "
                        f"got {w.dtype}{'' if zero is None else f' with {zero.dtype} zero'}")
    g = group_size
    if g <= 0 or g % 32 or K % g or tuple(scale.shape) != (E, N, K // g) or (zero is not None and zero.shape != scale.shape):
        raise ValueError(f"a {kind} projection wants g a multiple of 32 dividing K={K} and scale (and zero) "
                         f"[{E}, {N}, K/g], got g={g}, scale {tuple(scale.shape)}")
    return Projection(kind, E, N, K, tensors, _ProjectionStruct(2, wtype, w.data_ptr(), scale.data_ptr(),
                                                             None if zero is None else zero.data_ptr(), N, K, g))


@dataclass
class NativeLibrary:
    """A compiled kernel library: `isa` is what the compiler targeted ("avx512_vnni", "avx2", ...)."""
    path: Path
    isa: str
    openmp: bool
    _lib: ctypes.CDLL

    def int8_gemm(self, w: torch.Tensor, experts: torch.Tensor, x: torch.Tensor, out: torch.Tensor,
                  starts: Optional[torch.Tensor] = None, *, scales: Optional[torch.Tensor] = None,
                  w_scale: Optional[torch.Tensor] = None, trusted: bool = False) -> torch.Tensor:
        """Exact int32 products of rows grouped by expert: out[j] = w[experts[s]] @ q_x[j] for the
        rows j of segment s.

        Args:
            w: [E, N, K] int8, contiguous.  experts: [S] int64 in [0, E).
            x: [R, K] rows (rows contiguous), or [1, K]: one row for every output row. int8:
                q_x = x. fp32: quantized per row here exactly as quantize_activation does for
                int8 per-token activations, each row's scale written to `scales` [R or 1, 1].
            out: [R, N] int32, contiguous (written); or fp32 with fp32 x and `w_scale`: the
                products rescaled as (float(acc) * s_x) * w_scale[e] (w_scale [E, N] fp32).
            starts: [S + 1] int64 row offsets of the segments (0 first, R last); None: S = R,
                segment s is row s (a decode token's slots).
            trusted: skip reading experts' and starts' values (the caller built them from its
                own expert ids and spans); shapes, dtypes and layouts are checked either way.
        """
        quantize, scaled = x.dtype == torch.float32, w_scale is not None
        if (w.dtype != torch.int8 or x.dtype not in (torch.int8, torch.float32)
                or out.dtype != (torch.float32 if scaled else torch.int32)):
            raise TypeError(f"int8_gemm wants int8 w, int8 or fp32 x, int32 out (fp32 with w_scale); got {w.dtype}, "
                            f"{x.dtype}, {out.dtype}")
        if scaled and (not quantize or w_scale.dtype != torch.float32 or not w_scale.is_contiguous()
                       or tuple(w_scale.shape) != tuple(w.shape[:2])):
            raise ValueError(f"int8_gemm: w_scale must be a contiguous fp32 [{w.shape[0]}, {w.shape[1]}] with fp32 x, "
                             f"got {(w_scale.dtype, tuple(w_scale.shape))} with {x.dtype} x")
        if quantize and (scales is None or scales.dtype != torch.float32 or not scales.is_contiguous()
                         or scales.numel() != x.shape[0]):
            raise ValueError(f"int8_gemm with fp32 x wants scales: a contiguous fp32 tensor of {x.shape[0]} "
                             f"values, got {None if scales is None else (scales.dtype, tuple(scales.shape))}")
        segs = self._segments(w, experts, x, out, starts, w.shape[2], "int8_gemm", trusted)
        if segs is None:
            if quantize and x.shape[0]:  # nothing to multiply; the scales still come back
                scales.copy_(_row_scales(x).view_as(scales))
            return out
        rc = self._lib.moekit_int8_gemm_segments(w.data_ptr(), experts.data_ptr(), segs[0], segs[1],
                                                 None if quantize else x.data_ptr(),
                                                 x.data_ptr() if quantize else None,
                                                 scales.data_ptr() if quantize else None, segs[2], w.shape[1],
                                                 w.shape[2], None if scaled else out.data_ptr(),
                                                 w_scale.data_ptr() if scaled else None,
                                                 out.data_ptr() if scaled else None, torch.get_num_threads())
        if rc:
            raise MemoryError("int8_gemm could not allocate its scratch rows")
        return out

    def wo_gemm(self, w: torch.Tensor, scale: torch.Tensor, zero: Optional[torch.Tensor], experts: torch.Tensor,
                x: torch.Tensor, out: torch.Tensor, *, int4: bool, group_size: int,
                starts: Optional[torch.Tensor] = None, trusted: bool = False) -> torch.Tensor:
        """Weight-only products of rows grouped by expert: out[j] = dequant(w[experts[s]]) @ x[j], in fp32;
        on VNNI builds (isa "avx512_vnni", or "avx2_vnni": AVX-VNNI beside AVX2), and for int4 on
        AVX2 builds without VNNI ("avx2": vpmaddubsw), as integer products against x rounded to
        16-bit fixed point per group (a power-of-two step, at most 2^-14 of the group's max |x|
        an element), where the weight chunks fit the groups (cpu_kernels.c says how).

        Args:
            w: [E, N, K/2] uint8 (int4, two per byte; stored u = q + 8 without zero points) or
               [E, N, K] int8 (symmetric) / uint8 (with zero points); contiguous.
            scale: [E, N, K/g] fp32.  zero: [E, N, K/g] uint8 or None.
            x: [R or 1, K] fp32.  out: [R, N] fp32.  experts, starts, trusted: as in `int8_gemm`.
            group_size: g, a multiple of 32 dividing K.
        """
        if (x.dtype, out.dtype) != (torch.float32, torch.float32):
            raise TypeError(f"wo_gemm wants uint8 (int4) or int8 / uint8 w, fp32 scale, x and out, uint8 zero; got "
                            f"{w.dtype}, {scale.dtype}, {x.dtype}, {out.dtype}, {None if zero is None else zero.dtype}")
        wtype, K, N = self._weight_only(w, scale, zero, int4, group_size, "wo_gemm")
        segs = self._segments(w, experts, x, out, starts, K, "wo_gemm", trusted)
        if segs is not None:
            rc = self._lib.moekit_wo_gemm_segments(wtype, w.data_ptr(), scale.data_ptr(),
                                                   None if zero is None else zero.data_ptr(), experts.data_ptr(),
                                                   segs[0], segs[1], x.data_ptr(), segs[2], N, K, group_size,
                                                   out.data_ptr(), torch.get_num_threads())
            if rc:
                raise MemoryError("wo_gemm could not allocate its scratch rows")
        return out

    @staticmethod
    def _weight_only(w, scale, zero, int4, group_size, what):
        """Checks of weight-only weights (wo_gemm's Args); (wtype, K, N)."""
        K = w.shape[2] * (2 if int4 else 1)
        if (w.dtype not in (torch.int8, torch.uint8) or (int4 and w.dtype != torch.uint8) or scale.dtype != torch.float32
                or (zero is not None and zero.dtype != torch.uint8)):
            raise TypeError(f"{what} wants uint8 (int4) or int8 / uint8 w, fp32 scale, uint8 zero; got {w.dtype}, "
                            f"{scale.dtype}, {None if zero is None else zero.dtype}")
        wtype = 0 if int4 else (1 if w.dtype == torch.int8 else 2)
        if wtype == 2 and zero is None:
            raise ValueError(f"{what}: uint8 int8 weights need their zero points")
        if group_size <= 0 or group_size % 32 or K % group_size:
            raise ValueError(f"{what}: group_size must be a multiple of 32 dividing K={K}, got {group_size}")
        E, N = w.shape[:2]
        if tuple(scale.shape) != (E, N, K // group_size) or (zero is not None and zero.shape != scale.shape):
            raise ValueError(f"{what}: scale {tuple(scale.shape)} (zero {None if zero is None else tuple(zero.shape)})"
                             f" must be [{E}, {N}, {K // group_size}] for w {tuple(w.shape)} and g={group_size}")
        if not (scale.is_contiguous() and (zero is None or zero.is_contiguous())):
            raise ValueError(f"{what} wants contiguous scale and zero")
        return wtype, K, N

    def float_gemm(self, w: torch.Tensor, experts: torch.Tensor, x: torch.Tensor, out: torch.Tensor,
                   starts: Optional[torch.Tensor] = None, *, trusted: bool = False) -> torch.Tensor:
        """fp32-accumulated products of rows grouped by expert: out[j] = w[experts[s]] @ x[j].

        Args:
            w: [E, N, K] fp32, bf16 or fp16, contiguous.  x: [R or 1, K] fp32.  out: [R, N] fp32.
            experts, starts, trusted: as in `int8_gemm`.
        """
        wtype = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}.get(w.dtype)
        if wtype is None or (x.dtype, out.dtype) != (torch.float32, torch.float32):
            raise TypeError(f"float_gemm wants fp32 / bf16 / fp16 w, fp32 x and out; got {w.dtype}, {x.dtype}, "
                            f"{out.dtype}")
        segs = self._segments(w, experts, x, out, starts, w.shape[2], "float_gemm", trusted)
        if segs is not None:
            self._lib.moekit_float_gemm_segments(wtype, w.data_ptr(), experts.data_ptr(), segs[0], segs[1],
                                                 x.data_ptr(), segs[2], w.shape[1], w.shape[2], out.data_ptr(),
                                                 torch.get_num_threads())
        return out

    @property
    def pair_blocks(self) -> bool:
        """Whether `float_gemm` multiplies bf16 / fp16 weights past several x rows in blocks of 2
        weight rows x 4 x rows (builds for AVX2 and F16C without AVX-512, where neither is
        native)."""
        return hasattr(self._lib, "moekit_pair_blocks") and bool(self._lib.moekit_pair_blocks())

    @property
    def bf16_dot(self) -> bool:
        """Whether `bf16_gemm` multiplies in this build (AVX-512 BF16)."""
        return hasattr(self._lib, "moekit_bf16_dot") and bool(self._lib.moekit_bf16_dot())

    def _bf16_weights(self, w, scale, zero, int4, group_size, what):
        """(wtype, scale, zero, g, K, N) of a bf16 call's weights: bf16 w, or weight-only ones."""
        if not self.bf16_dot:
            raise RuntimeError(f"{what} needs AVX-512 BF16; this {self.isa} build has none")
        if scale is None:
            if w.dtype != torch.bfloat16 or zero is not None or int4:
                raise TypeError(f"{what} wants bf16 w, or weight-only w with its scale; got {w.dtype}")
            return -1, None, None, 0, w.shape[2], w.shape[1]
        wtype, K, N = self._weight_only(w, scale, zero, int4, group_size, what)
        return wtype, scale.data_ptr(), None if zero is None else zero.data_ptr(), group_size, K, N

    def bf16_gemm(self, w: torch.Tensor, experts: torch.Tensor, x: torch.Tensor, out: torch.Tensor,
                  starts: Optional[torch.Tensor] = None, *, scale: Optional[torch.Tensor] = None,
                  zero: Optional[torch.Tensor] = None, int4: bool = False, group_size: int = 0,
                  trusted: bool = False) -> torch.Tensor:
        """bf16 products of bf16 rows grouped by expert, fp32 accumulation and out:
        out[j] = w[experts[s]] @ x[j], by vdpbf16ps (builds with AVX-512 BF16: `bf16_dot`).

        Args:
            w: [E, N, K] bf16, contiguous; or weight-only weights with scale, zero, int4 and
                group_size as in `wo_gemm`, dequantized to bf16 (rounded to nearest even) a
                block at a time.
            x: [R or 1, K] bf16.  out: [R, N] fp32.  experts, starts, trusted: as in `int8_gemm`.
        """
        if (x.dtype, out.dtype) != (torch.bfloat16, torch.float32):
            raise TypeError(f"bf16_gemm wants bf16 x and fp32 out; got {x.dtype}, {out.dtype}")
        wtype, sp, zp, g, K, N = self._bf16_weights(w, scale, zero, int4, group_size, "bf16_gemm")
        segs = self._segments(w, experts, x, out, starts, K, "bf16_gemm", trusted, N=N)
        if segs is not None:
            rc = self._lib.moekit_bf16_gemm_segments(wtype, w.data_ptr(), sp, zp, g, experts.data_ptr(), segs[0],
                                                     segs[1], x.data_ptr(), segs[2], N, K, out.data_ptr(),
                                                     torch.get_num_threads())
            if rc:
                raise MemoryError("bf16_gemm could not allocate its scratch")
        return out

    def bf16_gate_up(self, w13: torch.Tensor, experts: torch.Tensor, x: torch.Tensor, out: torch.Tensor,
                     starts: Optional[torch.Tensor] = None, *, activation: str, alpha: float = 1.702,
                     limit: float = 7.0, b13: Optional[torch.Tensor] = None, scale: Optional[torch.Tensor] = None,
                     zero: Optional[torch.Tensor] = None, int4: bool = False, group_size: int = 0,
                     trusted: bool = False) -> torch.Tensor:
        """A gated GEMM1 with its activation, by vdpbf16ps: out[j] = bf16(act(w13[e] @ x[j] + b13[e]))
        for the rows j of each segment (expert e), fp32 sums and activation (builds with AVX-512
        BF16: `bf16_dot`).

        Args:
            w13: [E, 2I, K] bf16 (gate rows, then up rows), contiguous; or weight-only weights
                with scale, zero, int4 and group_size as in `bf16_gemm`.
            x: [R or 1, K] bf16.  out: [R, I] bf16, contiguous (written).  activation: a gated
                one (silu, gelu, gelu_tanh, swigluoai; alpha and limit for swigluoai).
            b13: [E, 2I] fp32 or None.  experts, starts, trusted: as in `int8_gemm`.
        """
        code = ACTIVATION_CODES.get(activation)
        if code is None or code >= GATED_CODES:
            raise ValueError(f"bf16_gate_up wants a gated activation "
                             f"{[a for a, c in ACTIVATION_CODES.items() if c < GATED_CODES]}, "
                             f"got {activation!r}")
        if (x.dtype, out.dtype) != (torch.bfloat16, torch.bfloat16):
            raise TypeError(f"bf16_gate_up wants bf16 x and out; got {x.dtype}, {out.dtype}")
        wtype, sp, zp, g, K, N1 = self._bf16_weights(w13, scale, zero, int4, group_size, "bf16_gate_up")
        E = w13.shape[0]
        if N1 % 2 or (b13 is not None and (b13.dtype != torch.float32 or tuple(b13.shape) != (E, N1)
                                           or not b13.is_contiguous())):
            raise ValueError(f"bf16_gate_up wants w13 [E, 2I, K] and b13 None or [E, 2I] fp32 contiguous; got w13 "
                             f"{tuple(w13.shape)}, b13 {None if b13 is None else (tuple(b13.shape), b13.dtype)}")
        segs = self._segments(w13, experts, x, out, starts, K, "bf16_gate_up", trusted, N=N1 // 2)
        if segs is not None:
            rc = self._lib.moekit_bf16_gate_up_segments(
                wtype, w13.data_ptr(), sp, zp, g, experts.data_ptr(), segs[0], segs[1], x.data_ptr(), segs[2], N1 // 2,
                K, code, alpha, limit, None if b13 is None else b13.data_ptr(), out.data_ptr(), torch.get_num_threads())
            if rc:
                raise MemoryError("bf16_gate_up could not allocate its scratch")
        return out

    def decode(self, p13: Projection, p2: Projection, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
               x: torch.Tensor, out: torch.Tensor, *, activation: str, alpha: float = 1.702, limit: float = 7.0,
               on_input: bool = False, expert_map: Optional[torch.Tensor] = None, b13: Optional[torch.Tensor] = None,
               b2: Optional[torch.Tensor] = None, trusted: bool = False) -> torch.Tensor:
        """Decode: each token's experts FFN in one parallel region (cpu_kernels.c, moekit_decode),
        out[t] = sum_j c_j (W2[e_j] act(W13[e_j] x_j + b13[e_j]) + b2[e_j]) over token t's local
        slots j in slot order (c_j = topk_weights[t, j] and x_j = x[t]; with on_input, c_j = 1
        and x_j = topk_weights[t, j] x[t]), fp32; zeros for a token with no local slot.

        Args:
            p13, p2: the projections (`projection`): p13 [E, N1, H], p2 [E, H, I], N1 = 2I for
                gated activations, else I.
            topk_ids: [T, k] int32 / int64 expert ids (global ones with expert_map).
            topk_weights: [T, k] fp32.  x: [T, H] fp32.  out: [T, H] fp32 (written).
            activation: a name of moekit.activations (alpha and limit for "swigluoai").
            expert_map: [E_global] int32 / int64, global -> local id (-1: elsewhere), or None.
            b13, b2: [E, N1], [E, H] fp32 bias tables, or None.
            trusted: skip the dtype, shape and layout checks (ids are range-checked either way).
        """
        code = ACTIVATION_CODES.get(activation)
        if code is None:
            raise ValueError(f"activation must be one of {list(ACTIVATION_CODES)}, got {activation!r}")
        T, k = topk_ids.shape
        if not trusted:
            self._check_decode(p13, p2, topk_ids, topk_weights, x, out, expert_map, b13, b2)
        if T == 0:
            return out
        rc = self._lib.moekit_decode(
            ctypes.byref(p13.struct), ctypes.byref(p2.struct), code, alpha, limit, topk_ids.data_ptr(),
            int(topk_ids.dtype == torch.int64), topk_weights.data_ptr(), T, k,
            None if expert_map is None else expert_map.data_ptr(),
            int(expert_map is not None and expert_map.dtype == torch.int64),
            0 if expert_map is None else expert_map.shape[0], p13.E, int(on_input), x.data_ptr(),
            None if b13 is None else b13.data_ptr(), None if b2 is None else b2.data_ptr(), out.data_ptr(),
            torch.get_num_threads())
        if rc == 2:
            raise ValueError(f"decode: p13 [N1={p13.N}, H={p13.K}] and p2 [H={p2.N}, I={p2.K}] do not fit "
                             f"{activation!r} (N1 = 2I gated, I otherwise) or k={k}")
        if rc == 3:
            bound = p13.E if expert_map is None else expert_map.shape[0]
            raise ValueError(f"decode: topk_ids must lie in [0, {bound}) and the expert_map in [-1, {p13.E}); "
                             f"got ids {topk_ids.tolist()}")
        if rc:
            raise MemoryError("decode could not allocate its scratch")
        return out

    @staticmethod
    def _check_decode(p13, p2, topk_ids, topk_weights, x, out, expert_map, b13, b2):
        T, k = topk_ids.shape
        H = p13.K
        if (topk_ids.dtype not in (torch.int32, torch.int64)
                or (expert_map is not None and expert_map.dtype not in (torch.int32, torch.int64))
                or any(t.dtype != torch.float32 for t in (topk_weights, x, out, b13, b2) if t is not None)):
            raise TypeError(f"decode wants int32 / int64 topk_ids and expert_map, fp32 topk_weights, x, out and "
                            f"biases; got {topk_ids.dtype}, {topk_weights.dtype}, {x.dtype}, {out.dtype}")
        tensors = [t for t in (topk_ids, topk_weights, x, out, expert_map, b13, b2) if t is not None]
        fits = (p13.E == p2.E and tuple(topk_weights.shape) == (T, k) and tuple(x.shape) == (T, H)
                and tuple(out.shape) == (T, H) and (expert_map is None or expert_map.dim() == 1)
                and (b13 is None or tuple(b13.shape) == (p13.E, p13.N))
                and (b2 is None or tuple(b2.shape) == (p13.E, H)))
        if not fits or not all(t.is_contiguous() for t in tensors):
            raise ValueError(f"decode: topk_ids {tuple(topk_ids.shape)}, topk_weights {tuple(topk_weights.shape)}, "
                             f"x {tuple(x.shape)}, out {tuple(out.shape)}, biases "
                             f"{None if b13 is None else tuple(b13.shape)} / {None if b2 is None else tuple(b2.shape)} "
                             f"do not fit E={p13.E} (p2: {p2.E}), H={H}, N1={p13.N} (contiguous tensors wanted)")

    @staticmethod
    def _segments(w, experts, x, out, starts, K, what, trusted, N=None):
        """Checks shared by the products (out [R, N], N w's rows unless given); (starts pointer,
        segments, x row stride), or None when there is nothing to multiply (out zeroed)."""
        if experts.dtype != torch.int64 or (starts is not None and starts.dtype != torch.int64):
            raise TypeError(f"{what} wants int64 experts and starts, got {experts.dtype}, "
                            f"{None if starts is None else starts.dtype}")
        tensors = (w, experts, out) + (() if starts is None else (starts,))
        if not all(t.is_contiguous() for t in tensors) or x.dim() != 2 or (x.shape[-1] > 1 and x.stride(-1) != 1):
            raise ValueError(f"{what} wants contiguous w, experts, starts, out and x rows")
        S, R, N = experts.shape[0], out.shape[0], w.shape[1] if N is None else N
        fits = (x.shape[-1] == K and x.shape[0] in (1, R) and tuple(out.shape) == (R, N)
                and (R == S if starts is None else tuple(starts.shape) == (S + 1,)))
        if not fits:
            raise ValueError(f"{what}: w {tuple(w.shape)}, {S} experts, "
                             f"{'no starts' if starts is None else f'starts {tuple(starts.shape)}'}, "
                             f"x {tuple(x.shape)}, out {tuple(out.shape)} do not fit together")
        if not trusted and starts is not None and S and (starts[0] != 0 or starts[-1] != R or bool((starts.diff() < 0).any())):
            raise ValueError(f"{what}: starts must rise from 0 to the {R} rows of out, got {starts.tolist()}")
        if not trusted and S and (int(experts.min()) < 0 or int(experts.max()) >= w.shape[0]):
            raise ValueError(f"{what}: experts must lie in [0, {w.shape[0]}), got {experts.tolist()}")
        if R == 0 or N == 0 or K == 0 or S == 0:
            out.zero_()
            return None
        x_stride = x.stride(0) if x.shape[0] == R and R > 1 else 0
        return None if starts is None else starts.data_ptr(), S, x_stride


def _row_scales(x: torch.Tensor) -> torch.Tensor:
    """Per-row int8 scales of fp32 rows (quantize_activation's), for calls with nothing to multiply."""
    from ..quant.quantize import quantize_activation  # noqa: PLC0415
    from ..quant.schemes import get_scheme  # noqa: PLC0415

    return quantize_activation(x, get_scheme("int8_w8a8"))[1]


def _cpu_vendor() -> str:
    """/proc/cpuinfo's vendor_id ("GenuineIntel", "AuthenticAMD", ...), "" where unknown."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def _flags(isa: str) -> list:
    """Compiler flags of a build. "native" decodes one weight row after another on AMD CPUs,
    whose hardware prefetchers follow four interleaved rows badly (cpu_kernels.c, "Row order")."""
    flags = list(_ISA_FLAGS[isa])
    if isa == "native" and _cpu_vendor() == "AuthenticAMD":
        flags.append("-DMOEKIT_ROW_GROUP=1")
    return flags


def _compiler() -> Optional[str]:
    for cc in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cc and shutil.which(cc):
            return cc
    return None


def _cache_dir() -> Path:
    root = os.environ.get("MOEKIT_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "moekit")
    return Path(root) / "native"


def compile_cached(compiler: str, flags: list, source: Path, after: list, directory: Path, stem: str) -> Path:
    """The shared library `compiler flags source -o LIB after` in directory, named stem_KEY.so by
    the source, the compiler's path and the flags; compiled only when it is not there yet.

    Raises RuntimeError with the compiler's message when it fails."""
    key = hashlib.sha256(source.read_bytes() + " ".join([os.path.realpath(shutil.which(compiler) or compiler),
                                                         *flags]).encode()).hexdigest()[:16]
    path = directory / f"{stem}_{key}.so"
    if not path.exists():
        directory.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=directory)
        os.close(fd)
        try:
            run = subprocess.run([compiler, *flags, str(source), "-o", tmp, *after], capture_output=True, text=True)
            if run.returncode != 0:
                name = os.path.basename(compiler)
                raise RuntimeError(f"{name} failed to compile {source.name}: {run.stderr.strip()[-2000:]}")
            os.replace(tmp, path)  # atomic: concurrent builders (ranks) each land a whole file
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return path


def build(isa: str = "native", cache_dir: Optional[Path] = None) -> NativeLibrary:
    """Compile (or reuse) and load the kernels for `isa` ("native", "avx2" or "scalar").

    Raises RuntimeError with the reason when it cannot.
    """
    if isa not in _ISA_FLAGS:
        raise ValueError(f"isa must be one of {sorted(_ISA_FLAGS)}, got {isa!r}")
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        raise RuntimeError(f"native kernels are built for x86-64 Linux only, this is {sys.platform} "
                           f"{platform.machine()}")
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler found (set CC, or install cc / gcc / clang)")
    flags = ["-O3", "-std=c11", "-fPIC", "-shared", "-fopenmp", *_flags(isa)]
    directory = Path(cache_dir) if cache_dir is not None else _cache_dir()
    path = compile_cached(cc, flags, SOURCE, ["-lm"], directory, f"moekit_cpu_{isa}")
    lib = ctypes.CDLL(str(path))
    lib.moekit_isa.restype = ctypes.c_char_p
    lib.moekit_openmp.restype = ctypes.c_int
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    f = lib.moekit_int8_gemm_segments
    f.restype = ctypes.c_int
    f.argtypes = [ptr, ptr, ptr, i64, ptr, ptr, ptr, i64, i64, i64, ptr, ptr, ptr, ctypes.c_int]
    f = lib.moekit_wo_gemm_segments
    f.restype = ctypes.c_int
    f.argtypes = [ctypes.c_int, ptr, ptr, ptr, ptr, ptr, i64, ptr, i64, i64, i64, i64, ptr, ctypes.c_int]
    f = lib.moekit_float_gemm_segments
    f.restype = ctypes.c_int
    f.argtypes = [ctypes.c_int, ptr, ptr, ptr, i64, ptr, i64, i64, i64, ptr, ctypes.c_int]
    if hasattr(lib, "moekit_pair_blocks"):
        lib.moekit_pair_blocks.restype = ctypes.c_int
    if hasattr(lib, "moekit_bf16_dot"):  # (kernel sources from before them, as bench/native_ab.py builds, lack them)
        f = lib.moekit_bf16_gemm_segments
        f.restype = ctypes.c_int
        f.argtypes = [ctypes.c_int, ptr, ptr, ptr, i64, ptr, ptr, i64, ptr, i64, i64, i64, ptr, ctypes.c_int]
        lib.moekit_bf16_dot.restype = ctypes.c_int
        f = lib.moekit_bf16_gate_up_segments
        f.restype = ctypes.c_int
        f.argtypes = [ctypes.c_int, ptr, ptr, ptr, i64, ptr, ptr, i64, ptr, i64, i64, i64, ctypes.c_int,
                      ctypes.c_float, ctypes.c_float, ptr, ptr, ctypes.c_int]
    f = lib.moekit_decode
    f.restype = ctypes.c_int
    f.argtypes = [ptr, ptr, ctypes.c_int, ctypes.c_float, ctypes.c_float, ptr, ctypes.c_int, ptr, i64, i64, ptr,
                  ctypes.c_int, i64, i64, ctypes.c_int, ptr, ptr, ptr, ptr, ctypes.c_int]
    return NativeLibrary(path, lib.moekit_isa().decode(), bool(lib.moekit_openmp()), lib)


_LIBRARY: Optional[NativeLibrary] = None
_REASON: Optional[str] = None


def load() -> Optional[NativeLibrary]:
    """The kernels for this CPU, built on first call; None when unavailable (`status()` says why)."""
    global _LIBRARY, _REASON
    if _LIBRARY is None and _REASON is None:
        if os.environ.get("MOEKIT_NATIVE", "1") == "0":
            _REASON = "turned off by MOEKIT_NATIVE=0"
        else:
            try:
                lib = build("native")
            except (RuntimeError, OSError) as e:
                _REASON = str(e)
            else:
                if lib.isa not in FAST_ISAS:
                    _REASON = f"this CPU's build targets {lib.isa!r}; the kernels are faster than torch on {FAST_ISAS}"
                elif not lib.openmp:
                    _REASON = "compiled without OpenMP (one thread), slower than torch's operators"
                else:
                    _LIBRARY = lib
    return _LIBRARY


def status() -> str:
    """One line: which native kernels run here, or why none do."""
    lib = load()
    if lib is None:
        return f"unavailable: {_REASON}"
    bf16 = ", AVX-512 BF16 products" if lib.bf16_dot else (", 16-bit pair blocks" if lib.pair_blocks else "")
    return f"available ({lib.isa}{bf16}, OpenMP): {lib.path}"


def reset() -> None:
    """Forget the loaded library and its reason (tests: after changing MOEKIT_NATIVE)."""
    global _LIBRARY, _REASON
    _LIBRARY, _REASON = None, None

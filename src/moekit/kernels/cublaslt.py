"""cuBLASLt called directly for one product: fp8 operands with DeepSeek-V3's block scales.

The block scheme's GEMM1 on cuBLAS (cublas_block.py) makes one product an expert, 256 a call for
DeepSeek-V3. Through torch._scaled_mm each cost 25-26 us of host time on an H200 host (torch
checks its arguments and asks cuBLASLt's heuristic for an algorithm on every call). Here the
operation's descriptors are made once a shape, the layouts and the heuristic's algorithm once a
row count, and a product sets two scale pointers and enqueues cublasLtMatmul: 14.8 us a launch,
most of it inside cublasLtMatmul (bench/results/h200-cublaslt-block-probe.json, "host"). The
products are torch's bits (same probe, "bits": four shapes, 4 to 1024 rows), except at 4-12 rows
of N = 4096, K = 7168, where torch (which offers cuBLAS a workspace; this binding offers none)
gets another algorithm: both are 1.7e-3 off the fp32 product there.

The product (torch._scaled_mm's operand order, so the two give the same bits):
    out[m, N] (row-major) = (a[m, K] * sa) @ (w[N, K] * sw)^T
with a and w fp8 e4m3 row-major, sa the 1 x 128 scales of a's rows stored M-major ([K/128][m]
floats), sw the 128 x 128 block scales of w ([N/128, K/128] row-major), out bf16 or fp16. In
cuBLAS's column-major terms: A = w (transposed, BLK128x128 scales), B = a (VEC128 scales),
D = out^T [N, m].

The library is the cuBLASLt torch itself loaded (found in the process's mappings), so nothing
new is loaded and versions cannot mix. `engine` returns None, with `refusal` saying why, where
there is none, it is older than 12.9, or the GPU is not Hopper; the caller then uses torch.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Dict, Optional, Tuple

import torch

__all__ = ["BlockScaledFp8", "engine", "refusal"]

# cuBLAS / CUDA enumerations (cublas_api.h, cublasLt.h, library_types.h).
_CUDA_R_32F, _CUDA_R_16F, _CUDA_R_16BF, _CUDA_R_8F_E4M3 = 0, 2, 14, 28
_COMPUTE_32F = 68
_OP_N, _OP_T = 0, 1
_DESC_TRANSA, _DESC_TRANSB = 3, 4
_DESC_SM_COUNT_TARGET = 15
_DESC_A_SCALE_POINTER, _DESC_B_SCALE_POINTER = 17, 18
_DESC_A_SCALE_MODE, _DESC_B_SCALE_MODE = 31, 32
_SCALE_VEC128_32F, _SCALE_BLK128x128_32F = 4, 5
_PREF_MAX_WORKSPACE_BYTES = 1
_MIN_VERSION = 120900  # block-scaled fp8 products arrived in cuBLAS 12.9

_OUT_TYPES = {torch.bfloat16: _CUDA_R_16BF, torch.float16: _CUDA_R_16F}


class _HeuristicResult(ctypes.Structure):
    _fields_ = [("algo", ctypes.c_uint64 * 8), ("workspace_size", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


def _find_library() -> Tuple[Optional[ctypes.CDLL], str]:
    """(torch's cuBLASLt, "") or (None, why not)."""
    if not torch.cuda.is_available():
        return None, "no CUDA device"
    torch.cuda.current_blas_handle()  # cuBLAS (and with it cuBLASLt) is loaded by now
    path = None
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                if "libcublasLt.so" in line:
                    path = line.split()[-1]
                    break
    except OSError:
        pass
    for name in ([path] if path else []) + ["libcublasLt.so.13", "libcublasLt.so.12"]:
        try:
            return ctypes.CDLL(name), ""
        except OSError:
            continue
    return None, "torch's cuBLASLt library was not found among the process's shared libraries"


def _bind(lib: ctypes.CDLL) -> None:
    vp, i32, u64, i64, sz = ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64, ctypes.c_int64, ctypes.c_size_t
    sigs = {
        "cublasLtGetVersion": ([], sz),
        "cublasLtCreate": ([ctypes.POINTER(vp)], i32),
        "cublasLtMatmulDescCreate": ([ctypes.POINTER(vp), i32, i32], i32),
        "cublasLtMatmulDescSetAttribute": ([vp, i32, vp, sz], i32),
        "cublasLtMatrixLayoutCreate": ([ctypes.POINTER(vp), i32, u64, u64, i64], i32),
        "cublasLtMatmulPreferenceCreate": ([ctypes.POINTER(vp)], i32),
        "cublasLtMatmulPreferenceSetAttribute": ([vp, i32, vp, sz], i32),
        "cublasLtMatmulAlgoGetHeuristic": ([vp, vp, vp, vp, vp, vp, vp, i32, ctypes.POINTER(_HeuristicResult),
                                            ctypes.POINTER(i32)], i32),
        "cublasLtMatmul": ([vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, sz, vp], i32),
    }
    for name, (args, res) in sigs.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, res


def _check(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"cuBLASLt {what} failed with status {status}")


class BlockScaledFp8:
    """Products out[m, N] = (a sa) (w sw)^T of fixed N, K and output dtype (module docstring).

    Made by `engine`. A call takes raw device addresses (int), so the caller can walk the experts
    of one buffer without making tensor views; it enqueues on `stream` (a cudaStream_t as int)
    and uses `workspace` (an address of workspace_bytes bytes no other stream uses meanwhile).
    """

    def __init__(self, lib: ctypes.CDLL, N: int, K: int, out_dtype: torch.dtype, workspace_bytes: int,
                 sm_count: int = 0):
        self.lib, self.N, self.K, self.workspace_bytes = lib, N, K, workspace_bytes
        self.out_type = _OUT_TYPES[out_dtype]
        self.handle, self.desc, self.a_layout, self.pref = (ctypes.c_void_p() for _ in range(4))
        _check(lib.cublasLtCreate(ctypes.byref(self.handle)), "handle creation")
        _check(lib.cublasLtMatmulDescCreate(ctypes.byref(self.desc), _COMPUTE_32F, _CUDA_R_32F), "descriptor creation")
        for attr, value in ((_DESC_TRANSA, _OP_T), (_DESC_TRANSB, _OP_N), (_DESC_A_SCALE_MODE, _SCALE_BLK128x128_32F),
                            (_DESC_B_SCALE_MODE, _SCALE_VEC128_32F)):
            v = ctypes.c_int32(value)
            _check(lib.cublasLtMatmulDescSetAttribute(self.desc, attr, ctypes.byref(v), 4), f"attribute {attr}")
        if sm_count:  # the products' kernels on at most this many SMs (others stay free for other streams)
            v = ctypes.c_int32(sm_count)
            _check(lib.cublasLtMatmulDescSetAttribute(self.desc, _DESC_SM_COUNT_TARGET, ctypes.byref(v), 4),
                   "SM count target")
        _check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(self.a_layout), _CUDA_R_8F_E4M3, K, N, K), "layout of w")
        _check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(self.pref)), "preference creation")
        ws = ctypes.c_uint64(workspace_bytes)
        _check(lib.cublasLtMatmulPreferenceSetAttribute(self.pref, _PREF_MAX_WORKSPACE_BYTES, ctypes.byref(ws), 8),
               "workspace preference")
        self.alpha, self.beta = ctypes.c_float(1.0), ctypes.c_float(0.0)
        self._plans: Dict[int, Tuple[ctypes.c_void_p, ctypes.c_void_p, _HeuristicResult]] = {}
        self._sa, self._sw = ctypes.c_void_p(), ctypes.c_void_p()
        self._lock = threading.Lock()

    def _set_scales(self, sa: int, sw: int) -> None:
        # Set before the heuristic too: cuBLASLt refuses block scale modes without scale pointers
        self._sw.value, self._sa.value = sw, sa
        lib = self.lib
        _check(lib.cublasLtMatmulDescSetAttribute(self.desc, _DESC_A_SCALE_POINTER, ctypes.byref(self._sw), 8),
               "scale pointer of w")
        _check(lib.cublasLtMatmulDescSetAttribute(self.desc, _DESC_B_SCALE_POINTER, ctypes.byref(self._sa), 8),
               "scale pointer of a")

    def algorithms(self, m: int, sa: int, sw: int, count: int = 8):
        """The heuristic's first `count` results for m rows (for probes): ([result], b_layout, d_layout)."""
        with self._lock:
            self._set_scales(sa, sw)
            return self._heuristic(m, count)

    def _heuristic(self, m: int, count: int):
        b, d = ctypes.c_void_p(), ctypes.c_void_p()
        lib = self.lib
        _check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(b), _CUDA_R_8F_E4M3, self.K, m, self.K), "layout of a")
        _check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(d), self.out_type, self.N, m, self.N), "layout of out")
        results = (_HeuristicResult * count)()
        n = ctypes.c_int(0)
        _check(lib.cublasLtMatmulAlgoGetHeuristic(self.handle, self.desc, self.a_layout, b, d, d, self.pref, count,
                                                   results, ctypes.byref(n)), f"heuristic for m={m}")
        return [results[i] for i in range(n.value)], b, d

    def __call__(self, m: int, a: int, sa: int, w: int, sw: int, out: int, stream: int, workspace: int,
                 result: Optional[_HeuristicResult] = None) -> None:
        with self._lock:  # the scale pointers live in the shared descriptor until the product is enqueued
            self._set_scales(sa, sw)
            plan = self._plans.get(m)
            if plan is None:
                found, b, d = self._heuristic(m, 1)
                if not found or found[0].state != 0:
                    raise RuntimeError(f"cuBLASLt has no algorithm for a block-scaled fp8 product of {m} x {self.N} "
                                       f"x {self.K}")
                self._plans[m] = plan = (b, d, found[0])
            b, d, best = plan
            algo = result if result is not None else best
            _check(self.lib.cublasLtMatmul(self.handle, self.desc, ctypes.byref(self.alpha), w, self.a_layout, a, b,
                                           ctypes.byref(self.beta), out, d, out, d, ctypes.byref(algo.algo), workspace,
                                           self.workspace_bytes, stream), f"product of {m} x {self.N} x {self.K}")


_LOCK = threading.Lock()
_LIB: Dict[str, object] = {}
_ENGINES: Dict[tuple, BlockScaledFp8] = {}


def refusal() -> Optional[str]:
    """Why products cannot go to cuBLASLt directly here, or None."""
    if "why" not in _LIB:
        with _LOCK:
            lib, why = _find_library()
            if lib is not None:
                try:
                    _bind(lib)
                    version = int(lib.cublasLtGetVersion())
                    if version < _MIN_VERSION:
                        why = f"cuBLASLt {version} is older than 12.9, which brought block-scaled fp8 products"
                except AttributeError as err:
                    why = f"torch's cuBLASLt lacks a function this binding needs ({err})"
            _LIB["lib"], _LIB["why"] = (lib if not why else None), (why or None)
    return _LIB["why"]


def engine(device: torch.device, N: int, K: int, out_dtype: torch.dtype, workspace_bytes: int = 0,
           sm_count: int = 0) -> Optional[BlockScaledFp8]:
    """The products of shape (N, K) into out_dtype on device (made once), or None (see refusal);
    sm_count: at most this many SMs a product (0: cuBLAS's choice)."""
    if refusal() is not None or out_dtype not in _OUT_TYPES:
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    if torch.cuda.get_device_capability(index)[0] != 9:
        return None
    key = (index, N, K, out_dtype, workspace_bytes, sm_count)
    if key not in _ENGINES:
        with _LOCK, torch.cuda.device(index):
            _ENGINES[key] = BlockScaledFp8(_LIB["lib"], N, K, out_dtype, workspace_bytes, sm_count)
    return _ENGINES[key]

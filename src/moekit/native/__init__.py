"""Native CPU kernels, compiled on first use with this machine's C compiler.

What: `int8_gemv_experts`, a decode token's int8 products over its k experts in one call
(cpu_kernels.c says how). torch offers one int8 GEMM per expert (torch._int_mm): at one
token each is a short weight stream with its own parallel region, and the CPU int8 backend's
decode spent about 1.1 ms of 1.5 in 16 of them (E=64, k=8, H=1024, I=512 on a 2-core AVX-512
VNNI host); the kernel here streams the same weights in 0.8 ms (bench/NOTES-cpu.md).

How: cpu_kernels.c ships with the package. On first use it is compiled for this CPU
(`-O3 -march=native -fopenmp`) with $CC, else cc, gcc or clang, into $MOEKIT_CACHE_DIR
(default ~/.cache/moekit) under a name keyed by the source, compiler and flags, and loaded
with ctypes; OpenMP binds to the runtime torch already loaded (same soname), so the kernel
and torch share one thread pool. x86-64 Linux only. Anything that fails (no compiler, no
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

__all__ = ["FAST_ISAS", "NativeLibrary", "build", "int8_gemv_experts", "library", "reset", "status"]

SOURCE = Path(__file__).with_name("cpu_kernels.c")

# Instruction sets whose kernels beat torch's operators (measured); "scalar" builds exist for tests.
FAST_ISAS = ("avx512_vnni", "avx512", "avx2")

_ISA_FLAGS = {
    "native": ["-march=native"],
    "avx2": ["-mavx2", "-mfma", "-mno-avx512f"],  # the AVX2 path on an AVX-512 machine (tests)
    "scalar": ["-mno-avx2", "-mno-avx512f"],
}


@dataclass
class NativeLibrary:
    """A compiled kernel library: `isa` is what the compiler targeted ("avx512_vnni", "avx2", ...)."""
    path: Path
    isa: str
    openmp: bool
    _lib: ctypes.CDLL

    def int8_gemv_experts(self, w: torch.Tensor, experts: torch.Tensor, x: torch.Tensor,
                          out: torch.Tensor) -> torch.Tensor:
        """out[i] = w[experts[i]] @ x[i] (x [1, K]: one row for every slot), exact int32.

        Args:
            w: [E, N, K] int8, contiguous.  experts: [n] int64 in [0, E).
            x: [1 or n, K] int8, rows contiguous.  out: [n, N] int32, contiguous (written).
        """
        E, N, K = w.shape
        n = experts.shape[0]
        if not (w.dtype == x.dtype == torch.int8 and out.dtype == torch.int32 and experts.dtype == torch.int64):
            raise TypeError(f"int8_gemv_experts wants int8 w and x, int64 experts, int32 out; got "
                            f"{w.dtype}, {x.dtype}, {experts.dtype}, {out.dtype}")
        if not (w.is_contiguous() and experts.is_contiguous() and out.is_contiguous() and x.stride(-1) == 1):
            raise ValueError("int8_gemv_experts wants contiguous w, experts, out and x rows")
        if x.shape[-1] != K or x.shape[0] not in (1, n) or tuple(out.shape) != (n, N):
            raise ValueError(f"int8_gemv_experts: w {tuple(w.shape)}, {n} experts, x {tuple(x.shape)}, "
                             f"out {tuple(out.shape)} do not fit together")
        if n == 0 or N == 0 or K == 0:
            return out.zero_()
        x_stride = x.stride(0) if x.shape[0] == n and n > 1 else 0
        rc = self._lib.moekit_int8_gemv_experts(w.data_ptr(), experts.data_ptr(), n, x.data_ptr(), x_stride,
                                                N, K, out.data_ptr(), torch.get_num_threads())
        if rc:
            raise MemoryError("int8_gemv_experts could not allocate its scratch row")
        return out


    def wo_gemv_experts(self, w: torch.Tensor, scale: torch.Tensor, zero: Optional[torch.Tensor],
                        experts: torch.Tensor, x: torch.Tensor, out: torch.Tensor, *, int4: bool,
                        group_size: int) -> torch.Tensor:
        """Weight-only products in fp32: out[i] = dequant(w[experts[i]]) @ x[i] (x [1, K]: one row for every slot).

        Args:
            w: [E, N, K/2] uint8 (int4, two per byte, stored u = q + 8 without zero points) or
               [E, N, K] int8 (symmetric) / uint8 (with zero points); contiguous.
            scale: [E, N, K/g] fp32.  zero: [E, N, K/g] uint8 or None.
            experts: [n] int64.  x: [1 or n, K] fp32, rows contiguous.  out: [n, N] fp32 (written).
            group_size: g, a multiple of 32 dividing K.
        """
        E, N = w.shape[:2]
        K = w.shape[2] * (2 if int4 else 1)
        n = experts.shape[0]
        G = K // group_size if group_size > 0 else 0
        wtype = 0 if int4 else (1 if w.dtype == torch.int8 else 2)
        if (w.dtype != (torch.uint8 if int4 else w.dtype) or w.dtype not in (torch.int8, torch.uint8)
                or x.dtype != torch.float32 or out.dtype != torch.float32 or scale.dtype != torch.float32
                or experts.dtype != torch.int64 or (zero is not None and zero.dtype != torch.uint8)):
            raise TypeError(f"wo_gemv_experts wants uint8 (int4) or int8 / uint8 w, fp32 scale, x and out, int64 "
                            f"experts, uint8 zero; got {w.dtype}, {scale.dtype}, {x.dtype}, {out.dtype}, "
                            f"{experts.dtype}, {None if zero is None else zero.dtype}")
        if wtype == 2 and zero is None:
            raise ValueError("wo_gemv_experts: uint8 int8 weights need their zero points")
        if group_size <= 0 or group_size % 32 or K % group_size:
            raise ValueError(f"wo_gemv_experts: group_size must be a multiple of 32 dividing K={K}, got {group_size}")
        tensors = (w, scale, experts, out) + (() if zero is None else (zero,))
        if not all(t.is_contiguous() for t in tensors) or x.stride(-1) != 1:
            raise ValueError("wo_gemv_experts wants contiguous w, scale, zero, experts, out and x rows")
        if (tuple(scale.shape) != (E, N, G) or (zero is not None and zero.shape != scale.shape)
                or x.shape[-1] != K or x.shape[0] not in (1, n) or tuple(out.shape) != (n, N)):
            raise ValueError(f"wo_gemv_experts: w {tuple(w.shape)}, scale {tuple(scale.shape)}, {n} experts, "
                             f"x {tuple(x.shape)}, out {tuple(out.shape)} do not fit together (K={K}, g={group_size})")
        if n == 0 or N == 0 or K == 0:
            return out.zero_()
        x_stride = x.stride(0) if x.shape[0] == n and n > 1 else 0
        rc = self._lib.moekit_wo_gemv_experts(wtype, w.data_ptr(), scale.data_ptr(),
                                              None if zero is None else zero.data_ptr(), experts.data_ptr(), n,
                                              x.data_ptr(), x_stride, N, K, group_size, out.data_ptr(),
                                              torch.get_num_threads())
        if rc:
            raise MemoryError("wo_gemv_experts could not allocate its scratch rows")
        return out


def _compiler() -> Optional[str]:
    for cc in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cc and shutil.which(cc):
            return cc
    return None


def _cache_dir() -> Path:
    root = os.environ.get("MOEKIT_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "moekit")
    return Path(root) / "native"


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
    flags = ["-O3", "-std=c11", "-fPIC", "-shared", "-fopenmp", *_ISA_FLAGS[isa]]
    source = SOURCE.read_bytes()
    key = hashlib.sha256(source + " ".join([shutil.which(cc) or cc, *flags]).encode()).hexdigest()[:16]
    directory = Path(cache_dir) if cache_dir is not None else _cache_dir()
    path = directory / f"moekit_cpu_{isa}_{key}.so"
    if not path.exists():
        directory.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=directory)
        os.close(fd)
        try:
            run = subprocess.run([cc, *flags, str(SOURCE), "-o", tmp], capture_output=True, text=True)
            if run.returncode != 0:
                raise RuntimeError(f"{cc} failed to compile {SOURCE.name}: {run.stderr.strip()[-2000:]}")
            os.replace(tmp, path)  # atomic: concurrent builders (ranks) each land a whole file
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    lib = ctypes.CDLL(str(path))
    lib.moekit_isa.restype = ctypes.c_char_p
    lib.moekit_openmp.restype = ctypes.c_int
    f = lib.moekit_int8_gemv_experts
    f.restype = ctypes.c_int
    f.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                  ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int]
    f = lib.moekit_wo_gemv_experts
    f.restype = ctypes.c_int
    f.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                  ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                  ctypes.c_int]
    return NativeLibrary(path, lib.moekit_isa().decode(), bool(lib.moekit_openmp()), lib)


_LIBRARY: Optional[NativeLibrary] = None
_REASON: Optional[str] = None


def library() -> Optional[NativeLibrary]:
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
    lib = library()
    if lib is None:
        return f"unavailable: {_REASON}"
    return f"available ({lib.isa}, OpenMP): {lib.path}"


def int8_gemv_experts(w: torch.Tensor, experts: torch.Tensor, x: torch.Tensor,
                      out: torch.Tensor) -> torch.Tensor:
    """`NativeLibrary.int8_gemv_experts` of this CPU's library; RuntimeError when unavailable."""
    lib = library()
    if lib is None:
        raise RuntimeError(f"native CPU kernels are {status()}")
    return lib.int8_gemv_experts(w, experts, x, out)


def reset() -> None:
    """Forget the loaded library and its reason (tests: after changing MOEKIT_NATIVE)."""
    global _LIBRARY, _REASON
    _LIBRARY, _REASON = None, None

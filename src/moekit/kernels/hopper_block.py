"""Block-scaled fp8 experts on Hopper in CUDA: warp-specialized warpgroups (kernels/cuda/hopper_block.cu).

The same two GEMMs as kernels/gluon_block.py ("fp8_w8a8_block128": 128 x 128 weight blocks,
1 x 128 activation groups; the same sorted rows, scales, item order and outputs), written as a
producer warpgroup that issues the TMA loads and two consumer warpgroups of 64 rows each that
take turns on the tensor cores: one promotes its K block (acc += product * scales) while the
other's products run. Triton 3.6's Gluon could not give that schedule (ptxas serialized the
products of warp-specialized partitions; bench/NOTES-triton.md, "The block scheme on Gluon
kernels in the layer").

How it runs: hopper_block.cu ships with the package and is compiled on first use with nvcc
(`$MOEKIT_NVCC`, else `$CUDA_HOME/bin/nvcc`, else `nvcc` on PATH) for sm_90a into
$MOEKIT_CACHE_DIR (default ~/.cache/moekit)/cuda, under a name keyed by the source and the
compiler, then loaded with ctypes; its host functions make the TMA descriptors (the driver's
cuTensorMapEncodeTiled) and launch on the caller's stream, so calls are capturable in CUDA
graphs. Without nvcc, or off Hopper, `status()` says why and the layer keeps the Gluon kernels.
MOEKIT_CUDA_KERNELS=0 turns them off.

Shapes: 128-row tiles (the alignment padded to 128 rows), H and I multiples of 128 (GEMM1's items
are 64 activation columns: I a multiple of 64 would do, the scale blocks ask 128), at most 1024
local experts; outputs in bf16 or fp16.
"""

from __future__ import annotations

import ctypes
import os
import shutil
from pathlib import Path
from typing import Optional

import torch

from ..native import compile_cached

__all__ = ["ROWS", "MAX_EXPERTS", "CLUSTER", "PIPELINED", "SOURCE", "build", "load", "status", "describe", "reset",
           "refusal", "gemm1", "gemm2"]

SOURCE = Path(__file__).with_name("cuda") / "hopper_block.cu"
ROWS = 128  # the row tile (two consumer warpgroups of 64 rows)
MAX_EXPERTS = 1024  # the expert tables kept in shared memory
# 2: CTA pairs that take the same row tile and neighbouring column tiles, each loading half of the
# A tile for both (TMA multicast: the L2 reads of A halved). Measured no faster than single CTAs
# (bench/results/h200-hopper-block-ab-4.json: 0.96-1.00x), so 1.
CLUSTER = 1
# K steps in pairs: both products of a pair issued before the first is promoted (the Gluon
# kernels' shapes give an even number of K steps). Within the spread of one step at a time.
PIPELINED = True
_FLAGS = ["-O3", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a", "-shared", "-Xcompiler", "-fPIC"]
_OUT_DTYPES = {torch.bfloat16: 0, torch.float16: 1}


def _nvcc() -> Optional[str]:
    for cand in (os.environ.get("MOEKIT_NVCC"),
                 os.path.join(os.environ["CUDA_HOME"], "bin", "nvcc") if os.environ.get("CUDA_HOME") else None,
                 shutil.which("nvcc")):
        if cand and os.path.isfile(cand) and os.access(cand, os.X_OK):
            return cand
    return None


def _cache_dir() -> Path:
    root = os.environ.get("MOEKIT_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "moekit")
    return Path(root) / "cuda"


def build(cache_dir: Optional[Path] = None) -> ctypes.CDLL:
    """Compile (or reuse) and load the kernels; RuntimeError with the reason when it cannot."""
    nvcc = _nvcc()
    if nvcc is None:
        raise RuntimeError("no nvcc found (set MOEKIT_NVCC or CUDA_HOME, or put nvcc on PATH)")
    directory = Path(cache_dir) if cache_dir is not None else _cache_dir()
    path = compile_cached(nvcc, _FLAGS, SOURCE, [], directory, "moekit_hopper_block")
    lib = ctypes.CDLL(str(path))
    ptr, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.moekit_block_gemm1.restype = i32
    lib.moekit_block_gemm1.argtypes = [ptr, i64, i64, i64, ptr, i64, ptr, ptr, i64, i64, ptr, i32, i64, ptr, i64,
                                       i32, i32, i32, i32, i32, ptr]
    lib.moekit_block_gemm2.restype = i32
    lib.moekit_block_gemm2.argtypes = [ptr, i64, i64, i64, ptr, i64, ptr, ptr, i64, i64, ptr, i32, i64, ptr, i64,
                                       ptr, ptr, i32, i32, i32, i32, i32, i32, ptr]
    return lib


_LIBRARY: Optional[ctypes.CDLL] = None
_REASON: Optional[str] = None


def load() -> Optional[ctypes.CDLL]:
    """The compiled kernels, built on first call; None when unavailable (`status()` says why)."""
    global _LIBRARY, _REASON
    if _LIBRARY is None and _REASON is None:
        if os.environ.get("MOEKIT_CUDA_KERNELS", "1") == "0":
            _REASON = "turned off by MOEKIT_CUDA_KERNELS=0"
        else:
            try:
                _LIBRARY = build()
            except (RuntimeError, OSError) as e:
                _REASON = str(e)
    return _LIBRARY


def status() -> str:
    """One line: whether the CUDA kernels are built here, or why not."""
    return f"available: {_LIBRARY._name}" if load() is not None else f"unavailable: {_REASON}"


def describe() -> str:
    """One line for `moekit info`: whether the kernels run here (built only where they can)."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        return "not used here (they need a Hopper GPU, compute capability 9.x)"
    return status()


def reset() -> None:
    """Forget the loaded library and its reason (tests: after changing the environment)."""
    global _LIBRARY, _REASON
    _LIBRARY, _REASON = None, None


def refusal(device: torch.device, x_dtype: torch.dtype, E: int, H: int, I: int, rows: int) -> Optional[str]:
    """Why these kernels cannot run a call the Gluon kernels can (gluon_block.refusal first), or None."""
    if rows != ROWS:
        return f"they run {ROWS}-row tiles, got {rows}"
    if x_dtype not in _OUT_DTYPES:
        return f"x must be bfloat16 or float16, got {x_dtype}"
    if H % 128 or I % 128:
        return f"H and I must be multiples of 128, got H={H}, I={I}"
    if not 1 <= E <= MAX_EXPERTS:
        return f"they keep at most {MAX_EXPERTS} experts' tables in shared memory, got E={E}"
    if device.type != "cuda" or torch.cuda.get_device_capability(device)[0] != 9:
        return "they use Hopper's warpgroup products (sm_90a): they need compute capability 9.x"
    if load() is None:
        return f"the CUDA kernels are unavailable: {_REASON}"
    return None


def _check(code: int, what: str) -> None:
    if code:
        raise RuntimeError(f"{what} failed to launch (code {code}: 1000 + CUresult of the TMA descriptor, "
                           f"2000 / 3000 + cudaError of the launch, -2 expert count, -3 device)")


def _operands(a: torch.Tensor, a_s: torch.Tensor, w: torch.Tensor, w_s: torch.Tensor) -> tuple:
    """The entry points' leading arguments (rows, their scales, the weights and theirs), after
    checking what the kernels assume of them (TMA reads the rows; the scales are read by index)."""
    if not w.is_contiguous() or a.stride(1) != 1 or (a.stride(0) * a.element_size()) % 16:
        raise ValueError("the fp8 rows need unit column strides and 16-byte row strides, and the weights must be "
                         f"contiguous; got rows strides {a.stride()}, weights contiguous {w.is_contiguous()}")
    if a_s.stride(1) != 1 or w_s.stride(2) != 1 or a_s.dtype != torch.float32 or w_s.dtype != torch.float32:
        raise ValueError(f"the scales must be fp32 with unit strides along K, got {a_s.dtype} {tuple(a_s.stride())} "
                         f"and {w_s.dtype} {tuple(w_s.stride())}")
    return (a.data_ptr(), a.shape[0], a.shape[1], a.stride(0), a_s.data_ptr(), a_s.stride(0), w.data_ptr(),
            w_s.data_ptr(), w_s.stride(0), w_s.stride(1))


def _launch_args(out: torch.Tensor, programs: Optional[int]) -> tuple:
    """The entry points' trailing arguments: output dtype, grid cap, variants, device and stream."""
    dev = out.device
    return (_OUT_DTYPES[out.dtype], programs or 0, CLUSTER, int(PIPELINED), dev.index,
            torch.cuda.current_stream(dev).cuda_stream)


def gemm1(a1s: torch.Tensor, a1s_s: torch.Tensor, w13: torch.Tensor, w13_s: torch.Tensor, act: torch.Tensor,
          expert_end: torch.Tensor, programs: Optional[int] = None) -> None:
    """gluon_block.gemm1 with 128-row tiles: act [R, I] (x's dtype) = silu(gate) * up of the sorted
    rows a1s [R, H] fp8 (scales a1s_s [R, H / 128]) through w13 [E, 2I, H] fp8 (scales
    [E, 2I / 128, H / 128]); rows past the last expert's padded end are left unwritten."""
    E, I2, _ = w13.shape
    operands = _operands(a1s, a1s_s, w13, w13_s)
    if a1s.shape[0]:
        _check(load().moekit_block_gemm1(*operands, expert_end.data_ptr(), E, I2 // 2, act.data_ptr(), act.stride(0),
                                         *_launch_args(act, programs)), "the CUDA block GEMM1")


def gemm2(a2: torch.Tensor, a2_s: torch.Tensor, w2: torch.Tensor, w2_s: torch.Tensor, y: torch.Tensor,
          topk_weights: torch.Tensor, sorted_ids: torch.Tensor, expert_end: torch.Tensor,
          programs: Optional[int] = None) -> None:
    """gluon_block.gemm2 with 128-row tiles: y [T * k, H] (x's dtype) at each sorted row's
    assignment = its routed weight * (the row a2 [R, I] fp8 (scales a2_s [R, I / 128]) through w2
    [E, H, I] fp8 (scales [E, H / 128, I / 128])); rows of non-local assignments left unwritten."""
    E, H, _ = w2.shape
    operands = _operands(a2, a2_s, w2, w2_s)
    if a2.shape[0]:
        _check(load().moekit_block_gemm2(*operands, expert_end.data_ptr(), E, H, y.data_ptr(), y.stride(0),
                                         topk_weights.data_ptr(), sorted_ids.data_ptr(), y.shape[0],
                                         *_launch_args(y, programs)), "the CUDA block GEMM2")

"""GEMM1 of the 128 x 128 block-scaled fp8 scheme on cuBLAS, one product an expert, at prefill sizes.

cuBLAS (CUDA 12.9 and newer, Hopper) multiplies fp8 operands with DeepSeek-V3's scales itself:
1 x 128 groups of the activation rows and 128 x 128 blocks of the weights, each K block's
product promoted with its two scales (torch._scaled_mm picks that recipe from the scales'
shapes and layouts). Per expert, on its rows of the alignment, it ran DeepSeek-V3's GEMM1 (N =
2I = 4096, K = H = 7168) at 1069 TFLOP/s at 512 rows and 1251 at 1024 on an H200, 1173 for the
256 experts one after another at 512 rows each, where the Gluon GEMM1 reaches 691
(bench/results/h200-scaled-mm-block-probe.json; bench/NOTES-triton.md). At 128 rows an expert
it ran at 219: the rule below keeps it to calls of at least CUBLAS_ROWS rows an expert, whose
products are each long enough to hide their launch (CUBLAS_MIN_FLOP).

The products go to cuBLASLt directly where torch's library is found (cublaslt.py: 15 us of host
time a launch against 26 through torch._scaled_mm, the same bits), else through torch. At
DeepSeek-V3's shape the call took 12.1-12.3 ms at M = 12288 (torch's launches: 14.2-17.8, the
Gluon GEMM1: 14.8-15.0) and 16.9-17.0 ms at M = 16384 (17.2-17.6; 18.9-19.2), eagerly: 1.34-1.41x
and 1.29-1.31x the bf16 kernel (bench/results/h200-cublaslt-block-probe.json, -sweep.json). What
is left is on the GPU: products of 513-640 rows take a second wave of tiles (48 against 31.6 us
at 512 rows), which products on the other streams fill only in part.

Where moekit's CUDA kernels take the call (kernels/hopper_block.py, knob `cuda`: 128-row tiles on
Hopper with nvcc) they run both GEMMs instead, faster eagerly too; cublas1 "on" still asks for
this path.

Pipeline (launch_quant.fused_moe_quant, knob `cublas1`, with the Gluon GEMM2 after it):
    align (+ x quantized per 128 columns) -> gather_rows -> scales of each expert's rows
    copied M-major (segment_scales_kernel) -> the host reads the experts' ends and row counts
    (one synchronisation) -> one cuBLAS product an expert into GEMM1's bf16 rows [R, 2I]
    -> silu(gate) * up rounded to x's dtype and quantized per 128 columns (silu_quant_kernel:
    the values the Gluon GEMM1 and quantize_rows give, up to GEMM1's own rounding) -> GEMM2.

The host synchronisation keeps it out of CUDA-graph capture and torch.compile; there the Gluon
GEMM1 runs. An expert's product covers its live rows rounded up to 4 (cuBLAS wants M-major
scales 16-byte aligned); the rows after them in its segment stay unwritten in GEMM1's output and
come out of silu_quant_kernel as zeros, as padding rows do on the Gluon path.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Dict, Optional, Tuple

import torch
import triton
import triton.language as tl

from . import cublaslt
from .triton_quant_rows import FP8_MAX, quant_groups

logger = logging.getLogger("moekit")

__all__ = ["CUBLAS_ROWS", "CUBLAS_MIN_FLOP", "refusal", "wanted", "explain", "gemm1"]

# Rows an expert (on average) from which the rule runs GEMM1 on cuBLAS: one product ran at 219 /
# 533 / 1069 TFLOP/s at 128 / 256 / 512 rows on DeepSeek-V3's GEMM1 (the Gluon GEMM1: 691); the
# layer's call, its products launched through torch, took 0.985x the Gluon GEMM1's time at 256
# rows an expert (M = 8192), 0.92x at 384 and 512 (M = 12288, 16384;
# bench/results/h200-cublas-gemm1-ab*.json); launched directly, 0.82x and 0.88x
# (h200-cublaslt-block-probe.json).
CUBLAS_ROWS = 384
# Floating-point operations of one expert's product (2 rows 2I H, at the mean rows an expert) from
# which the rule runs GEMM1 on cuBLAS: a launch takes 15 us of host time, so a product must keep
# the GPU busy about as long (20 GFLOP: about 20 us at 1000 TFLOP/s) or the launches set the pace.
# The cuBLAS GEMM1's call against the Gluon GEMM1's, eagerly (h200-cublas-gemm1-ab-shapes.json,
# -ab.json, h200-cublaslt-block-probe.json): DeepSeek-V3 (2I H = 29.4 M) 0.82x at 384 rows an
# expert (22.5 GFLOP), 0.88x at 512; Mixtral (117 M) 1.15x at 256 rows (under CUBLAS_ROWS), 0.99x
# at 512, 0.79-0.85x from 1024; OLMoE (4.2 M) 2.7x at 512 rows, 1.15x at 2048 (17 GFLOP); Qwen3
# (3.1 M) 2.0-4.5x up to 1024 rows (6.4 GFLOP).
CUBLAS_MIN_FLOP = 2e10
# Side streams the experts' products take in turn. One product of 512 rows on DeepSeek-V3's GEMM1
# fills 4 x 32 tiles of 128 x 128, one wave of the H200's 132 SMs (25-32 us); 528 rows take a
# second wave for 32 tiles (45-50 us): products on other streams fill some of the idle SMs (one
# stream 3 % slower than four at M = 16384, eight even with four).
STREAMS = 4
CHUNK = 4  # products a stream takes at a time
# Rows of one product at most (0: an expert's rows in one product). Pieces of 256-512 rows, meant
# to leave SMs to the other streams' products, measured even or slower at DeepSeek-V3 M = 12288
# and 16384, pieces of 128 rows 1.35-1.4x slower (host-bound; h200-cublaslt-block-sweep.json).
PIECE_ROWS = 0
# SMs a product may take at most (0: cuBLAS's choice). 33-120 SMs on 2-8 streams measured within
# 3 % of cuBLAS's choice at DeepSeek-V3 M = 12288 and 16384 (h200-cublaslt-block-sweep-sms.json).
SM_COUNT = 0
# Products through cuBLASLt directly (cublaslt.py: 15 us of host time a launch, against 26 in
# torch._scaled_mm), where it is found; False keeps torch._scaled_mm (same bits).
USE_DIRECT = True

_ACCEPTS: Dict[int, Optional[str]] = {}  # device index -> refusal (None: torch's cuBLAS takes the recipe)


def _probe(device: torch.device) -> Optional[str]:
    """Whether torch._scaled_mm runs the 1 x 128 / 128 x 128 recipe here (one tiny product)."""
    if not hasattr(torch, "_scaled_mm"):
        return f"this torch ({torch.__version__}) has no torch._scaled_mm"
    try:
        a = torch.zeros(16, 512, dtype=torch.float8_e4m3fn, device=device)
        w = torch.zeros(128, 512, dtype=torch.float8_e4m3fn, device=device)
        sa = torch.ones(4, 16, device=device).t()  # [16, 4], M-major
        sw = torch.ones(1, 4, device=device)
        torch._scaled_mm(a, w.t(), sa, sw.t(), out_dtype=torch.bfloat16)
    except (RuntimeError, TypeError, ValueError) as err:
        return (f"torch {torch.__version__} (CUDA {torch.version.cuda}) does not run block-scaled fp8 products "
                f"({str(err).splitlines()[0][:120]}); they need CUDA 12.9 or newer on Hopper")
    return None


def refusal(device: torch.device, H: int, I: int) -> Optional[str]:
    """Why GEMM1 cannot run on cuBLAS here, as a sentence, or None (the call's other conditions
    are the Gluon kernels': gluon_block.refusal)."""
    if H % 512 or (2 * I) % 512:
        # cuBLAS reads the scales' rows 16-byte aligned: with K / 128 not a multiple of 4 (H = 256
        # or 768) its products came out wrong, silently (bench/results/h200-scaled-mm-block-probe-3.json)
        return f"H and 2I must be multiples of 512 (scale rows of a multiple of 4 blocks), got H={H}, I={I}"
    if device.type != "cuda" or torch.cuda.get_device_capability(device)[0] != 9:
        got = device.type if device.type != "cuda" else f"compute capability {torch.cuda.get_device_capability(device)}"
        return f"torch's block-scaled fp8 products run on Hopper (compute capability 9.x), got {got}"
    if torch.cuda.is_current_stream_capturing() or torch.compiler.is_compiling():
        return "it reads the experts' row counts back to the host, which CUDA-graph capture and torch.compile forbid"
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _ACCEPTS:
        _ACCEPTS[index] = _probe(device)
    return _ACCEPTS[index]


def wanted(T: int, k: int, E: int, H: int, I: int, device: torch.device) -> bool:
    """The rule for knob cublas1="auto": at least CUBLAS_ROWS rows an expert, products of at least
    CUBLAS_MIN_FLOP, and nothing refused."""
    rows = T * k / E
    return rows >= CUBLAS_ROWS and 2 * rows * 2 * I * H >= CUBLAS_MIN_FLOP and refusal(device, H, I) is None


def explain(T: int, k: int, E: int, H: int, I: int, device: Optional[torch.device]) -> str:
    """Where knob cublas1="auto" runs a Gluon call's GEMM1 and why, as a phrase (for moekit info);
    device None: no CUDA device here."""
    rows = T * k / E
    flop = 2 * rows * 2 * I * H
    if rows < CUBLAS_ROWS:
        return f"GEMM1 on the Gluon kernel (cuBLAS: {rows:.0f} rows an expert, under {CUBLAS_ROWS})"
    if flop < CUBLAS_MIN_FLOP:
        return (f"GEMM1 on the Gluon kernel (cuBLAS: products of {flop / 1e9:.1f} GFLOP, under "
                f"{CUBLAS_MIN_FLOP / 1e9:.0f}: the launches would set the pace)")
    why = "no CUDA device here" if device is None else refusal(device, H, I)
    if why is not None:
        return f"GEMM1 on the Gluon kernel here (cuBLAS: {why}); on cuBLAS eagerly where it runs"
    how = "cuBLASLt called directly" if _engine(device, 2 * I, H, torch.bfloat16) is not None else "torch._scaled_mm"
    return f"GEMM1 on cuBLAS ({how}) eagerly, on the Gluon kernel under CUDA-graph capture"


_STREAMS: Dict[int, Tuple[torch.cuda.Stream, ...]] = {}


def _streams(device: torch.device) -> Tuple[torch.cuda.Stream, ...]:
    """STREAMS side streams of device (made once), which take the experts' products in turn."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _STREAMS:
        _STREAMS[index] = tuple(torch.cuda.Stream(device=index) for _ in range(STREAMS))
    return _STREAMS[index]


@triton.jit
def segment_scales_kernel(s_ptr, out_ptr, expert_end_ptr, counts_ptr, G, stride_s, P, BR: tl.constexpr,
                          BG: tl.constexpr):
    """Expert e = program_id(0): the scales [m, G] of the first m = count rounded up to 4 rows of
    its segment (rows [start, end) of the alignment), in pieces of P rows (a product each), each
    piece stored M-major at out + (start + p0) * G: entry (i, g) of the piece of rows [p0, p0 +
    pr) at g * pr + i - p0, as cuBLAS wants a 1 x 128 operand's scales."""
    e = tl.program_id(0)
    start = tl.where(e > 0, tl.load(expert_end_ptr + tl.maximum(e - 1, 0)), 0)
    m = (tl.load(counts_ptr + e) + 3) // 4 * 4
    g = tl.arange(0, BG)
    for i0 in range(0, m, BR):
        i = i0 + tl.arange(0, BR)
        p0 = i // P * P
        pr = tl.minimum(P, m - p0)
        ok = (i < m)[:, None] & (g < G)[None, :]
        v = tl.load(s_ptr + (start + i).to(tl.int64)[:, None] * stride_s + g[None, :], mask=ok, other=0.0)
        dst = (start + p0).to(tl.int64)[:, None] * G + g[None, :] * pr[:, None] + (i - p0)[:, None]
        tl.store(out_ptr + dst, v, mask=ok)


@triton.jit
def silu_quant_kernel(h_ptr, q_ptr, s_ptr, sorted_ptr, expert_end_ptr, E, TK, I, stride_h, stride_q, stride_s,
                      ROWS: tl.constexpr, BC: tl.constexpr, G: tl.constexpr, QMAX: tl.constexpr):
    """Rows r0 .. r0 + ROWS - 1 (program_id(0)) and columns [c BC, (c + 1) BC) (program_id(1)) of
    GEMM1's rows h [R, 2I] (gate | up): a = silu(gate) * up in fp32, rounded to q's source dtype
    (h's), then quantized per G columns as quantize_rows does (scale max|a| / QMAX, 1 for a zero
    group). Padding rows (sorted id >= TK) get zeros; rows past the last expert's end are left
    unwritten."""
    r0 = tl.program_id(0) * ROWS
    c = tl.program_id(1)
    end = tl.load(expert_end_ptr + E - 1)
    if r0 < end:
        rr = r0 + tl.arange(0, ROWS)
        row_ok = rr < end
        live = row_ok & (tl.load(sorted_ptr + rr, mask=row_ok, other=TK) < TK)
        cols = c * BC + tl.arange(0, BC // G)[:, None] * G + tl.arange(0, G)[None, :]  # [BC/G, G]
        ok = live[:, None, None] & (cols < I)[None, :, :]
        row = h_ptr + rr.to(tl.int64)[:, None, None] * stride_h
        gate = tl.load(row + cols[None, :, :], mask=ok, other=0.0).to(tl.float32)
        up = tl.load(row + I + cols[None, :, :], mask=ok, other=0.0).to(tl.float32)
        a = (gate / (1.0 + tl.exp(-gate)) * up).to(h_ptr.dtype.element_ty).to(tl.float32)
        q, s = quant_groups(a, QMAX, False)  # [ROWS, BC/G, G], [ROWS, BC/G]
        groups = c * (BC // G) + tl.arange(0, BC // G)
        store_ok = row_ok[:, None, None] & (cols < I)[None, :, :]
        tl.store(s_ptr + rr.to(tl.int64)[:, None] * stride_s + groups[None, :], s,
                 mask=row_ok[:, None] & (groups * G < I)[None, :])
        tl.store(q_ptr + rr.to(tl.int64)[:, None, None] * stride_q + cols[None, :, :], q, mask=store_ok)


def _product(a, b, scale_a, scale_b, out_dtype, out):
    """out = (a scale_a) (b scale_b) on cuBLAS: a [m, K] fp8 with M-major 1 x 128 scales [m, K/128],
    b [K, N] fp8 column-major with 128 x 128 block scales [K/128, N/128]."""
    return torch.ops.aten._scaled_mm.out(a, b, scale_a, scale_b, out_dtype=out_dtype, out=out)


_DIRECT_FAILED: Dict[tuple, str] = {}  # (device index, N, K, out dtype) -> why cuBLASLt failed there


def _engine(dev: torch.device, N1: int, H: int, out_dtype: torch.dtype, *operands: torch.Tensor):
    """cuBLASLt's products called directly (cublaslt.engine), where the device, library and the
    operands' layouts allow and it has not failed before; None sends the products through
    torch._scaled_mm."""
    if (not USE_DIRECT or dev.type != "cuda" or not all(t.is_contiguous() for t in operands)
            or (dev.index, N1, H, out_dtype) in _DIRECT_FAILED):
        return None
    return cublaslt.engine(dev, N1, H, out_dtype, sm_count=SM_COUNT)


def _direct_products(direct, products, a1s, scales, w13, w13_s, h, streams) -> None:
    """The products (expert, first row, rows) through cuBLASLt called directly, by address (a
    launch costs about 15 us of host time this way, 26 through torch; cublaslt.py)."""
    H, G, N1 = a1s.shape[1], a1s.shape[1] // 128, h.shape[1]
    a0, s0, h0 = a1s.data_ptr(), scales.data_ptr(), h.data_ptr()
    w0, ws0 = w13.data_ptr(), w13_s.data_ptr()
    w_step, ws_step, h_row = w13.stride(0), w13_s.stride(0) * 4, N1 * h.element_size()
    handles = [st.cuda_stream for st in streams]
    with torch.cuda.device(a1s.device):
        for c0 in range(0, len(products), CHUNK):  # CHUNK products a stream in turn
            stream = handles[c0 // CHUNK % STREAMS]
            for e, r0, m in products[c0:c0 + CHUNK]:
                direct(m, a0 + r0 * H, s0 + r0 * G * 4, w0 + e * w_step, ws0 + e * ws_step, h0 + r0 * h_row, stream, 0)


def _counts(topk_ids: torch.Tensor, expert_map: Optional[torch.Tensor], E: int) -> torch.Tensor:
    """Assignments of each local expert [E] int32 (on the device; non-local ones dropped)."""
    ids = topk_ids.reshape(-1).long()
    if expert_map is not None:
        ids = expert_map.long()[ids]
    ids = torch.where(ids < 0, E, ids)
    return torch.bincount(ids, minlength=E + 1)[:E].to(torch.int32)


def gemm1(a1s: torch.Tensor, a1s_s: torch.Tensor, w13: torch.Tensor, w13_s: torch.Tensor, topk_ids: torch.Tensor,
          expert_map: Optional[torch.Tensor], sorted_ids: torch.Tensor, expert_end: torch.Tensor,
          out_dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
    """GEMM1 and its activation on cuBLAS, then GEMM2's input (module docstring).

    Args:
        a1s: [R, H] fp8, x's quantized rows in the alignment's order (gather_rows).
        a1s_s: [R, H / 128] fp32, their scales.  w13: [E, 2I, H] fp8.  w13_s: [E, 2I / 128, H / 128].
        topk_ids, expert_map: the call's routing (the experts' row counts).
        sorted_ids: [R] int32, expert_end: [E] int32: the alignment.
        out_dtype: x's dtype (bf16 or fp16): GEMM1's rows and the activation's rounding.
    Returns:
        a2 [R, I] fp8 and a2_s [R, I / 128] fp32, as quantize_rows writes them.
    """
    R, H = a1s.shape
    E, N1, _ = w13.shape
    I, G = N1 // 2, H // 128
    dev = a1s.device
    counts = _counts(topk_ids, expert_map, E)
    scales = torch.empty(R * G, dtype=torch.float32, device=dev)
    P = PIECE_ROWS or R
    segment_scales_kernel[(E,)](a1s_s, scales, expert_end, counts, G, a1s_s.stride(0), P, BR=64,
                                BG=triton.next_power_of_2(G), num_warps=4)
    h = torch.empty(R, N1, dtype=out_dtype, device=dev)
    ends, live = torch.stack((expert_end, counts)).tolist()  # the one host synchronisation
    # Products (expert, first row, rows): an expert's live rows rounded up to 4, in pieces of P rows
    products = [(e, start + p0, min(P, m - p0)) for e, start, m in
                ((e, ends[e - 1] if e else 0, (live[e] + 3) // 4 * 4) for e in range(E)) for p0 in range(0, m, P)]
    on_cuda = dev.type == "cuda"
    if on_cuda:
        main, streams = torch.cuda.current_stream(dev), _streams(dev)
        for st in streams:
            st.wait_stream(main)
    direct = _engine(dev, N1, H, out_dtype, a1s, w13, w13_s)
    if direct is not None:
        try:
            _direct_products(direct, products, a1s, scales, w13, w13_s, h, streams)
        except RuntimeError as err:  # cuBLASLt refused a product: every product again through torch
            _DIRECT_FAILED[(dev.index, N1, H, out_dtype)] = str(err)
            logger.warning("moekit: cuBLASLt called directly failed (%s); the block scheme's GEMM1 products of "
                           "shape N=%d, K=%d go through torch._scaled_mm from now on", err, N1, H)
            direct = None
    if direct is None:
        w_parts, ws_parts = w13.transpose(1, 2).unbind(0), w13_s.transpose(1, 2).unbind(0)
        for c0 in range(0, len(products), CHUNK):  # (a stream switch costs host time)
            with torch.cuda.stream(streams[c0 // CHUNK % STREAMS]) if on_cuda else contextlib.nullcontext():
                for e, r0, m in products[c0:c0 + CHUNK]:  # scales [m, G] M-major
                    _product(a1s[r0:r0 + m], w_parts[e], scales[r0 * G:(r0 + m) * G].view(G, m).t(), ws_parts[e],
                             out_dtype=out_dtype, out=h[r0:r0 + m])
    if on_cuda:
        for st in streams:  # (every tensor here was allocated on main: its later reuse waits for this)
            main.wait_stream(st)
    a2 = torch.empty(R, I, dtype=torch.float8_e4m3fn, device=dev)
    a2_s = torch.empty(R, I // 128, dtype=torch.float32, device=dev)
    rows, bc = 4, 512
    silu_quant_kernel[(triton.cdiv(R, rows), triton.cdiv(I, bc))](
        h, a2, a2_s, sorted_ids, expert_end, E, topk_ids.numel(), I, h.stride(0), a2.stride(0), a2_s.stride(0),
        ROWS=rows, BC=bc, G=128, QMAX=FP8_MAX, num_warps=4)
    return a2, a2_s

"""Activation quantization of the quantized Triton experts on the device: a scheme's kernel
modes and the launchers of triton_quant_rows (alone, or in the alignment's first launch).

Rows are quantized one program per row and chunk of columns (whole rows for per-token
scales); the alignment's first launch can carry them as extra programs (kernels/launch.py's
moe_align otherwise), which spares a launch per call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import triton

from ..quant.schemes import QuantScheme
from . import triton_align as align
from . import triton_quant_rows as qr
from .launch import Alignment, _chunk_buffers, _pow2, alignment_buffers, place_chunks

__all__ = ["QuantModes", "modes_of", "quantize_rows", "quant_rows", "align_and_quantize", "tensor_scale", "GRAN"]

_FP8 = torch.float8_e4m3fn
# quant_rows_kernel's GRAN of each activation granularity (4: static per-expert scales per assignment).
GRAN = {"tensor": 1, "token": 2, "group": 3}


@dataclass(frozen=True)
class QuantModes:
    """The kernels' constexpr modes of one scheme (see triton_moe_quant's docstring).

    kgroup: K columns per scale group along K (0: none).  act_dtype: dtype of quantized
    activations, None for weight-only schemes.
    """

    act_gran: Optional[str]
    act_dtype: Optional[torch.dtype]
    a_kscale: bool
    w_kscale: bool
    w_srows: int
    w_int4: bool
    has_zero: bool
    int_dot: bool
    kgroup: int

    @property
    def qmax(self) -> float:
        return qr.INT8_MAX if self.act_dtype == torch.int8 else qr.FP8_MAX


def modes_of(scheme: QuantScheme) -> QuantModes:
    """The kernel modes of a scheme (group size and zero points included)."""
    act_dtype = None
    if scheme.activation_dtype is not None:
        act_dtype = _FP8 if scheme.activation_dtype == "fp8_e4m3" else torch.int8
    gran = scheme.weight_granularity
    kgroup = 0
    if gran == "block":
        kgroup = scheme.weight_block[1]
    elif gran == "group":
        kgroup = scheme.group_size
    if scheme.activation_granularity == "group":
        kgroup = scheme.activation_group if kgroup == 0 else min(kgroup, scheme.activation_group)
    return QuantModes(
        act_gran=scheme.activation_granularity, act_dtype=act_dtype,
        a_kscale=scheme.activation_granularity == "group", w_kscale=gran in ("block", "group"),
        w_srows=scheme.weight_block[0] if gran == "block" else 1, w_int4=scheme.weight_dtype == "int4",
        has_zero=not scheme.symmetric, int_dot=act_dtype == torch.int8, kgroup=kgroup)


def _chunks(gran: int, K: int, group: int) -> Tuple[int, int]:
    """(columns per program, programs per row) of the row quantization (gran 2: whole rows)."""
    if gran == 2:
        return min(4096, _pow2(K)), 1
    # gran 4 (a program per token): whole rows up to 4096 columns, so each token's slot ids and
    # scales are read once.
    block = group * max(1, 1024 // group) if gran in (3, 5) else min(4096 if gran == 4 else 1024, _pow2(K))
    return block, triton.cdiv(K, block)


def _quant_args(x, q, s, modes: QuantModes, gran: int, group: int, topk_weights, topk_ids, expert_map, src=None):
    """(pointer and size arguments, constexpr arguments, programs per row) of one row quantization
    (src: GRAN 4's [T*k] int32 row each slot reads)."""
    block, n_chunks = _chunks(gran, x.shape[1], group)
    w = topk_weights if topk_weights is not None else s
    ids = topk_ids if topk_ids is not None else s
    args = (x, q, s, w, src if src is not None else s, ids, expert_map if expert_map is not None else ids)
    sizes = (x.shape[1], topk_ids.shape[1] if topk_ids is not None else 1, x.stride(0), q.stride(0),
             s.stride(0) if gran in (2, 3, 5) else 0)
    meta = dict(BC=block, G=max(group, 1), GRAN=gran, QMAX=modes.qmax, INT8=modes.act_dtype == torch.int8,
                ON_INPUT=topk_weights is not None, HAS_MAP=expert_map is not None)
    return args, sizes, meta, n_chunks


def quantize_rows(x: torch.Tensor, scheme: QuantScheme, modes: Optional[QuantModes] = None,
                  scale: Optional[torch.Tensor] = None, topk_weights: Optional[torch.Tensor] = None,
                  expert_end: Optional[torch.Tensor] = None, pdl: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """Dynamic quantization of rows x [n, K] on the device, per the scheme's activation granularity.

    Args:
        x: [n, K] bf16/fp16/fp32, contiguous.
        scale: [1] fp32, the one per-tensor scale ("tensor" granularity: computed by the caller).
        topk_weights: [n, 1] fp32 multiplying row r first (router weight on the input), or None.
        expert_end: [E] int32 of an alignment: rows at or past its last entry are left unwritten.
        pdl: launch as a programmatic dependent of the kernel before (SM90+).
    Returns:
        q [n, K] (float8_e4m3fn or int8) and scales fp32: scale as given ("tensor"), [n, 1]
        ("token") or [n, K / activation_group] ("group").
    """
    modes = modes or modes_of(scheme)
    n, K = x.shape
    q = torch.empty((n, K), dtype=modes.act_dtype, device=x.device)
    gran = GRAN[modes.act_gran]
    if gran == 1:
        s = scale
    else:
        s = torch.empty((n, 1 if gran == 2 else K // scheme.activation_group), dtype=torch.float32, device=x.device)
    if n:
        quant_rows(x, q, s, modes, gran, scheme.activation_group if gran == 3 else 0,
                   topk_weights=topk_weights, expert_end=expert_end, pdl=pdl)
    return q, s


def quant_rows(x, q, s, modes: QuantModes, gran: int, group: int, topk_weights=None, expert_end=None,
               topk_ids=None, expert_map=None, pdl: bool = False, src=None) -> None:
    """Launch quant_rows_kernel over the rows of x (triton_quant_rows' docstring: gran; 4 needs src)."""
    (xx, qq, ss, w, sr, ids, emap), sizes, meta, n_chunks = _quant_args(x, q, s, modes, gran, group, topk_weights,
                                                                        topk_ids, expert_map, src)
    end = expert_end if expert_end is not None else s
    rows = _rows_per_program(gran, meta["BC"])
    qr.quant_rows_kernel[(triton.cdiv(x.shape[0], rows), n_chunks)](
        xx, qq, ss, w, sr, end, ids, emap, x.shape[0], sizes[0], end.shape[0] if expert_end is not None else 1,
        *sizes[1:], SORTED=expert_end is not None, **meta, PDL=pdl, ROWS=rows, launch_pdl=pdl, num_warps=4)


def _rows_per_program(gran: int, block: int) -> int:
    """Rows one row-quantization program takes: about 4096 values (a program per short row left
    the GPU waiting on thousands of tiny programs); gran 4 (a token's slots) one."""
    return 1 if gran == 4 else max(1, 4096 // block)


def align_and_quantize(topk_ids, expert_map, num_experts: int, block_m: int, x, q, s, modes: QuantModes, gran: int,
                       group: int, topk_weights, small_max: int, pdl: bool = False, src=None) -> Alignment:
    """kernels.launch.moe_align with the quantization of x (gran 2-4; 4 needs src; 5 copies x in the
    paired order and sums its groups: triton_quant_rows) in the alignment's first launch (pdl:
    its last launch lets a programmatic dependent start)."""
    TK, E, dev = topk_ids.numel(), num_experts, topk_ids.device
    al, e_pad = alignment_buffers(topk_ids, E, block_m)
    emap = expert_map if expert_map is not None else topk_ids
    small = TK <= small_max
    n = _pow2(TK) if small else align.chunk_size(TK)
    # The one-launch path writes no histograms or keys: any int32 buffer stands in for them.
    hist, keys = (al.expert_end, al.expert_end) if small else _chunk_buffers(TK, n, e_pad, dev)
    n_align = E if small else hist.shape[0]
    (xx, qq, ss, w, sr, _, _), sizes, meta, n_chunks = _quant_args(x, q, s, modes, gran, group, topk_weights,
                                                                   topk_ids, expert_map, src)
    qr.align_quant_kernel[(n_align + x.shape[0] * n_chunks,)](
        topk_ids, emap, al.sorted_ids, al.expert_end, hist, keys, xx, qq, ss, w, sr, TK, E, *sizes, n_align,
        n_chunks, BM=block_m, N=n, E_PAD=align.expert_bins(E) if small else e_pad, SMALL=small, **meta,
        PDL=pdl and small, num_warps=align.expert_warps(n) if small else 4)
    if not small:
        place_chunks(al, hist, keys, TK, E, n, e_pad)
    return al


def tensor_scale(x: torch.Tensor, modes: QuantModes, topk_weights, topk_ids, expert_map, sorted_ids,
                  expert_end, on_input: bool) -> torch.Tensor:
    """The one dynamic scale [1] fp32 over the rows of x [n, K] that reach a local expert."""
    n, K = x.shape
    amax = torch.empty(n, dtype=torch.float32, device=x.device)
    sorted_rows = sorted_ids is not None
    ids = topk_ids
    bk = min(1024, _pow2(K))
    rows = _rows_per_program(1, bk)
    qr.row_amax_kernel[(triton.cdiv(n, rows),)](
        x, amax, topk_weights, ids, expert_map if expert_map is not None else ids,
        sorted_ids if sorted_rows else ids, expert_end, n, K, topk_ids.numel(), topk_ids.shape[1], expert_end.shape[0],
        x.stride(0), BK=bk, ON_INPUT=on_input and not sorted_rows, HAS_MAP=expert_map is not None,
        SORTED=sorted_rows, ROWS=rows, num_warps=4)
    s = amax.max().reshape(1) / modes.qmax
    return torch.where(s > 0, s, torch.ones_like(s))

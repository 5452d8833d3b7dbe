"""Launchers of the Triton experts kernels: checks, buffers, strides and grids.

Every size here is known from tensor shapes, never read from the device, so a call can be
captured in a CUDA graph. Pipeline (sorted path): align -> GEMM1 -> GEMM2 -> sum over k
(4 launches; 5 above triton_align.SMALL assignments); direct path (few tokens): GEMM1 ->
GEMM2 (2 launches). The output is written in fp32 or, to spare the caller a cast, x's dtype.
A config with prefill knobs (MoEConfig.prefill) runs the sorted path's GEMMs on
kernels/triton_prefill.py instead (rows padded to its row granule).
Decode knobs (TileConfig): GEMV runs the direct path's GEMMs on kernels/triton_decode.py;
SPLIT_K splits GEMM2's reduction over programs (fp32 partials and tile counters allocated
here per call, the counters cleared by GEMM1); PDL launches GEMM2 as GEMM1's dependent.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Tuple

import torch
import triton

from ..activations import check_activation, is_gated
from . import triton_align as align
from . import triton_decode as dec
from . import triton_moe as moe
from .triton_moe import pow2 as _pow2
from . import triton_prefill as prefill
from .tuning import MoEConfig, TileConfig, default_config, device_name, get_config, use_direct

__all__ = ["Alignment", "alignment_buffers", "moe_align", "place_chunks", "fused_moe", "config_tokens",
           "ALIGN_SMALL_MAX"]

# Up to this many assignments one launch aligns them (a program per expert); above, two.
ALIGN_SMALL_MAX = align.SMALL
# Tiles of the fused direct path's partial sum: RB rows x BN columns per load.
_FUSED_SUM_RB, _FUSED_SUM_BN = 16, 64


@dataclass(frozen=True)
class Alignment:
    """Rows of the sorted path (see triton_align): sorted_ids [max_blocks * BM] and
    expert_end [E] (cumulative padded rows), int32 on the device; max_blocks is a host bound."""

    sorted_ids: torch.Tensor
    expert_end: torch.Tensor
    max_blocks: int
    block_m: int


def alignment_buffers(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> Tuple[Alignment, int]:
    """An Alignment of unwritten buffers for the assignments of topk_ids [T, k] into block_m-row
    blocks of num_experts experts, and the bins its kernels count in (E + 1, one spare for
    non-local lanes, rounded up to a power of two)."""
    TK = topk_ids.numel()
    max_blocks = max(1, min(TK, triton.cdiv(TK, block_m) + num_experts))
    dev = topk_ids.device
    al = Alignment(torch.empty(max_blocks * block_m, dtype=torch.int32, device=dev),
                   torch.empty(num_experts, dtype=torch.int32, device=dev), max_blocks, block_m)
    return al, triton.next_power_of_2(num_experts + 1)


def moe_align(topk_ids: torch.Tensor, expert_map: Optional[torch.Tensor], num_experts: int, block_m: int,
              small_max: int = ALIGN_SMALL_MAX, chunk: Optional[int] = None) -> Alignment:
    """Sort the assignments of topk_ids [T, k] int32 by local expert, padded to block_m rows.

    Args:
        topk_ids: [T, k] int32, contiguous (global ids when expert_map is given).
        expert_map: [E_global] int32 global -> local id or -1, or None.
        num_experts: E local experts.  block_m: rows per GEMM block (a power of two >= 16).
        small_max: largest T*k aligned in one launch (each of its programs reads every assignment).
        chunk: assignments per chunk above small_max (a power of two >= 16; default
            triton_align.chunk_size). The rows are the same for every chunk size.
    """
    TK, E = topk_ids.numel(), num_experts
    al, e_pad = alignment_buffers(topk_ids, E, block_m)
    emap = expert_map if expert_map is not None else topk_ids
    if TK <= small_max:
        align.align_expert_kernel[(E,)](topk_ids, emap, al.sorted_ids, al.expert_end, TK, E,
                                        BM=block_m, N=_pow2(TK), E_BINS=align.expert_bins(E),
                                        HAS_MAP=expert_map is not None, num_warps=align.expert_warps(_pow2(TK)))
        return al
    n = _align_chunk(TK, chunk)
    hist, keys = _chunk_buffers(TK, n, e_pad, topk_ids.device)
    align.align_chunk_kernel[(hist.shape[0],)](topk_ids, emap, hist, keys, TK, N=n, E_PAD=e_pad,
                                                HAS_MAP=expert_map is not None, num_warps=4)
    place_chunks(al, hist, keys, TK, E, n, e_pad)
    return al


def _align_chunk(TK: int, chunk: Optional[int]) -> int:
    if chunk is None:
        return align.chunk_size(TK)
    if chunk < 16 or chunk & (chunk - 1):
        raise ValueError(f"chunk must be a power of two >= 16, got {chunk}")
    return chunk


def _chunk_buffers(TK: int, n: int, e_pad: int, device) -> Tuple[torch.Tensor, torch.Tensor]:
    """hist [chunks, e_pad] and keys [chunks * n] int32 of the chunked alignment (written whole)."""
    nc = triton.cdiv(TK, n)
    return (torch.empty(nc, e_pad, dtype=torch.int32, device=device),
            torch.empty(nc * n, dtype=torch.int32, device=device))


def place_chunks(al: Alignment, hist: torch.Tensor, keys: torch.Tensor, TK: int, E: int, n: int, e_pad: int) -> None:
    """The chunked alignment's second launch: every chunk's rows, expert_end and the sentinels."""
    nc = hist.shape[0]
    align.align_place_kernel[(nc,)](hist, keys, al.sorted_ids, al.expert_end, TK, E, nc, BM=al.block_m, N=n,
                                    E_PAD=e_pad, CB=min(_pow2(nc), max(1, 4096 // e_pad)), num_warps=4)


def config_tokens(T: int, E: int, expert_map: Optional[torch.Tensor]) -> int:
    """The tokens a call's tiles are looked up by: T, or with an expert map (E of its
    expert_map.numel() experts local) the tokens whose assignments these E experts get under
    uniform routing, T * E / E_global (at least 1). Tables and rules are keyed by rows an
    expert as if every assignment were local; a rank of 8 in expert parallelism gets an eighth."""
    if expert_map is None:
        return T
    return max(1, T * E // expert_map.numel())


def _tma_readable(*weights: torch.Tensor) -> bool:
    """Whether TMA can read these weights' rows: 16-byte aligned starts and row lengths."""
    return all(w.data_ptr() % 16 == 0 and (w.shape[-1] * w.element_size()) % 16 == 0 for w in weights)


def _check(name: str, t: Optional[torch.Tensor], device: torch.device, dtype=None) -> None:
    if t is None:
        return
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (a copy per call would double the bytes read), got strides {t.stride()}")
    if dtype is not None and t.dtype != dtype:
        raise TypeError(f"{name} must be {dtype}, got {t.dtype}")


def check_routing(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> None:
    """x [T, H], topk_ids [T, k] and topk_weights of its shape."""
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [T, H], got shape {tuple(x.shape)}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"topk_ids must be [T={x.shape[0]}, k], got shape {tuple(topk_ids.shape)}")
    if topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_weights must have the shape of topk_ids {tuple(topk_ids.shape)}, "
                         f"got {tuple(topk_weights.shape)}")


def _check_weights(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, b13: Optional[torch.Tensor],
                   b2: Optional[torch.Tensor], gated: bool) -> None:
    """w2 [E, H, I] with x's H; w13 [E, 2I or I, H]; b13 [E, 2I or I], b2 [E, H]."""
    H = x.shape[1]
    if w2.dim() != 3 or w2.shape[1] != H:
        raise ValueError(f"w2 must be [E, H={H}, I], got shape {tuple(w2.shape)}")
    E, _, I = w2.shape
    rows = 2 * I if gated else I
    for name, t, want in (("w13", w13, (E, rows, H)), ("b13", b13, (E, rows)), ("b2", b2, (E, H))):
        if t is not None and tuple(t.shape) != want:
            raise ValueError(f"{name} must be {list(want)} to match w2 [E, H, I] = {list(w2.shape)}, "
                             f"got {tuple(t.shape)}")


def _launch_kwargs(cfg: TileConfig):
    return dict(BM=cfg.BLOCK_SIZE_M, BN=cfg.BLOCK_SIZE_N, BK=cfg.BLOCK_SIZE_K, GROUP_M=cfg.GROUP_SIZE_M,
                num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def _gemv_kwargs(cfg: TileConfig):
    return dict(BN=cfg.BLOCK_SIZE_N, BK=cfg.BLOCK_SIZE_K, STAGES=cfg.num_stages, num_warps=cfg.num_warps,
                num_stages=cfg.num_stages)


def _check_pdl(device: torch.device) -> None:
    """Programmatic dependent launch needs an SM90+ GPU (not the interpreter)."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device)[0] < 9:
        got = device.type if device.type != "cuda" else f"compute capability {torch.cuda.get_device_capability(device)}"
        raise ValueError(f"config.gemm2.PDL=1 needs a CUDA GPU of compute capability 9.0 or newer, got {got}")


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    b13: Optional[torch.Tensor],
    b2: Optional[torch.Tensor],
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_map: Optional[torch.Tensor],
    activation: str,
    alpha: float = 1.702,
    limit: float = 7.0,
    on_input: bool = False,
    config: Optional[MoEConfig] = None,
    direct: Optional[bool] = None,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Routed experts on the Triton kernels.

    Args:
        x: [T, H] bf16/fp16/fp32.  w13: [E, 2I, H] (gated) or [E, I, H].  w2: [E, H, I].
        b13: [E, 2I] or [E, I] or None.  b2: [E, H] or None.  (all in x's dtype)
        topk_weights: [T, k] fp32.  topk_ids: [T, k] int32.  expert_map: [E_global] int32 or None.
        activation: a name of moekit.activations; alpha, limit: the clamped SwiGLUs' parameters.
        on_input: the routed weight multiplies the expert input (k = 1) instead of its output.
        config: tiles (None: tuned file or heuristic).  direct: force the no-sort path (None: by shape).
        out_dtype: float32 or x's dtype (the sum over k is fp32 either way; x's dtype saves a cast).
    Returns:
        [T, H] in out_dtype.
    """
    check_activation(activation)
    dev = x.device
    for name, t in (("x", x), ("w13", w13), ("w2", w2), ("b13", b13), ("b2", b2)):
        _check(name, t, dev, x.dtype)
    _check("topk_weights", topk_weights, dev, torch.float32)
    _check("topk_ids", topk_ids, dev, torch.int32)
    _check("expert_map", expert_map, dev, torch.int32)
    if out_dtype not in (torch.float32, x.dtype):
        raise TypeError(f"out_dtype must be torch.float32 or x's dtype {x.dtype}, got {out_dtype}")
    check_routing(x, topk_weights, topk_ids)
    gated = is_gated(activation)
    _check_weights(x, w13, w2, b13, b2, gated)
    T, H = x.shape
    E, _, I = w2.shape
    k = topk_ids.shape[1]
    if E > moe.MAX_EXPERTS:
        raise ValueError(f"w2 holds {E} experts; the Triton kernels take at most {moe.MAX_EXPERTS}")
    if T == 0:
        return x.new_zeros((0, H), dtype=out_dtype)
    if direct is None:  # the direct path holds a token's slots in registers: more take the sorted path
        direct = k <= moe.MAX_TOP_K and use_direct(T, k, E)
    if direct and k > moe.MAX_TOP_K:
        raise ValueError(f"the direct path takes top_k <= {moe.MAX_TOP_K}, got {k}")
    if config is None:
        T_cfg = config_tokens(T, E, expert_map)
        config = get_config(T_cfg, E, k, H, I, x.dtype, device_name(dev) if dev.type == "cuda" else None)
        if config.prefill is not None and config.prefill.tma and not _tma_readable(w13, w2):
            config = default_config(T_cfg, E, k, H, I, x.element_size())  # weights TMA cannot read: pointer tiles
    if config.prefill is not None and not direct:
        al = moe_align(topk_ids, expert_map, E, config.row_granule, small_max=ALIGN_SMALL_MAX)
        return prefill.fused_moe_prefill(x, w13, w2, b13, b2, topk_weights, topk_ids, expert_map, al.sorted_ids,
                                         al.expert_end, al.max_blocks * al.block_m, activation, alpha, limit,
                                         on_input, config, out_dtype)
    TK = T * k
    has_map = expert_map is not None
    emap = expert_map if has_map else topk_ids
    flags = dict(HAS_BIAS=b13 is not None, HAS_MAP=has_map, ON_INPUT=on_input, IEEE=x.dtype == torch.float32)
    g1, g2 = config.gemm1, config.gemm2
    if g2.PDL:
        _check_pdl(dev)
    if direct and g1.FUSED:  # its own buffers: none of the two-launch path's below
        return _fused_direct(x, w13, w2, b13, b2, topk_weights, topk_ids, emap, has_map, activation, alpha, limit,
                             on_input, g1, g2, out_dtype)
    if direct:
        # One live row per program: the smallest tile tl.dot takes, no L2 grouping needed.
        g1 = replace(g1, BLOCK_SIZE_M=16, GROUP_SIZE_M=1)
        g2 = replace(g2, BLOCK_SIZE_M=16, GROUP_SIZE_M=1)
        sorted_ids = expert_end = topk_ids  # unused by the direct kernels
        rows1, rows2 = TK, T
        act = torch.empty(TK, I, dtype=x.dtype, device=dev)
        out2 = torch.empty(T, H, dtype=out_dtype, device=dev)
    else:
        al = moe_align(topk_ids, expert_map, E, config.block_m, small_max=ALIGN_SMALL_MAX)
        sorted_ids, expert_end = al.sorted_ids, al.expert_end
        rows1 = rows2 = al.max_blocks
        act = torch.empty(al.max_blocks * al.block_m, I, dtype=x.dtype, device=dev)
        out2 = torch.empty(TK, H, dtype=x.dtype, device=dev)
    bias13 = b13 if b13 is not None else x
    bias2 = b2 if b2 is not None else x
    # GEMM2's split reduction: an fp32 partial per split and GEMM2 row, one counter per output
    # tile (cleared by GEMM1, which runs first, so nothing persists between calls).
    split, tiles2 = g2.SPLIT_K, rows2 * triton.cdiv(H, g2.BLOCK_SIZE_N)
    if split > 1:
        counters = torch.empty(tiles2, dtype=torch.int32, device=dev)
        partials = torch.empty(split, rows2 if direct else rows2 * g2.BLOCK_SIZE_M, H, dtype=torch.float32, device=dev)
    else:
        counters, partials = topk_ids, x  # unused
    stride_b13 = bias13.stride(0) if b13 is not None else 0
    n_cnt = tiles2 if split > 1 else 0
    chain = dict(PDL=bool(g2.PDL))
    if direct and g1.GEMV:
        dec.gemv1_kernel[(TK * triton.cdiv(I, g1.BLOCK_SIZE_N),)](
            x, w13, bias13, act, topk_weights, topk_ids, emap, counters, I, H, k, n_cnt,
            x.stride(0), w13.stride(0), w13.stride(1), stride_b13, act.stride(0), float(alpha), float(limit),
            GATED=gated, ACT=activation, HAS_BIAS=b13 is not None, HAS_MAP=has_map, ON_INPUT=on_input,
            **chain, **_gemv_kwargs(g1))
    else:
        moe.gemm1_kernel[(rows1 * triton.cdiv(I, g1.BLOCK_SIZE_N),)](
            x, w13, bias13, act, topk_weights, topk_ids, emap, sorted_ids, expert_end, counters,
            I, H, TK, k, rows1, E, n_cnt,
            x.stride(0), w13.stride(0), w13.stride(1), stride_b13, act.stride(0),
            float(alpha), float(limit),
            DIRECT=direct, GATED=gated, ACT=activation, OUT_POLICY=moe.store_policy(act), **flags, **chain,
            **_launch_kwargs(g1))
    flags.pop("HAS_BIAS")
    stride_b2 = bias2.stride(0) if b2 is not None else 0
    stride_ps = partials.stride(0) if split > 1 else 0
    chain = dict(SPLIT=split > 1, PDL=bool(g2.PDL))
    pdl = {"launch_pdl": True} if g2.PDL else {}
    if direct and g2.GEMV:
        dec.gemv2_kernel[(tiles2, split)](
            act, w2, bias2, out2, partials, counters, topk_weights, topk_ids, emap, H, I, k, split,
            act.stride(0), w2.stride(0), w2.stride(1), stride_b2, out2.stride(0), stride_ps,
            HAS_BIAS=b2 is not None, HAS_MAP=has_map, ON_INPUT=on_input, PRE=g2.PRE, **chain, **_gemv_kwargs(g2),
            **pdl)
    else:
        moe.gemm2_kernel[(tiles2, split)](
            act, w2, bias2, out2, partials, counters, topk_weights, topk_ids, emap, sorted_ids, expert_end,
            H, I, TK, k, rows2, E, split,
            act.stride(0), w2.stride(0), w2.stride(1), stride_b2, out2.stride(0), stride_ps,
            DIRECT=direct, HAS_BIAS=b2 is not None, PRE=g2.PRE if direct else 0,
            OUT_POLICY="" if direct else moe.store_policy(out2), **flags, **chain, **_launch_kwargs(g2), **pdl)
    if direct:
        return out2
    return moe.sum_over_k(out2, topk_ids, emap, has_map, out_dtype)


def _fused_direct(x, w13, w2, b13, b2, topk_weights, topk_ids, emap, has_map, activation, alpha, limit, on_input,
                  g1: TileConfig, g2: TileConfig, out_dtype):
    """The direct path in one GEMM launch (gemm1.FUSED): fp32 partial rows per (assignment, I block),
    then their fixed-order sum per token."""
    T, H = x.shape
    I = w2.shape[2]
    k = topk_ids.shape[1]
    dev = x.device
    n_c = triton.cdiv(I, g1.BLOCK_SIZE_N)
    part = torch.empty(T * k * n_c, H, dtype=torch.float32, device=dev)
    bias13 = b13 if b13 is not None else x
    bias2 = b2 if b2 is not None else x
    pdl = bool(g2.PDL)
    dec.fused_gemv_kernel[(T * k * n_c,)](
        x, w13, bias13, w2, bias2, part, topk_weights, topk_ids, emap, H, I, k,
        x.stride(0), w13.stride(0), w13.stride(1), bias13.stride(0) if b13 is not None else 0,
        w2.stride(0), w2.stride(1), bias2.stride(0) if b2 is not None else 0, part.stride(0),
        float(alpha), float(limit),
        BC=g1.BLOCK_SIZE_N, BK=g1.BLOCK_SIZE_K, BH=g2.BLOCK_SIZE_N, STAGES1=g1.num_stages, STAGES2=g2.num_stages,
        GATED=is_gated(activation), ACT=activation, HAS_B13=b13 is not None, HAS_B2=b2 is not None,
        HAS_MAP=has_map, ON_INPUT=on_input, PDL=pdl, OUT_POLICY=moe.store_policy(part), num_warps=g1.num_warps,
        num_stages=g1.num_stages)
    out = torch.empty(T, H, dtype=out_dtype, device=dev)
    bn = min(_FUSED_SUM_BN, _pow2(H))
    dec.partial_sum_kernel[(T, triton.cdiv(H, bn))](
        part, out, k * n_c, H, part.stride(0), out.stride(0), RB=_FUSED_SUM_RB, BN=bn, STAGES=3, PDL=pdl,
        num_warps=4, **({"launch_pdl": True} if pdl else {}))
    return out

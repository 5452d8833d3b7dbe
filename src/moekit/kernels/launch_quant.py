"""Launchers of the quantized Triton experts: checks, activation quantization, tiles, grids.

Pipeline (every size known from shapes, no host synchronisation, CUDA-graph safe):
    align (triton_align) -> [quantize x] -> GEMM1 -> [quantize act] -> GEMM2 -> sum over k
The bracketed steps quantize activations: dynamic per token and per 1x128 group one
kernel each; dynamic per tensor a row-amax kernel, a max over rows (torch, on the device)
and the quantizing kernel. Static per-expert fp8 scales ("a13_scale", "a2_scale"): x is
quantized once per assignment (a token's k experts have k scales), GEMM1 writes its output
as fp8 with the expert's a2_scale, and GEMM2 needs no extra launch.

Tiles: the unquantized table (tuned JSON or heuristic, kernels/tuning.py), fitted by
quant_config.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Tuple

import torch
import triton

from ..activations import check_activation, is_gated
from ..quant.schemes import QuantScheme
from . import triton_moe as moe
from . import triton_moe_quant as qk
from .launch import _check, _launch_kwargs, _pow2, moe_align
from .tuning import MoEConfig, TileConfig, device_name, get_config

__all__ = ["QuantModes", "modes_of", "quant_config", "quantize_rows", "fused_moe_quant", "quant_unsupported",
           "MAX_INT8_K"]

# int32 accumulation of K products of two values in [-127, 127] stays exact below this K.
MAX_INT8_K = (2**31 - 1) // (127 * 127)

_FP8 = torch.float8_e4m3fn


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
        return qk.INT8_MAX if self.act_dtype == torch.int8 else qk.FP8_MAX


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


def quant_unsupported(scheme: QuantScheme, dtype: torch.dtype, capability: Optional[Tuple[int, int]],
                      hidden_size: int, intermediate_size: int) -> Optional[str]:
    """Why the quantized Triton path cannot run this scheme, as a sentence, or None.

    Args:
        capability: the CUDA device's (major, minor), or None on CPU (the interpreter).
    """
    if dtype not in (torch.bfloat16, torch.float16):
        return f"quantized weights take bfloat16 or float16 activations, got {dtype}"
    if capability is not None:
        need = (8, 9) if scheme.weight_dtype == "fp8_e4m3" else (8, 0)
        if capability < need:
            what = "fp8" if scheme.weight_dtype == "fp8_e4m3" else scheme.weight_dtype
            return (f"quant={scheme.name!r} ({what}) needs compute capability {need[0]}.{need[1]} or newer, "
                    f"got {capability[0]}.{capability[1]}")
    if scheme.activation_dtype == "int8" and max(hidden_size, intermediate_size) > MAX_INT8_K:
        return (f"int8 x int8 products stay exact in int32 up to K={MAX_INT8_K}, "
                f"got H={hidden_size}, I={intermediate_size}")
    return None


def quant_config(config: MoEConfig, modes: QuantModes) -> MoEConfig:
    """Tiles of the quantized kernels from unquantized ones.

    - BLOCK_SIZE_K within one scale group along K; at least 32 for 8-bit products (the
      smallest K of an 8-bit tensor-core instruction, and of an int4 tile's two halves);
    - 8-bit products on compute tiles (BLOCK_SIZE_M >= 64) take K tiles of 128: the same
      bytes per stage as the 16-bit tiles of 64 they replace;
    - weight-only tiles hold at most 64 x 64 converted weights per accumulator and thread
      group of 4 warps (the conversion happens in registers; wider tiles spill);
    - per-K-group scales keep GEMM1 (two accumulators and a partial product) at BLOCK_SIZE_N
      <= 64 on compute tiles, for the same reason.
    """
    def fit(t: TileConfig, gemm1: bool) -> TileConfig:
        bk, bn = t.BLOCK_SIZE_K, t.BLOCK_SIZE_N
        if modes.act_dtype is not None and t.BLOCK_SIZE_M >= 64:
            bk = 128
        if modes.kgroup:
            bk = min(bk, modes.kgroup)
        if modes.act_dtype is not None or modes.w_int4:
            bk = max(bk, 32)
        if modes.act_dtype is None:
            while bn > 16 and bn * bk > 64 * 64 * t.num_warps // 4:
                bn //= 2
        elif gemm1 and (modes.a_kscale or modes.w_kscale) and t.BLOCK_SIZE_M >= 64:
            bn = min(bn, 64)
        return replace(t, BLOCK_SIZE_K=bk, BLOCK_SIZE_N=bn)

    return MoEConfig(fit(config.gemm1, True), fit(config.gemm2, False))


def _row_block(K: int, kgroup: int = 0) -> int:
    return kgroup if kgroup else min(1024, _pow2(K))


def quantize_rows(x: torch.Tensor, scheme: QuantScheme, modes: Optional[QuantModes] = None,
                  scale: Optional[torch.Tensor] = None, topk_weights: Optional[torch.Tensor] = None,
                  expert_end: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Dynamic quantization of rows x [n, K] on the device, per the scheme's activation granularity.

    Args:
        x: [n, K] bf16/fp16/fp32, contiguous.
        scale: [1] fp32, the one per-tensor scale ("tensor" granularity: computed by the caller).
        topk_weights: [n, 1] fp32 multiplying row r first (router weight on the input), or None.
        expert_end: [E] int32 of an alignment: rows at or past its last entry are left unwritten.
    Returns:
        q [n, K] (float8_e4m3fn or int8) and scales fp32: scale as given ("tensor"), [n, 1]
        ("token") or [n, K / activation_group] ("group").
    """
    modes = modes or modes_of(scheme)
    n, K = x.shape
    q = torch.empty((n, K), dtype=modes.act_dtype, device=x.device)
    gran = {"tensor": 1, "token": 2, "group": 3}[modes.act_gran]
    if gran == 1:
        s = scale
    else:
        s = torch.empty((n, 1 if gran == 2 else K // scheme.activation_group), dtype=torch.float32, device=x.device)
    if n:
        _quant_rows(x, q, s, modes, gran, scheme.activation_group if gran == 3 else 0,
                    topk_weights=topk_weights, expert_end=expert_end)
    return q, s


def _quant_rows(x, q, s, modes: QuantModes, gran: int, group: int, topk_weights=None, expert_end=None,
                topk_ids=None, expert_map=None) -> None:
    """Launch quant_rows_kernel over the rows of q (see its docstring for gran)."""
    end = expert_end if expert_end is not None else s
    w = topk_weights if topk_weights is not None else s
    ids = topk_ids if topk_ids is not None else end
    qk.quant_rows_kernel[(q.shape[0],)](
        x, q, s, w, end, ids, expert_map if expert_map is not None else ids, x.shape[1],
        end.shape[0] if expert_end is not None else 1, topk_ids.shape[1] if topk_ids is not None else 1,
        x.stride(0), q.stride(0), s.stride(0) if gran in (2, 3) else 0,
        BK=_row_block(x.shape[1], group), GRAN=gran, QMAX=modes.qmax, INT8=modes.act_dtype == torch.int8,
        ON_INPUT=topk_weights is not None, SORTED=expert_end is not None, HAS_MAP=expert_map is not None,
        num_warps=4)


def _tensor_scale(x: torch.Tensor, modes: QuantModes, topk_weights, topk_ids, expert_map, sorted_ids,
                  expert_end, on_input: bool) -> torch.Tensor:
    """The one dynamic scale [1] fp32 over the rows of x [n, K] that reach a local expert."""
    n, K = x.shape
    amax = torch.empty(n, dtype=torch.float32, device=x.device)
    sorted_rows = sorted_ids is not None
    ids = topk_ids
    qk.row_amax_kernel[(n,)](
        x, amax, topk_weights, ids, expert_map if expert_map is not None else ids,
        sorted_ids if sorted_rows else ids, expert_end, K, topk_ids.numel(), topk_ids.shape[1], expert_end.shape[0],
        x.stride(0), BK=_row_block(K), ON_INPUT=on_input and not sorted_rows, HAS_MAP=expert_map is not None,
        SORTED=sorted_rows, num_warps=4)
    s = amax.max().reshape(1) / modes.qmax
    return torch.where(s > 0, s, torch.ones_like(s))


def _weight_args(q: torch.Tensor, scale: torch.Tensor, zero: Optional[torch.Tensor]):
    """(weights, scales, zero points or the scales as a stand-in, stride_se, stride_sn)."""
    if scale.dim() == 1:  # one per expert
        stride_se, stride_sn = scale.stride(0), 0
    else:
        stride_se, stride_sn = scale.stride(0), scale.stride(1)
    return q, scale, zero if zero is not None else scale, stride_se, stride_sn


def fused_moe_quant(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    b13: Optional[torch.Tensor],
    b2: Optional[torch.Tensor],
    w13_scale: torch.Tensor,
    w2_scale: torch.Tensor,
    w13_zero: Optional[torch.Tensor],
    w2_zero: Optional[torch.Tensor],
    a13_scale: Optional[torch.Tensor],
    a2_scale: Optional[torch.Tensor],
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_map: Optional[torch.Tensor],
    scheme: QuantScheme,
    activation: str,
    alpha: float = 1.702,
    limit: float = 7.0,
    on_input: bool = False,
    config: Optional[MoEConfig] = None,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Routed experts over quantized weights (layout: moekit.quant.schemes) on the Triton kernels.

    Args:
        x: [T, H] bf16/fp16.  w13: [E, 2I or I, H / pack], w2: [E, H, I / pack] stored weights.
        b13: [E, 2I or I], b2: [E, H] float biases or None.
        w13_scale, w2_scale: fp32 weight scales; w13_zero, w2_zero: uint8 zero points or None.
        a13_scale, a2_scale: [E] fp32 static activation scales (per-tensor fp8) or None (dynamic).
        topk_weights: [T, k] fp32.  topk_ids: [T, k] int32.  expert_map: [E_global] int32 or None.
        scheme: the full QuantScheme (moekit.quant.layout.scheme_of).
        activation, alpha, limit, on_input: as kernels.launch.fused_moe.
        config: unquantized tiles to start from (None: tuned file or heuristic).
        out_dtype: float32 or x's dtype.
    Returns:
        [T, H] in out_dtype.
    """
    check_activation(activation)
    dev = x.device
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"x must be bfloat16 or float16 for quantized weights, got {x.dtype}")
    for name, t in (("x", x), ("w13", w13), ("w2", w2), ("b13", b13), ("b2", b2), ("w13_scale", w13_scale),
                    ("w2_scale", w2_scale), ("w13_zero", w13_zero), ("w2_zero", w2_zero),
                    ("a13_scale", a13_scale), ("a2_scale", a2_scale)):
        _check(name, t, dev)
    _check("topk_weights", topk_weights, dev, torch.float32)
    _check("topk_ids", topk_ids, dev, torch.int32)
    _check("expert_map", expert_map, dev, torch.int32)
    if out_dtype not in (torch.float32, x.dtype):
        raise TypeError(f"out_dtype must be torch.float32 or x's dtype {x.dtype}, got {out_dtype}")
    if (a13_scale is None) != (a2_scale is None) or (a13_scale is not None and scheme.activation_granularity != "tensor"):
        raise ValueError("a13_scale and a2_scale (static scales) go together and only with per-tensor activations")
    modes = modes_of(scheme)
    T, H = x.shape
    E = w2.shape[0]
    I = w2.shape[2] * scheme.pack
    k = topk_ids.shape[1]
    if E > moe.MAX_EXPERTS:
        raise ValueError(f"w2 holds {E} experts; the Triton kernels take at most {moe.MAX_EXPERTS}")
    if on_input and k != 1:
        raise ValueError(f"on_input needs top_k == 1, got {k}")
    if T == 0:
        return x.new_zeros((0, H), dtype=out_dtype)
    if config is None:
        config = get_config(T, E, k, H, I, x.dtype, device_name(dev) if dev.type == "cuda" else None)
    config = quant_config(config, modes)
    g1, g2 = config.gemm1, config.gemm2
    TK = T * k
    al = moe_align(topk_ids, expert_map, E, config.block_m)
    R = al.max_blocks * al.block_m
    static = a13_scale is not None
    # Step 1: GEMM1 input.
    if modes.act_dtype is None:
        a1, a1_s, a1_mode, a1_sm, a1_se = x, x, 0, 0, 0
    elif static:  # one row per assignment, quantized with its expert's scale
        a1, a1_s, a1_mode, a1_sm, a1_se = torch.empty(TK, H, dtype=_FP8, device=dev), a13_scale, 1, 0, 1
        _quant_rows(x, a1, a13_scale, modes, 4, 0, topk_weights=topk_weights if on_input else None,
                    topk_ids=topk_ids, expert_map=expert_map)
    else:
        scale = None
        w_in = topk_weights if on_input else None
        if modes.act_gran == "tensor":
            scale = _tensor_scale(x, modes, topk_weights, topk_ids, expert_map, None, al.expert_end, on_input)
        a1, a1_s = quantize_rows(x, scheme, modes, scale=scale, topk_weights=w_in)
        a1_mode, a1_sm, a1_se = 1, (0 if modes.act_gran == "tensor" else a1_s.stride(0)), 0
    # Step 2: GEMM1 (+ bias, activation) into the activation rows.
    act = torch.empty(R, I, dtype=_FP8 if static else x.dtype, device=dev)
    q13, s13, z13, s13_e, s13_n = _weight_args(w13, w13_scale, w13_zero)
    bias13 = b13 if b13 is not None else x
    flags = dict(A_KSCALE=modes.a_kscale, W_KSCALE=modes.w_kscale, W_SROWS=modes.w_srows, W_INT4=modes.w_int4,
                 HAS_ZERO=modes.has_zero, INT_DOT=modes.int_dot, KGROUP=max(modes.kgroup, 1))
    qk.gemm1_quant_kernel[(al.max_blocks * triton.cdiv(I, g1.BLOCK_SIZE_N),)](
        a1, a1_s, q13, s13, z13, bias13, act, a2_scale if static else s13,
        topk_weights, al.sorted_ids, al.expert_end,
        I, H, TK, k, al.max_blocks, E,
        a1.stride(0), a1_sm, a1_se, q13.stride(0), q13.stride(1), s13_e, s13_n,
        bias13.stride(0) if b13 is not None else 0, act.stride(0),
        float(alpha), float(limit),
        GATED=is_gated(activation), ACT=activation, HAS_BIAS=b13 is not None, ON_INPUT=on_input,
        A_QUANT=a1_mode, A_BY_ASSIGN=static, OUT_STATIC=static, **flags, **_launch_kwargs(g1))
    # Step 3: GEMM2 input.
    if modes.act_dtype is None:
        a2, a2_s, a2_mode, a2_sm, a2_se = act, act, 0, 0, 0
    elif static:
        a2, a2_s, a2_mode, a2_sm, a2_se = act, a2_scale, 1, 0, 1
    else:
        scale = None
        if modes.act_gran == "tensor":
            scale = _tensor_scale(act, modes, topk_weights, topk_ids, expert_map, al.sorted_ids, al.expert_end,
                                  False)
        a2, a2_s = quantize_rows(act, scheme, modes, scale=scale, expert_end=al.expert_end)
        a2_mode, a2_sm, a2_se = 1, (0 if modes.act_gran == "tensor" else a2_s.stride(0)), 0
    # Step 4: GEMM2 (+ bias, routed weight) into per-assignment rows, then the sum over k.
    y = torch.empty(TK, H, dtype=x.dtype, device=dev)
    q2, s2, z2, s2_e, s2_n = _weight_args(w2, w2_scale, w2_zero)
    bias2 = b2 if b2 is not None else x
    qk.gemm2_quant_kernel[(al.max_blocks * triton.cdiv(H, g2.BLOCK_SIZE_N),)](
        a2, a2_s, q2, s2, z2, bias2, y, topk_weights, al.sorted_ids, al.expert_end,
        H, I, TK, al.max_blocks, E,
        a2.stride(0), a2_sm, a2_se, q2.stride(0), q2.stride(1), s2_e, s2_n,
        bias2.stride(0) if b2 is not None else 0, y.stride(0),
        HAS_BIAS=b2 is not None, ON_INPUT=on_input, A_QUANT=a2_mode, **flags, **_launch_kwargs(g2))
    out = torch.empty(T, H, dtype=out_dtype, device=dev)
    bn = min(1024, _pow2(H))
    bt = max(1, 4096 // bn)
    has_map = expert_map is not None
    moe.sum_k_kernel[(triton.cdiv(T, bt), triton.cdiv(H, bn))](
        y, out, topk_ids, expert_map if has_map else topk_ids, T, H, k, y.stride(0), out.stride(0),
        BT=bt, BN=bn, HAS_MAP=has_map, num_warps=4)
    return out

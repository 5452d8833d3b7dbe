"""Launchers of the quantized Triton experts: checks, activation quantization, tiles, grids.

Pipeline (every size known from shapes, no host synchronisation, CUDA-graph safe):
    align (+ quantize x) -> GEMM1 -> [quantize act] -> GEMM2 -> sum over k (and K splits)
x is quantized in the alignment's launch (knob fuse_x_quant; a launch of its own
otherwise) for dynamic per-token and per-group scales and for static per-expert scales
(once per assignment: a token's k experts have k scales); dynamic per-tensor scales take a
row-amax kernel, a max over rows (torch, on the device) and the quantizing kernel. GEMM1's
output is quantized by one more launch (dynamic scales) or by GEMM1 itself (static
"a2_scale"). GEMM2 may split K over programs (knob split_k): its fp32 partials are added
with the k slots, in a fixed order, by the sum kernel.

Tiles and knobs (kernels/quant_tuning.py): the tuned quantized table of the nearest M, else
the unquantized table (tuned JSON or heuristic, kernels/tuning.py) fitted by quant_config.
fp8 weights and activations with static per-tensor scales run on triton_prefill's kernels
instead (TMA tiles, persistent grid, tail tiles, gate and up in one product, GEMM2 warp-
specialized; the scales applied after the K loop, GEMM2's fp8 input stored by GEMM1) when the
config carries prefill knobs, or the tuned entry's knobs carry static_prefill; an explicit
prefill config that a call cannot take is refused with the reason. 128 x 128 fp8 blocks on
Hopper run kernels/gluon_block.py's GEMMs (the promotion of each K block overlapped with the
next product) when the knobs carry gluon: tuned entries, or gluon_block.default_rows untuned;
their GEMM1 runs on cuBLAS at prefill sizes outside graph capture (knob cublas1,
kernels/cublas_block.py).
"""

from __future__ import annotations

from dataclasses import replace
from typing import List, Optional, Tuple

import torch
import triton

from ..activations import check_activation, is_gated
from ..quant.schemes import QuantScheme
from . import cublas_block, gluon_block, hopper_block, launch
from . import triton_moe as moe
from . import triton_moe_quant as qk
from . import triton_prefill as prefill
from . import triton_quant_rows as qr
from .launch import _check, _pow2, config_tokens, moe_align
from .quant_rows import GRAN, QuantModes, align_and_quantize, modes_of, quant_rows, quantize_rows, tensor_scale
from .quant_tuning import (W_CONVERT, QuantKnobs, load_quant_configs, quant_file_dtype, swap_fits, untuned_w8a8,
                           untuned_weight_only)
from .tuning import FP8_MIN_TILE_ROWS, MoEConfig, TileConfig, config_file_name, device_name, nearest_m, on_hopper, pick_config

__all__ = ["quant_config", "check_tiles", "check_knobs", "fit_knobs", "quant_tiles", "pick_quant_tiles", "fused_moe_quant",
           "quant_unsupported", "MAX_INT8_K"]

# int32 accumulation of K products of two values in [-127, 127] stays exact below this K.
MAX_INT8_K = (2**31 - 1) // (127 * 127)

_FP8 = torch.float8_e4m3fn
# Programs that fill a 132-SM H200 twice: the sum over k takes narrower column blocks below this.
_FILL_PROGRAMS = 264
_TILE_KEYS = ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "GROUP_SIZE_M", "num_warps", "num_stages")


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
    """Tiles of the quantized kernels from unquantized ones (when no tuned quantized entry exists).

    - BLOCK_SIZE_K within one scale group along K; at least 32 for 8-bit products (the
      smallest K of an 8-bit tensor-core instruction, and of an int4 tile's two halves);
    - 8-bit products on compute tiles (BLOCK_SIZE_M >= 64) take K tiles of 128: the same
      bytes per stage as the 16-bit tiles of 64 they replace;
    - weight-only tiles hold at most 64 x 64 converted weights per accumulator and thread
      group of 4 warps (the conversion happens in registers; wider tiles spill);
    - 8-bit GEMM1 compute tiles (two accumulators, and with per-K-group scales a partial
      product) keep BLOCK_SIZE_N <= 64: 128 x 128 spills registers with K tiles of 128;
    - 8-bit GEMM2 tiles hold at most 128 accumulator registers a thread (BLOCK_SIZE_M *
      BLOCK_SIZE_N <= 4096 * num_warps): 128 x 256 on 4 warps took all 255 registers and 2.4x
      the instructions of the same tile on 8 warps (sm_90a), and ran its calls at 0.65x the
      bf16 kernel (gpt-oss M = 4096, bench/results/h200-quant-default-ab-1.json).
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
        elif gemm1 and t.BLOCK_SIZE_M >= 64:
            bn = min(bn, 64)
        else:
            while t.BLOCK_SIZE_M * bn > 4096 * t.num_warps:
                bn //= 2
        # Only the tiles carry over: the unquantized kernels' other knobs are not these kernels'.
        return TileConfig(t.BLOCK_SIZE_M, bn, bk, t.GROUP_SIZE_M, t.num_warps, t.num_stages)

    return MoEConfig(fit(config.gemm1, True), fit(config.gemm2, False))


def prefill_modes(modes: QuantModes) -> bool:
    """Whether a scheme's modes can run on the prefill kernels (fp8 products, scales constant along K)."""
    return modes.act_dtype == _FP8 and modes.act_gran == "tensor" and not (modes.w_kscale or modes.a_kscale)


def prefill_refusal(modes: QuantModes, static: bool, on_input: bool, w13_scale: torch.Tensor,
                    w2_scale: torch.Tensor) -> Optional[str]:
    """Why a call cannot run on the fp8 prefill kernels (triton_prefill, SCALED), or None."""
    if not prefill_modes(modes):
        return "they take fp8 weights and activations with scales constant along K"
    if not static:
        return "they take static activation scales (a13_scale, a2_scale): GEMM1 quantizes GEMM2's input"
    if w13_scale.dim() != 1 or w2_scale.dim() != 1:
        return "they take one weight scale per expert"
    if on_input:
        return "they apply the routed weight on the output (on_input=False)"
    return None


def check_tiles(config: MoEConfig, modes: QuantModes) -> None:
    """Raise ValueError when tiles cannot run a scheme: a K tile lies within one scale group
    along K and is >= 32 for 8-bit products and int4 halves; the unquantized kernels' decode
    knobs do not apply here, their prefill knobs only to fp8 with per-tensor activations, on
    tiles of at least FP8_MIN_TILE_ROWS rows."""
    if config.prefill is not None:
        if not prefill_modes(modes):
            raise ValueError("config.prefill runs the unquantized kernels, or fp8 weights with per-tensor "
                             f"activations; got it with another scheme: {config.prefill}")
        if config.row_granule < FP8_MIN_TILE_ROWS:
            raise ValueError(f"fp8 prefill tiles need BLOCK_SIZE_M / prefill tail >= {FP8_MIN_TILE_ROWS}, "
                             f"got {config.block_m} / {config.prefill.tail}")
    for name, t in (("gemm1", config.gemm1), ("gemm2", config.gemm2)):
        other = sorted(set(t.to_json()) - set(_TILE_KEYS))
        if other:
            raise ValueError(f"config.{name} sets {other}, knobs of the unquantized kernels only "
                             f"(the quantized kernels take QuantKnobs)")
        bk = t.BLOCK_SIZE_K
        if modes.kgroup and (bk > modes.kgroup or modes.kgroup % bk):
            raise ValueError(f"config.{name}.BLOCK_SIZE_K must divide the scale group of {modes.kgroup} columns, "
                             f"got {bk}")
        if (modes.act_dtype is not None or modes.w_int4) and bk < 32:
            raise ValueError(f"config.{name}.BLOCK_SIZE_K must be >= 32 for 8-bit or int4 products, got {bk}")


def _knob_problems(config: MoEConfig, knobs: QuantKnobs, scheme: QuantScheme, modes: QuantModes, gate_up: bool,
                   H: int, I: int) -> List[Tuple[str, str]]:
    """(QuantKnobs field, why the call cannot take it) for every knob set that these tiles and
    this scheme cannot run (see check_knobs)."""
    out = []
    if knobs.w_convert not in ("auto", "cast") and not modes.w_int4:  # the int4-only conversions
        out.append(("w_convert", f"knobs.w_convert={knobs.w_convert!r} applies to int4 weights, "
                                 f"got quant={scheme.name!r}"))
    elif _pairs(modes, knobs) and (knobs.fold_w or knobs.prefetch1 or knobs.prefetch2):
        other = "fold_w" if knobs.fold_w else "prefetch1" if knobs.prefetch1 else "prefetch2"
        out.append((other, f"knobs.{other} does not combine with knobs.w_convert={knobs.w_convert!r} (paired "
                           f"products load and correct whole weight groups themselves)"))
    if knobs.fold_w and modes.act_dtype is not None:
        out.append(("fold_w", f"knobs.fold_w dequantizes the weights of weight-only schemes, got quant={scheme.name!r}"))
    g1, g2 = config.gemm1, config.gemm2
    for flag, t, gemm, pair in ((knobs.swap1, g1, "gemm1", gate_up), (knobs.swap2, g2, "gemm2", False)):
        if not flag:
            continue
        if modes.act_dtype != _FP8 or modes.a_kscale or modes.w_kscale:
            out.append((f"swap{gemm[-1]}", f"knobs.swap{gemm[-1]} multiplies fp8 activations with scales constant "
                                           f"along K, got quant={scheme.name!r}"))
        elif not swap_fits(t, pair):
            rows = "2 * BLOCK_SIZE_N (gate and up in one product)" if pair else "BLOCK_SIZE_N"
            out.append((f"swap{gemm[-1]}", f"knobs.swap{gemm[-1]} needs config.{gemm}'s {rows} a multiple of 64 "
                                           f"and >= 16 * num_warps, got BLOCK_SIZE_N={t.BLOCK_SIZE_N} with "
                                           f"{t.num_warps} warps"))
    for flag, K, t, gemm in ((knobs.prefetch1, H, g1, "gemm1"), (knobs.prefetch2, I, g2, "gemm2")):
        if flag and K % t.BLOCK_SIZE_K:
            out.append((f"prefetch{gemm[-1]}", f"knobs.prefetch{gemm[-1]} needs K={K} to be a multiple of "
                                               f"config.{gemm}.BLOCK_SIZE_K, got {t.BLOCK_SIZE_K}"))
    return out


def _pairs(modes: QuantModes, knobs: QuantKnobs) -> bool:
    """Whether the call runs paired int4 products (triton_moe_quant._mainloop_pairs)."""
    return modes.w_int4 and modes.act_dtype is None and knobs.w_convert in ("pairs", "pairs_bits")


def check_knobs(config: MoEConfig, knobs: QuantKnobs, scheme: QuantScheme, modes: QuantModes, gate_up: bool,
                H: int, I: int) -> None:
    """Raise ValueError when knobs cannot run a scheme on these tiles: the int4 conversions need
    int4 weights; swapped products fp8 activations with scales constant along K and a multiple of
    64 weight rows (gate_up: GEMM1's product takes gate and up rows together); prefetching a
    K that is a multiple of the K tile.

    Args:
        gate_up: GEMM1 multiplies gate and up rows in one product (knobs.gate_up, gated activation).
        H, I: hidden and intermediate sizes (GEMM1's and GEMM2's K).
    """
    problems = _knob_problems(config, knobs, scheme, modes, gate_up, H, I)
    if problems:
        raise ValueError(problems[0][1])


def fit_knobs(config: MoEConfig, knobs: QuantKnobs, scheme: QuantScheme, modes: QuantModes, gate_up: bool,
              H: int, I: int) -> QuantKnobs:
    """A tuned entry's knobs with those this call cannot take back at their defaults: one table
    serves calls it was not tuned on (every fp8 scheme of its block shape, every group size of a
    weight-only dtype, any activation), e.g. swap1 on 32-column gate_up tiles for an activation
    without gate and up rows. Explicit knobs are checked instead (check_knobs)."""
    default = QuantKnobs()
    off = {f: getattr(default, f) for f, _ in _knob_problems(config, knobs, scheme, modes, gate_up, H, I)}
    return replace(knobs, **off) if off else knobs


def quant_tiles(T: int, E: int, k: int, H: int, I: int, dtype: torch.dtype, device: Optional[str],
                scheme: QuantScheme, modes: QuantModes) -> Tuple[MoEConfig, QuantKnobs]:
    """Tiles and knobs of a call: the tuned quantized entry of the nearest M (its K tiles cut to
    the scheme's scale groups: a weight-only table is named by the dtype alone, whatever the
    group size), else on Hopper the untuned rules (8-bit activations with scales constant along
    K: quant_tuning.untuned_w8a8; weight-only: quant_tuning.untuned_weight_only, K tiles cut to
    the groups too), else the unquantized config fitted by quant_config with default knobs (and the
    Gluon kernels for 128 x 128 fp8 blocks where they pay: gluon_block.default_rows; calls they
    cannot run keep the tiles).

    Args:
        T: tokens.  E: local experts.  k: slots per token.  H, I: hidden and intermediate sizes.
        dtype: of the activations.  device: device_name() or None (no tuned files).
    """
    return pick_quant_tiles(T, E, k, H, I, dtype, device, scheme, modes)[:2]


def pick_quant_tiles(T: int, E: int, k: int, H: int, I: int, dtype: torch.dtype, device: Optional[str],
                     scheme: QuantScheme, modes: QuantModes) -> Tuple[MoEConfig, QuantKnobs, str]:
    """quant_tiles' tiles and knobs and where they came from, as words."""
    file_dtype, block = quant_file_dtype(scheme)
    table = load_quant_configs(E, I, device, file_dtype, block) if device is not None else None
    if table:
        m = nearest_m(table, T)
        cfg, knobs = table[m]
        cfg = _within_groups(cfg, modes)  # one table serves every group size of its dtype
        check_tiles(cfg, modes)
        return cfg, knobs, f"table {config_file_name(E, I, device, file_dtype, block)}, entry M = {m}"
    if on_hopper(device) and modes.act_dtype is not None and not (modes.kgroup or modes.a_kscale or modes.w_kscale):
        untuned = untuned_w8a8(T, E, k, prefill_modes(modes))
        if untuned is not None:
            return (*untuned, "untuned_w8a8")
    if on_hopper(device) and modes.act_dtype is None:
        untuned = untuned_weight_only(T, E, k, modes.w_int4)
        if untuned is not None:
            return _within_groups(untuned[0], modes), untuned[1], "untuned_weight_only"
    config, source = pick_config(T, E, k, H, I, dtype, device, untuned_prefill=False)
    knobs = QuantKnobs(gluon=gluon_block.default_rows(T, E, k, H, I, scheme, device))
    return quant_config(config, modes), knobs, f"quant_config of {source}" + (
        f", Gluon kernels of {knobs.gluon}-row tiles (gluon_block.default_rows)" if knobs.gluon else "")


def _within_groups(cfg: MoEConfig, modes: QuantModes) -> MoEConfig:
    """cfg with K tiles no wider than the scheme's scale groups (K tiles never straddle two)."""
    if not modes.kgroup:
        return cfg
    return replace(cfg, gemm1=replace(cfg.gemm1, BLOCK_SIZE_K=min(cfg.gemm1.BLOCK_SIZE_K, modes.kgroup)),
                   gemm2=replace(cfg.gemm2, BLOCK_SIZE_K=min(cfg.gemm2.BLOCK_SIZE_K, modes.kgroup)))


def _tile_kwargs(t: TileConfig):
    return dict(BM=t.BLOCK_SIZE_M, BN=t.BLOCK_SIZE_N, BK=t.BLOCK_SIZE_K, GROUP_M=t.GROUP_SIZE_M,
                num_warps=t.num_warps, num_stages=t.num_stages)


def _weight_args(q: torch.Tensor, scale: torch.Tensor, zero: Optional[torch.Tensor]):
    """(weights, scales, zero points or the scales as a stand-in, stride_se, stride_sn)."""
    if scale.dim() == 1:  # one per expert
        stride_se, stride_sn = scale.stride(0), 0
    else:
        stride_se, stride_sn = scale.stride(0), scale.stride(1)
    return q, scale, zero if zero is not None else scale, stride_se, stride_sn


def _convert(modes: QuantModes, knobs: QuantKnobs, dtype: torch.dtype) -> dict:
    """The weight conversion's constexprs: the int4 CONVERT code, bit pattern and its value, and
    FOLD_W (weight-only weights dequantized with their scales before the product)."""
    code = W_CONVERT[knobs.w_convert] if modes.w_int4 else 0
    magic, value = (qk.MAGIC_BF16 if dtype == torch.bfloat16 else qk.MAGIC_FP16) if code else (0, 0.0)
    return dict(CONVERT=code, MAGIC=magic, MAGIC_V=value, FOLD_W=knobs.fold_w)  # check_knobs: weight-only only


def _k_splits(K: int, bk: int, split_k: int) -> Tuple[int, int]:
    """(splits, K columns per split) of GEMM2: every split gets at least one K tile."""
    tiles = triton.cdiv(K, bk)
    per = triton.cdiv(tiles, split_k)
    return triton.cdiv(tiles, per), per * bk


def _sum_block(T: int, H: int) -> int:
    bn = min(1024, _pow2(H, 128))
    while bn > 128 and T * triton.cdiv(H, bn) < _FILL_PROGRAMS:
        bn //= 2
    return bn


def _sum_stages(T: int) -> Optional[int]:
    """Slot loads the sum over slots keeps in flight: three from 256 tokens (Qwen3 fp8 M = 256:
    5.7 -> 4.7 us, M = 16384: 147 -> 143 us), none below (M = 16: 2.4 us, 4.5 with three)."""
    return 3 if T >= 256 else None


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
    knobs: Optional[QuantKnobs] = None,
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
        config: the quantized kernels' tiles as they run (None: the tuned quantized entry, else
            the unquantized config fitted by quant_config).
        knobs: kernel variants (None: the tuned entry's, else the defaults).
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
    if knobs is not None and not isinstance(knobs, QuantKnobs):
        raise TypeError(f"knobs must be a QuantKnobs or None, got {type(knobs).__name__}")
    launch.check_routing(x, topk_weights, topk_ids)
    modes = modes_of(scheme)
    T, H = x.shape
    E = w2.shape[0]
    I = w2.shape[2] * scheme.pack
    k = topk_ids.shape[1]
    if E > moe.MAX_EXPERTS:
        raise ValueError(f"w2 holds {E} experts; the Triton kernels take at most {moe.MAX_EXPERTS}")
    if on_input and k != 1:
        raise ValueError(f"on_input needs top_k == 1, got {k}")
    if a13_scale is not None and k > moe.MAX_TOP_K:
        raise ValueError(f"static activation scales take top_k <= {moe.MAX_TOP_K} (a token's slots are held "
                         f"in registers), got {k}")
    if T == 0:
        return x.new_zeros((0, H), dtype=out_dtype)
    explicit = config is not None
    tuned_knobs = knobs is None and not explicit
    if config is None:
        config, tuned = quant_tiles(config_tokens(T, E, expert_map), E, k, H, I, x.dtype,
                                    device_name(dev) if dev.type == "cuda" else None,
                                    scheme, modes)
        knobs = knobs if knobs is not None else tuned
    else:
        check_tiles(config, modes)
    knobs = knobs if knobs is not None else QuantKnobs()
    static = a13_scale is not None
    if config.prefill is not None:
        why = prefill_refusal(modes, static, on_input, w13_scale, w2_scale)
        if why:
            raise ValueError(f"config.prefill cannot run this call on the fp8 prefill kernels: {why}")
    elif knobs.static_prefill is not None and not explicit and dev.type == "cuda" and \
            prefill_refusal(modes, static, on_input, w13_scale, w2_scale) is None:
        config = knobs.static_prefill  # the tuned entry's tiles on the prefill kernels
    if knobs.pdl and (dev.type != "cuda" or torch.cuda.get_device_capability(dev)[0] < 9):
        got = dev.type if dev.type != "cuda" else f"compute capability {torch.cuda.get_device_capability(dev)}"
        raise ValueError(f"knobs.pdl needs a CUDA GPU of compute capability 9.0 or newer, got {got}")
    gated = is_gated(activation)
    gate_up = knobs.gate_up and gated
    if tuned_knobs:
        knobs = fit_knobs(config, knobs, scheme, modes, gate_up, H, I)
    check_knobs(config, knobs, scheme, modes, gate_up, H, I)
    if knobs.w_convert in ("ptx", "pairs") and dev.type != "cuda":
        twin = "bits" if knobs.w_convert == "ptx" else "pairs_bits"
        raise ValueError(f"knobs.w_convert={knobs.w_convert!r} runs inline PTX: it needs a CUDA GPU, got {dev.type} "
                         f"(the Triton interpreter cannot run it; {twin!r} computes the same values)")
    pairs = _pairs(modes, knobs)
    gluon_rows = knobs.gluon
    if gluon_rows:
        why = gluon_block.refusal(scheme, x.dtype, dev, activation, b13 is not None or b2 is not None, on_input,
                                  a13_scale is not None, H, I, gluon_rows)
        if why and not tuned_knobs:
            raise ValueError(f"knobs.gluon={gluon_rows} cannot run this call on the Gluon kernels: {why}")
        gluon_rows = 0 if why else gluon_rows
    g1, g2 = config.gemm1, config.gemm2
    granule = gluon_rows or config.row_granule
    TK = T * k
    small_max = launch.ALIGN_SMALL_MAX
    w_in = topk_weights if on_input else None
    # Step 1: alignment and GEMM1's input (x quantized in the alignment's launch when it can be).
    if pairs:  # x copied in the paired order with its groups' sums, in the alignment's launch
        a1 = torch.empty(T, H, dtype=x.dtype, device=dev)
        a1_s = torch.empty(T, H // modes.kgroup, dtype=torch.float32, device=dev)
        al = align_and_quantize(topk_ids, expert_map, E, granule, x, a1, a1_s, modes, 5, modes.kgroup, None, small_max,
                                pdl=knobs.pdl)
        a1_mode, a1_sm, a1_se = 0, a1_s.stride(0), 0
    elif modes.act_dtype is None:
        al = moe_align(topk_ids, expert_map, E, granule, small_max=small_max)
        a1, a1_s, a1_mode, a1_sm, a1_se = x, x, 0, 0, 0
    else:
        gran = 4 if static else GRAN[modes.act_gran]
        group = scheme.activation_group if gran == 3 else 0
        a1 = torch.empty(TK if static else T, H, dtype=modes.act_dtype, device=dev)
        # Static scales: the row each assignment reads (x quantized once per token when its
        # experts share a scale; see triton_quant_rows, GRAN 4).
        src = torch.empty(TK, dtype=torch.int32, device=dev) if static else None
        if gran in (2, 3):
            a1_s = torch.empty(T, 1 if gran == 2 else H // group, dtype=torch.float32, device=dev)
        else:
            a1_s = a13_scale  # gran 1: replaced by the dynamic scale below
        if knobs.fuse_x_quant and gran != 1:
            al = align_and_quantize(topk_ids, expert_map, E, granule, x, a1, a1_s, modes, gran, group, w_in,
                                    small_max, pdl=knobs.pdl, src=src)
        else:
            al = moe_align(topk_ids, expert_map, E, granule, small_max=small_max)
            if gran == 1:
                a1_s = tensor_scale(x, modes, topk_weights, topk_ids, expert_map, None, al.expert_end, on_input)
            quant_rows(x, a1, a1_s, modes, gran, group, topk_weights=w_in, topk_ids=topk_ids if static else None,
                       expert_map=expert_map if static else None, src=src)
        a1_mode, a1_sm, a1_se = 1, (a1_s.stride(0) if gran in (2, 3) else 0), (1 if static else 0)
    R = al.max_blocks * al.block_m
    if config.prefill is not None:  # fp8, static per-tensor scales: triton_prefill's kernels
        scales = tuple(t if t.dtype == torch.float32 and t.is_contiguous() else t.float().contiguous()
                       for t in (a13_scale, w13_scale, a2_scale, w2_scale))  # [E] each
        return prefill.fused_moe_prefill(a1, w13, w2, b13, b2, topk_weights, topk_ids, expert_map, al.sorted_ids,
                                         al.expert_end, R, activation, alpha, limit, False, config, out_dtype,
                                         scales=scales, src=src, y_dtype=x.dtype)
    chain = dict(PDL=knobs.pdl, launch_pdl=knobs.pdl)  # a programmatic dependent of the kernel before
    if gluon_rows:  # 128 x 128 fp8 blocks on Hopper: the Gluon GEMMs, GEMM1 on cuBLAS at prefill sizes
        a1s, a1s_s = gluon_block.gather_rows(a1, a1_s, al.sorted_ids, al.expert_end, k, R)
        # both GEMMs on moekit's CUDA kernels where they run (unless cublas1 "on" asks for cuBLAS),
        # else GEMM1 on cuBLAS where its rule wants it (eager prefill), else the Gluon kernels
        # (QuantKnobs.cuda, .cublas1)
        cuda = _cuda_block(knobs.cuda, dev, x.dtype, E, H, I, gluon_rows, knobs.cublas1)
        if cuda and (knobs.cuda in ("on", "gemm1") or knobs.cublas1 != "on"):
            act = torch.empty(R, I, dtype=x.dtype, device=dev)
            hopper_block.gemm1(a1s, a1s_s, w13, w13_scale, act, al.expert_end)
            a2, a2_s = quantize_rows(act, scheme, modes, expert_end=al.expert_end)
            y = torch.empty(1, TK, H, dtype=x.dtype, device=dev)
            if knobs.cuda == "gemm1":
                gluon_block.gemm2(a2, a2_s, w2, w2_scale, y[0], topk_weights, al.sorted_ids, al.expert_end, gluon_rows)
            else:
                hopper_block.gemm2(a2, a2_s, w2, w2_scale, y[0], topk_weights, al.sorted_ids, al.expert_end)
            return _sum_over_k(y, topk_ids, expert_map, T, H, k, out_dtype, chain)
        if _cublas_gemm1(knobs.cublas1, T, k, E, H, I, dev):
            a2, a2_s = cublas_block.gemm1(a1s, a1s_s, w13, w13_scale, topk_ids, expert_map, al.sorted_ids,
                                          al.expert_end, x.dtype)
        else:
            act = torch.empty(R, I, dtype=x.dtype, device=dev)
            gluon_block.gemm1(a1s, a1s_s, w13, w13_scale, act, al.expert_end, gluon_rows)
            a2, a2_s = quantize_rows(act, scheme, modes, expert_end=al.expert_end)
        y = torch.empty(1, TK, H, dtype=x.dtype, device=dev)
        gluon_block.gemm2(a2, a2_s, w2, w2_scale, y[0], topk_weights, al.sorted_ids, al.expert_end, gluon_rows)
        return _sum_over_k(y, topk_ids, expert_map, T, H, k, out_dtype, chain)
    flags = dict(A_KSCALE=modes.a_kscale, W_KSCALE=modes.w_kscale, W_SROWS=modes.w_srows, W_INT4=modes.w_int4,
                 HAS_ZERO=modes.has_zero, INT_DOT=modes.int_dot, KGROUP=max(modes.kgroup, 1),
                 **_convert(modes, knobs, x.dtype))
    # Step 2: GEMM1 (+ bias, activation) into the activation rows.
    act = torch.empty(R, I, dtype=_FP8 if static else x.dtype, device=dev)
    q13, s13, z13, s13_e, s13_n = _weight_args(w13, w13_scale, w13_zero)
    bias13 = b13 if b13 is not None else x
    sum_g = min(g1.BLOCK_SIZE_N, modes.kgroup) if pairs else 1  # columns an entry of the rows' sums for GEMM2
    act_s = torch.empty(R, I // sum_g, dtype=torch.float32, device=dev) if pairs else None
    qk.gemm1_quant_kernel[(al.max_blocks * triton.cdiv(I, g1.BLOCK_SIZE_N),)](
        a1, a1_s, q13, s13, z13, bias13, act, act_s if pairs else a2_scale if static else s13,
        topk_weights, al.sorted_ids, al.expert_end, src if static else al.sorted_ids,
        I, H, TK, k, al.max_blocks, E,
        a1.stride(0), a1_sm, a1_se, q13.stride(0), q13.stride(1), s13_e, s13_n,
        bias13.stride(0) if b13 is not None else 0, act.stride(0), act_s.stride(0) if pairs else 0,
        float(alpha), float(limit),
        GATED=gated, ACT=activation, HAS_BIAS=b13 is not None, ON_INPUT=on_input,
        A_QUANT=a1_mode, A_BY_ASSIGN=static, OUT_STATIC=static, EVEN_K=H % g1.BLOCK_SIZE_K == 0,
        PREFETCH=knobs.prefetch1, GATE_UP=gate_up, SWAP=knobs.swap1,
        OUT_POLICY=moe.store_policy(act), **chain, **flags,
        **_tile_kwargs(g1))
    # Step 3: GEMM2 input.
    if pairs:
        a2, a2_s, a2_mode, a2_sm, a2_se = act, act_s, 0, act_s.stride(0), 0
    elif modes.act_dtype is None:
        a2, a2_s, a2_mode, a2_sm, a2_se = act, act, 0, 0, 0
    elif static:
        a2, a2_s, a2_mode, a2_sm, a2_se = act, a2_scale, 1, 0, 1
    else:
        scale = None
        if modes.act_gran == "tensor":
            scale = tensor_scale(act, modes, topk_weights, topk_ids, expert_map, al.sorted_ids, al.expert_end,
                                 False)
        a2, a2_s = quantize_rows(act, scheme, modes, scale=scale, expert_end=al.expert_end, pdl=knobs.pdl)
        a2_mode, a2_sm, a2_se = 1, (0 if modes.act_gran == "tensor" else a2_s.stride(0)), 0
    # Step 4: GEMM2 (+ bias, routed weight) into per-assignment rows (fp32 partials per K split),
    # then the sum over k and the splits.
    splits, k_split = _k_splits(I, modes.kgroup if pairs else g2.BLOCK_SIZE_K, knobs.split_k)  # pairs: whole groups
    y = torch.empty(splits, TK, H, dtype=x.dtype if splits == 1 else torch.float32, device=dev)
    q2, s2, z2, s2_e, s2_n = _weight_args(w2, w2_scale, w2_zero)
    bias2 = b2 if b2 is not None else x
    qk.gemm2_quant_kernel[(al.max_blocks * triton.cdiv(H, g2.BLOCK_SIZE_N), splits)](
        a2, a2_s, q2, s2, z2, bias2, y, topk_weights, al.sorted_ids, al.expert_end,
        H, I, TK, al.max_blocks, E, k_split,
        a2.stride(0), a2_sm, a2_se, q2.stride(0), q2.stride(1), s2_e, s2_n,
        bias2.stride(0) if b2 is not None else 0, y.stride(0), y.stride(1),
        HAS_BIAS=b2 is not None, ON_INPUT=on_input, A_QUANT=a2_mode, EVEN_K=I % g2.BLOCK_SIZE_K == 0,
        PREFETCH=knobs.prefetch2, SWAP=knobs.swap2, OUT_POLICY=moe.store_policy(y), SUM_G=sum_g, **chain, **flags,
        **_tile_kwargs(g2))
    return _sum_over_k(y, topk_ids, expert_map, T, H, k, out_dtype, chain)


def _cuda_block(mode: str, device: torch.device, x_dtype: torch.dtype, E: int, H: int, I: int, rows: int,
                cublas1: str = "auto") -> bool:
    """Whether a Gluon call's GEMMs may run moekit's CUDA kernels instead (QuantKnobs.cuda; with
    "auto", cublas1 "on" still sends GEMM1 to cuBLAS)."""
    if mode == "off":
        return False
    if mode in ("on", "gemm1") and cublas1 == "on":
        raise ValueError(f"knobs.cuda={mode!r} and knobs.cublas1='on' both ask for GEMM1: set one of them to 'auto' "
                         "or 'off'")
    why = hopper_block.refusal(device, x_dtype, E, H, I, rows)
    if why and mode in ("on", "gemm1"):
        raise ValueError(f"knobs.cuda={mode!r} cannot run this call on moekit's CUDA kernels: {why}")
    return why is None


def _cublas_gemm1(mode: str, T: int, k: int, E: int, H: int, I: int, device: torch.device) -> bool:
    """Whether GEMM1 of a Gluon call runs on cuBLAS (QuantKnobs.cublas1)."""
    if mode == "off":
        return False
    if mode == "on":
        why = cublas_block.refusal(device, H, I)
        if why:
            raise ValueError(f"knobs.cublas1='on' cannot run this call's GEMM1 on cuBLAS: {why}")
        return True
    return cublas_block.wanted(T, k, E, H, I, device)


def _sum_over_k(y: torch.Tensor, topk_ids: torch.Tensor, expert_map: Optional[torch.Tensor], T: int, H: int, k: int,
                out_dtype: torch.dtype, chain: dict) -> torch.Tensor:
    """out [T, H]: each token's k slots of y [splits, T * k, H] and its K splits, added in a fixed order."""
    out = torch.empty(T, H, dtype=out_dtype, device=y.device)
    bn = _sum_block(T, H)
    has_map = expert_map is not None
    qr.sum_slots_kernel[(T, triton.cdiv(H, bn))](
        y, out, topk_ids, expert_map if has_map else topk_ids, H, k, y.stride(0), y.stride(1), out.stride(0),
        S=y.shape[0], BN=bn, HAS_MAP=has_map, STAGES=_sum_stages(T), **chain, num_warps=4)
    return out

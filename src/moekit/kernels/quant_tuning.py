"""Tiles and variants of the quantized Triton experts: knobs, tuned JSON files, search space.

File format: kernels/tuning.py's, named by the quantization as the large engines name theirs,
    E={E},N={I},device_name={device},dtype={fp8_w8a8|int8_w8a8|int8_w8a16|int4_w4a16}[,block_shape=[128,128]].json
(one file for every fp8 scheme of a block shape, and per weight-only dtype whatever its group
size). An M entry's tiles are the quantized kernels' own (no fitting), and it may carry
"quant": {the QuantKnobs fields that differ from their defaults}; a call uses the entry of
the nearest M. Lookup: MOEKIT_TUNED_CONFIG_DIR, then the shipped files, then on Hopper the untuned rule for 8-bit activations (untuned_w8a8), then
the unquantized table fitted by quant_config with default knobs.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, fields
from typing import Dict, List, Optional, Tuple

from ..quant.schemes import QuantScheme
from .tuning import (FP8_MIN_TILE_ROWS, MoEConfig, PrefillConfig, TileConfig, config_file_name, nearest_m, parse_table,
                     built, read_table, use_direct)

__all__ = ["QuantKnobs", "W_CONVERT", "swap_fits", "quant_file_dtype", "quant_file_name", "parse_quant_configs", "load_quant_configs",
           "lookup_quant_config", "quant_search_space", "fp8_prefill_space", "untuned_w8a8"]

# The int4 weight conversions, by the kernels' CONVERT code.
W_CONVERT = {"auto": 1, "bits": 1, "cast": 0, "ptx": 2, "pairs": 3, "pairs_bits": 4}
# Shared memory one program may use on SM90 (227 KB) less room for the compiler's own use.
_SMEM_LIMIT = 220 * 1024


CUBLAS1 = ("auto", "on", "off")
CUDA_BLOCK = ("auto", "on", "off", "gemm1")


@dataclass(frozen=True)
class QuantKnobs:
    """Variants of the quantized kernels that a tuned entry picks (the defaults: no tuned entry).

    gate_up: GEMM1 multiplies gate and up rows interleaved in one product of 2 * BLOCK_SIZE_N
        columns (gated activations), instead of two products.
    prefetch1, prefetch2: GEMM1 / GEMM2 load the next K tile before multiplying the current one
        (needs K to be a multiple of BLOCK_SIZE_K).
    split_k: GEMM2 splits its K tiles over up to this many programs per output tile (as many
        as ceil(K tiles / ceil(K tiles / split_k))); the fp32 partials are added with the k
        slots, in a fixed order.
    w_convert: how int4 weights become floats: "bits" (the nibble or-ed into a float's mantissa,
        the offset or zero point subtracted in 16 bits), "ptx" (the same in inline PTX on whole
        registers, four bytes at a time; CUDA only), "cast" (through int8), "auto" (bits);
        "pairs" (paired products, int4 weight-only: x copied in a paired column order with its
        groups' sums in the alignment's launch, eight weights converted by masks and shifts of
        their word, the offset or zero point corrected once per group instead of subtracted per
        weight; inline PTX, CUDA only; not with fold_w or prefetching), "pairs_bits" (the same
        products through bit operations, any device);
        8-bit weights are always cast ("auto" or "cast").
    fuse_x_quant: x is quantized in the alignment's launch (dynamic per-token or per-group
        scales, or static per-expert ones).
    pdl: GEMM1, the quantization of its output, GEMM2 and the sum are launched as programmatic
        dependents of the kernel before (SM90+): each starts while the one before finishes.
    swap1, swap2: GEMM1 / GEMM2 multiply W^T a^T into a [BLOCK_SIZE_N, BLOCK_SIZE_M]
        accumulator (fp8 activations, scales constant along K; the product's weight rows,
        BLOCK_SIZE_N or with gate_up 2 * BLOCK_SIZE_N, a multiple of 64 and >= 16 * num_warps):
        weight rows on the 64-row side of Hopper's fp8 warpgroup products, so few-token tiles
        need no fp8-to-fp16 conversion of the weights.
    static_prefill: a MoEConfig with prefill knobs: calls that can (fp8 weights and activations
        with static per-tensor scales, one weight scale per expert) run triton_prefill's
        kernels with it instead of these tiles; other calls of the same table (dynamic scales,
        per-channel weights) keep the tiles. Its tiles hold at least 64 rows
        (BLOCK_SIZE_M / prefill tail; tuning.FP8_MIN_TILE_ROWS).
    fold_w: weight-only schemes: each K tile's weights are dequantized with their group's scales
        into x's dtype before the product, so the products accumulate in the MMA instead of
        each K tile's product being scaled and added after it finishes (prefill tiles: many
        rows share each dequantized weight; the weights are rounded to x's dtype once).
    gluon: 0, or the row tile (64 or 128) of the Gluon kernels of the 128 x 128 block-scaled fp8
        scheme on Hopper (kernels/gluon_block.py: each K block's promotion overlapped with the
        next product), which then run GEMM1 and GEMM2 instead of these tiles; a tuned entry's
        gluon falls back to the tiles on calls the Gluon kernels cannot run.
    cublas1: with gluon, where GEMM1 runs when moekit's CUDA kernels do not take the call (knob
        cuda): "auto" on cuBLAS (one product an expert; kernels/cublas_block.py) from
        cublas_block.CUBLAS_ROWS rows an expert and products of cublas_block.CUBLAS_MIN_FLOP,
        where torch's cuBLAS runs the recipe and the call is not being captured or compiled,
        else the Gluon GEMM1; "on" on cuBLAS (a call that cannot raises; also over cuda
        "auto"); "off" the Gluon GEMM1.
    cuda: with 128-row gluon tiles, whether both GEMMs run moekit's CUDA kernels instead
        (kernels/hopper_block.py: a producer warpgroup and two consumer warpgroups that take
        turns on the tensor cores): "auto" where they are built and can run the call, unless
        cublas1 is "on" (they measured faster than the cuBLAS GEMM1 eagerly too:
        bench/results/h200-hopper-block-ab-5.json), "on" (a call that cannot raises; not with
        cublas1 "on"), "gemm1" GEMM1 on them and GEMM2 on the Gluon kernel (as "on" otherwise),
        "off" the Gluon / cuBLAS kernels.
    """

    gate_up: bool = False
    prefetch1: bool = False
    prefetch2: bool = False
    split_k: int = 1
    w_convert: str = "auto"
    fuse_x_quant: bool = True
    pdl: bool = False
    swap1: bool = False
    swap2: bool = False
    static_prefill: Optional[MoEConfig] = None
    gluon: int = 0
    fold_w: bool = False
    cublas1: str = "auto"
    cuda: str = "auto"

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "gluon":
                if isinstance(value, bool) or value not in (0, 64, 128):
                    raise ValueError(f"gluon must be 0 (off) or a row tile of 64 or 128, got {value!r}")
            elif f.name in ("cublas1", "cuda"):
                allowed = CUBLAS1 if f.name == "cublas1" else CUDA_BLOCK
                if value not in allowed:
                    raise ValueError(f"{f.name} must be one of {list(allowed)}, got {value!r}")
            elif f.name == "split_k":
                if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                    raise ValueError(f"split_k must be an int >= 1, got {value!r}")
            elif f.name == "w_convert":
                if value not in W_CONVERT:
                    raise ValueError(f"w_convert must be one of {list(W_CONVERT)}, got {value!r}")
            elif f.name == "static_prefill":
                if value is not None and not (isinstance(value, MoEConfig) and value.prefill is not None):
                    raise ValueError(f"static_prefill must be a MoEConfig with prefill knobs or None, got {value!r}")
                if value is not None and value.row_granule < FP8_MIN_TILE_ROWS:
                    raise ValueError(f"static_prefill needs BLOCK_SIZE_M / prefill tail >= {FP8_MIN_TILE_ROWS} "
                                     f"(fp8 tiles), got {value.block_m} / {value.prefill.tail}")
            elif not isinstance(value, bool):
                raise TypeError(f"{f.name} must be a bool, got {type(value).__name__}")

    def to_json(self) -> Dict:
        """The fields that differ from the defaults (static_prefill as its table entry)."""
        default = QuantKnobs()
        out = {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) != getattr(default, f.name)}
        if self.static_prefill is not None:
            out["static_prefill"] = self.static_prefill.to_json()
        return out

    @classmethod
    def from_json(cls, entry, where: str = "quant") -> "QuantKnobs":
        names = [f.name for f in fields(cls)]
        if not isinstance(entry, dict) or set(entry) - set(names):
            raise ValueError(f"{where} must be an object with some of {names}, got {entry!r}")
        entry = dict(entry)
        if "static_prefill" in entry:
            entry["static_prefill"] = MoEConfig.from_json(entry["static_prefill"], f"{where}.static_prefill")
        return built(where, cls, **entry)


def quant_file_dtype(scheme: QuantScheme) -> Tuple[str, Optional[Tuple[int, int]]]:
    """The dtype and block_shape parts of a scheme's tuned file name."""
    if scheme.weight_dtype == "fp8_e4m3":
        return "fp8_w8a8", scheme.weight_block
    if scheme.activation_dtype == "int8":
        return "int8_w8a8", None
    return ("int8_w8a16" if scheme.weight_dtype == "int8" else "int4_w4a16"), None


def quant_file_name(E: int, N: int, device: str, scheme: QuantScheme) -> str:
    dtype, block = quant_file_dtype(scheme)
    return config_file_name(E, N, device, dtype, block)


def parse_quant_configs(text: str, where: str) -> Dict[int, Tuple[MoEConfig, QuantKnobs]]:
    """A quantized tuned file's text -> {M: (tiles, knobs)}; raises ValueError naming the file and key."""
    def entry_of(entry, at: str) -> Tuple[MoEConfig, QuantKnobs]:
        knobs = QuantKnobs.from_json(entry.get("quant", {}), f"{at}.quant") if isinstance(entry, dict) else QuantKnobs()
        return MoEConfig.from_json(entry, at), knobs

    return parse_table(text, where, entry_of)


@functools.lru_cache(maxsize=None)
def load_quant_configs(E: int, N: int, device: str, dtype: str,
                       block_shape: Optional[Tuple[int, int]]) -> Optional[Dict[int, Tuple[MoEConfig, QuantKnobs]]]:
    """The tuned quantized table for (E, N, device, dtype, block_shape): the user folder first, then the shipped files."""
    return read_table(config_file_name(E, N, device, dtype, block_shape), parse_quant_configs)


def lookup_quant_config(T: int, E: int, I: int, device: Optional[str],
                        scheme: QuantScheme) -> Optional[Tuple[MoEConfig, QuantKnobs]]:
    """The tuned entry of the nearest M for T tokens, or None (no device, or no file)."""
    if device is None:
        return None
    dtype, block = quant_file_dtype(scheme)
    table = load_quant_configs(E, I, device, dtype, block)
    if not table:
        return None
    return table[nearest_m(table, T)]


# Candidate tiles (BLOCK_SIZE_N, BLOCK_SIZE_K, num_warps, num_stages), most promising first.
_WEIGHT_ONLY_TILES = ((32, 128, 4, 4), (64, 64, 4, 4), (32, 64, 4, 4), (64, 128, 4, 4), (16, 128, 4, 4),
                      (32, 128, 4, 3), (64, 64, 4, 3), (128, 64, 8, 4), (64, 128, 8, 4), (32, 128, 4, 5),
                      (64, 64, 4, 5), (128, 128, 8, 3), (128, 64, 4, 3))
_FP8_SMALL_TILES = ((64, 128, 4, 4), (128, 128, 4, 4), (32, 128, 4, 4), (32, 128, 4, 5), (64, 256, 4, 4),
                    (64, 128, 4, 5), (128, 128, 4, 3), (128, 256, 4, 3), (32, 256, 4, 5), (64, 128, 4, 3),
                    (128, 128, 8, 4), (256, 128, 4, 3), (32, 128, 4, 6))
_FP8_LARGE_TILES = ((128, 128, 8, 3), (64, 128, 4, 4), (128, 128, 8, 4), (64, 128, 8, 4), (128, 128, 4, 3),
                    (256, 128, 8, 3), (128, 64, 8, 4), (64, 128, 4, 3), (256, 64, 8, 4), (128, 256, 8, 2))


def _rows_per_expert(T: int, E: int, k: int) -> float:
    return T * k / E


def _block_ms(T: int, E: int, k: int) -> Tuple[int, ...]:
    """Row blocks worth trying, best guess first, by tokens per expert."""
    r = _rows_per_expert(T, E, k)
    if use_direct(T, k, E) or r <= 6:
        return (16,)
    if r <= 24:
        return (16, 32)
    if r <= 96:
        return (64, 32)
    if r <= 384:
        return (64, 128)
    return (128, 64)


def _fits(t: TileConfig, n_acc: int, elem_bytes: float, k_scaled: bool, weight_only: bool, wide: int) -> bool:
    """Shared memory of the pipelined tiles within SM90's limit; fp32 accumulators plus a partial
    product per K group of at most 128 registers a thread, and two accumulators (gate and up
    apart, wide = 1) of at most 64 (Triton 3.6 spills 128 there); weight-only tiles also hold
    their converted weights ([BK, wide * BN] at once) in registers (at most 64 a thread);
    K-group scales of 128-row blocks come one per tile up to BLOCK_SIZE_N = 128."""
    per_stage = (t.BLOCK_SIZE_M * t.BLOCK_SIZE_K * (2 if weight_only else elem_bytes)
                 + n_acc * t.BLOCK_SIZE_N * t.BLOCK_SIZE_K * elem_bytes)
    threads = 32 * t.num_warps
    acc = n_acc * t.BLOCK_SIZE_M * t.BLOCK_SIZE_N // threads
    converted = wide * t.BLOCK_SIZE_N * t.BLOCK_SIZE_K // threads if weight_only else 0
    return (per_stage * t.num_stages <= _SMEM_LIMIT and acc * (2 if k_scaled else 1) <= 128
            and not (n_acc == 2 and wide == 1 and acc > 64) and converted <= 64
            and not (k_scaled and not weight_only and t.BLOCK_SIZE_N > 128))


def swap_fits(t: TileConfig, gate_up: bool = False) -> bool:
    """Whether a swapped tile's weight rows fill the 64-row side of every warpgroup's product
    (gate_up: GEMM1's product takes 2 * BLOCK_SIZE_N rows, gate and up interleaved)."""
    rows = t.BLOCK_SIZE_N * (2 if gate_up else 1)
    return rows >= 16 * t.num_warps and rows % 64 == 0


def quant_search_space(T: int, E: int, k: int, kgroup: int, weight_only: bool, int4: bool, k_scaled: bool,
                       gated: bool = True) -> Tuple[List[Tuple[TileConfig, Dict]], Dict[int, List[Tuple[TileConfig, Dict]]]]:
    """Candidates for tuning the quantized kernels at T tokens, most promising first within
    each row block, the row blocks' GEMM1 candidates taking turns.

    Returns (GEMM1 candidates, {BLOCK_SIZE_M: GEMM2 candidates}); a candidate is (tiles, the
    QuantKnobs fields of its GEMM). The search times each GEMM1 candidate with the first GEMM2
    candidate of its BLOCK_SIZE_M, then the GEMM2 candidates with the winner of GEMM1.
    """
    elem = 1 if not weight_only else (0.5 if int4 else 1)
    r = _rows_per_expert(T, E, k)
    if weight_only:
        knobs1 = [{}, {"prefetch1": True}, {"gate_up": True}, {"gate_up": True, "prefetch1": True}]
        bms = _block_ms(T, E, k)
        if r >= 16:  # weights dequantized before the product (both GEMMs; untuned_weight_only's tiles too)
            knobs1 += [{"gate_up": True, "fold_w": True}, {"fold_w": True}]
            bms += tuple(bm for bm in (64,) if bm not in bms)
        elif int4:  # paired products (both GEMMs: GEMM2's candidates run with GEMM1's winner)
            knobs1 += [{"gate_up": True, "w_convert": "pairs"}]
        plans = [(bm, _WEIGHT_ONLY_TILES, knobs1,
                  [{}, {"prefetch2": True}, {"split_k": 2}, {"split_k": 4}, {"split_k": 8},
                   {"split_k": 4, "prefetch2": True}]) for bm in bms]
    else:
        bms = _block_ms(T, E, k)
        knobs1 = [{}, {"gate_up": True}]
        knobs2 = [{}, {"split_k": 2}, {"split_k": 4}] if r <= 64 else [{}]
        if max(bms) > 32:
            plans = [(bm, _FP8_LARGE_TILES, knobs1, knobs2) for bm in bms]
        else:
            swapped1, swapped2 = knobs1, knobs2
            if not k_scaled:  # fp8 few-token tiles: weights on the 64-row side
                swapped1 = knobs1 + [{"swap1": True}, {"gate_up": True, "swap1": True}]
                swapped2 = knobs2 + [{"swap2": True}, {"split_k": 2, "swap2": True}, {"split_k": 4, "swap2": True}]
            plans = [(bm, _FP8_SMALL_TILES, swapped1, swapped2) for bm in bms]
            if r > 6:  # a few rows per expert: whole 64-row warpgroup products too (fp8 without conversion)
                plans.append((64, _FP8_LARGE_TILES, knobs1, knobs2))
    per_bm, g2 = {}, {}
    for bm, tiles, knobs_g1, knobs_g2 in plans:
        for bn, bk, warps, stages in tiles:
            if kgroup and (bk > kgroup or kgroup % bk):
                continue
            t = TileConfig(bm, bn, bk, 8, warps, stages)
            for kn in knobs_g1:
                if kn.get("gate_up") and not gated:
                    continue
                if kn.get("swap1") and not swap_fits(t, bool(kn.get("gate_up"))):
                    continue
                if _fits(t, 2 if gated else 1, elem, k_scaled, weight_only, 2 if kn.get("gate_up") else 1):
                    per_bm.setdefault(bm, []).append((t, kn))
            if _fits(t, 1, elem, k_scaled, weight_only, 1):
                g2.setdefault(bm, []).extend((t, kn) for kn in knobs_g2 if swap_fits(t) or not kn.get("swap2"))
    # Row blocks take turns, so a search that times only the first candidates sees every row block.
    g1 = [c for group in itertools.zip_longest(*per_bm.values()) for c in group if c is not None]
    return g1, g2


# fp8 tiles of the prefill kernels: (GEMM1, GEMM2, least rows per expert), K tiles of 128 (the
# bytes per stage of the 16-bit tiles' 64); the 3-stage 128 x 64 pair lets two programs share
# an SM. GEMM2 tiles of the warp-specialized loop (4 warps, 128 rows).
_FP8_PREFILL_TILES = (
    (TileConfig(128, 128, 128, 8, 8, 3), TileConfig(128, 256, 128, 8, 8, 3), 96),
    (TileConfig(128, 128, 128, 8, 8, 4), TileConfig(128, 128, 128, 8, 8, 4), 96),
    (TileConfig(128, 64, 128, 8, 4, 4), TileConfig(128, 128, 128, 8, 4, 4), 0),
    (TileConfig(128, 64, 128, 8, 4, 3), TileConfig(128, 128, 128, 8, 4, 3), 0),
    (TileConfig(64, 128, 128, 8, 4, 4), TileConfig(64, 256, 128, 8, 4, 3), 0),
    (TileConfig(64, 64, 128, 8, 4, 4), TileConfig(64, 128, 128, 8, 4, 4), 0),
)
_FP8_WS_GEMM2 = (TileConfig(128, 256, 128, 8, 4, 3), TileConfig(128, 128, 128, 8, 4, 4))


def fp8_prefill_space(T: int, E: int, k: int) -> List[MoEConfig]:
    """Candidates for QuantKnobs.static_prefill at T tokens (fp8 with static per-tensor scales):
    tiles of FP8_MIN_TILE_ROWS rows or more, weight tiles by TMA, with and without tail tiles,
    activation rows by TMA, gate and up in one product, GEMM2 warp-specialized (and GEMM1's loops
    flattened next to it); up to 1024 rows per expert also two programs per SM (more weight
    loads in flight). None below 32 rows per expert, where the sorted kernels' short tiles
    stream the weights."""
    per_expert = T * k / E
    if per_expert < 32:
        return []
    grids = (1, 2) if per_expert <= 1024 else (1,)
    out = []
    for g1, g2, least in _FP8_PREFILL_TILES:
        if per_expert < least or (g1.BLOCK_SIZE_M == 64 and per_expert > 512):
            continue
        for tail in (1, 2):
            if g1.BLOCK_SIZE_M // tail < FP8_MIN_TILE_ROWS:
                continue
            for per_sm in grids:
                out.append(MoEConfig(g1, g2, PrefillConfig(1, per_sm, tail)))
                out += [MoEConfig(g1, g2, PrefillConfig(2, per_sm, tail, act_tma=1, x_tma=x_tma, gu1=gu1))
                        for x_tma in (0, 1) for gu1 in (0, 1)]
        if g1.BLOCK_SIZE_M == 128:
            out += [MoEConfig(g1, w2, PrefillConfig(2, 1, 1, flatten=flatten, act_tma=1, x_tma=x_tma, ws=1, gu1=gu1))
                    for w2 in _FP8_WS_GEMM2 for x_tma, flatten in ((0, 0), (1, 0), (0, 1)) for gu1 in (0, 1)]
    return out


# Untuned calls with 8-bit activations on Hopper, by rows an expert (bench/results/h200-quant-default-ab-1.json
# and -2.json: OLMoE, gpt-oss and DeepSeek-V3 shapes, fp8 static and per-channel, int8, M = 256 to 16384):
# gate and up in one product on 64-row tiles from 64 rows an expert, on 128 x 128 tiles from 128, and for
# fp8 with static per-tensor scales the prefill kernels from 64.
_W8A8_MID = MoEConfig(TileConfig(64, 256, 128, 8, 8, 3), TileConfig(64, 128, 128, 8, 4, 3))
_W8A8_LARGE = MoEConfig(TileConfig(128, 128, 128, 8, 8, 3), TileConfig(128, 256, 128, 8, 8, 3))
_FP8_STATIC_PREFILL = MoEConfig(TileConfig(128, 128, 128, 8, 8, 3), TileConfig(128, 256, 128, 8, 4, 3),
                                PrefillConfig(tma=2, programs_per_sm=1, tail=1, flatten=1, act_tma=1, ws=1, gu1=1))


def untuned_w8a8(T: int, E: int, k: int, fp8_tensor: bool) -> Optional[Tuple[MoEConfig, QuantKnobs]]:
    """Tiles and knobs of an untuned Hopper call with 8-bit activations and scales constant
    along K (fp8 per tensor or channel, int8), or None below 64 rows an expert (there the
    unquantized table's fitted tiles stream the weights as fast: 0.99-1.03x at 32 rows).

    From 64 rows an expert these were 1.2-2.5x the fitted tiles, and 1.2-2.0x the bf16 kernel
    where the fitted tiles had fallen to 0.6-0.7x of it. fp8_tensor: per-tensor fp8 activations,
    whose calls with static scales take the prefill kernels (QuantKnobs.static_prefill)."""
    per_expert = T * k / E
    if per_expert < 64:
        return None
    cfg = _W8A8_LARGE if per_expert >= 128 else _W8A8_MID
    return cfg, QuantKnobs(gate_up=True, fuse_x_quant=False,
                           static_prefill=_FP8_STATIC_PREFILL if fp8_tensor else None)


# Untuned weight-only calls on Hopper, by rows an expert (bench/results/h200-weight-only-fold-sweep.json:
# int4 and int8 weights, Qwen3, Mixtral, OLMoE and DeepSeek-V3 shapes, M = 256 to 16384): the weights
# dequantized with their group scales before the product (QuantKnobs.fold_w), gate and up in one product,
# 4-warp tiles of 64 rows from 16 rows an expert and of 128 rows from 64.
_WO_MID = MoEConfig(TileConfig(64, 64, 64, 8, 4, 4), TileConfig(64, 64, 64, 8, 4, 4))
_WO_LARGE = MoEConfig(TileConfig(128, 64, 64, 8, 4, 4), TileConfig(128, 64, 64, 8, 4, 4))
# int4 from half a row to 16 rows an expert: the paired products (w_convert "pairs"), GEMM2 over
# 128 columns (the shipped Qwen3 int4 entries at M = 16 and 64).
_WO_PAIRS = MoEConfig(TileConfig(16, 64, 64, 8, 4, 3), TileConfig(16, 128, 64, 8, 4, 3))
# Below half a row an expert (a token or two): narrow GEMM1 tiles over long K tiles, GEMM2 split in two.
_WO_FEW = MoEConfig(TileConfig(16, 32, 128, 8, 4, 4), TileConfig(16, 64, 128, 8, 4, 4))


def untuned_weight_only(T: int, E: int, k: int, int4: bool = False) -> Optional[Tuple[MoEConfig, QuantKnobs]]:
    """Tiles and knobs of an untuned Hopper call with int4 or int8 weights and float activations,
    or None where the unquantized table's fitted tiles serve (int8 from half a row to 16 rows an
    expert).

    The fitted tiles scale each K tile's product after it finishes, which held the large-M calls
    at 0.14-0.23x the bf16 kernel; with the weights dequantized before the product these tiles
    were 1.1-1.9x the fitted ones at 16-32 rows an expert and 2.9-3.6x from 128. int4 with half
    a row to 16 rows an expert runs the paired products: 1.30-1.43x the fitted tiles at OLMoE
    M = 16 and 64 and DeepSeek-V3 M = 16 (bench/results/h200-int4-pairs-ab-untuned.json). Below
    half a row the fitted tiles ran OLMoE M = 1 at 0.41x (int4) and 0.55x (int8) the bf16 kernel;
    _WO_FEW's were 3.1x / 2.0x faster there, DeepSeek-V3 int4 M = 1 1.37x
    (h200-int4-untuned-m1-ab.json, h200-int8-untuned-m1-ab.json)."""
    per_expert = T * k / E
    if per_expert < 0.5:
        return _WO_FEW, QuantKnobs(gate_up=True, split_k=2, pdl=True, w_convert="ptx" if int4 else "auto")
    if int4 and per_expert < 16:
        return _WO_PAIRS, QuantKnobs(gate_up=True, w_convert="pairs", pdl=True)
    if per_expert < 16:
        return None
    return (_WO_LARGE if per_expert >= 64 else _WO_MID), QuantKnobs(gate_up=True, fold_w=True)

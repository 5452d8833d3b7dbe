"""Tile configurations of the Triton experts kernels: heuristic defaults and tuned JSON files.

File format (the one large serving engines use, so files tuned elsewhere drop in):
    name  E={E},N={N},device_name={device}[,dtype={dtype}][,block_shape=[bn,bk]].json
          N is the expert intermediate size I; device is torch.cuda.get_device_name() with
          spaces as underscores; dtype is left out for bf16/fp16 and "float32" for fp32.
    body  {"<M>": {"BLOCK_SIZE_M": .., "BLOCK_SIZE_N": .., "BLOCK_SIZE_K": ..,
                   "GROUP_SIZE_M": .., "num_warps": .., "num_stages": ..}, ...}
          M is the number of tokens; a call uses the entry of the nearest M. An entry may
          carry "gemm2": {BLOCK_SIZE_N, BLOCK_SIZE_K, GROUP_SIZE_M, num_warps, num_stages}
          to give the down projection its own tiles (moekit's files do; others use one
          config for both GEMMs).
Lookup order: the folder MOEKIT_TUNED_CONFIG_DIR (settings.tuned_config_dir), then the
files shipped in moekit/kernels/configs/, then the heuristic defaults below.
"""

from __future__ import annotations

import functools
import json
import logging
import os
from dataclasses import asdict, dataclass, fields, replace
from typing import Dict, Optional, Tuple

import torch

from ..config import settings

__all__ = [
    "TileConfig",
    "MoEConfig",
    "PrefillConfig",
    "FP8_MIN_TILE_ROWS",
    "config_file_name",
    "config_dtype",
    "device_name",
    "parse_configs",
    "load_configs",
    "read_table",
    "parse_table",
    "built",
    "default_config",
    "hopper_default",
    "on_hopper",
    "get_config",
    "pick_config",
    "nearest_m",
    "use_direct",
    "search_space",
    "late_variants",
    "compile_variant",
    "DECODE_MAX",
    "prefill_space",
    "SHIPPED_DIR",
]

SHIPPED_DIR = os.path.join(os.path.dirname(__file__), "configs")
logger = logging.getLogger("moekit")
_KEYS = ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "GROUP_SIZE_M", "num_warps", "num_stages")
# Shared memory one program may use on SM90 (227 KB) less room for the compiler's own use.
_SMEM_LIMIT = 220 * 1024
# Rows of the shortest fp8 tile of the prefill kernels (BLOCK_SIZE_M / prefill tail): Hopper's
# fp8 warpgroup products take 64 rows; a shorter tile runs other instructions whose sums round
# differently, so a row's bits would depend on the tile it lands in, that is on how many other
# assignments its expert got in the batch.
FP8_MIN_TILE_ROWS = 64


@dataclass(frozen=True)
class TileConfig:
    """Tiles of one GEMM: rows BLOCK_SIZE_M, columns BLOCK_SIZE_N, reduction BLOCK_SIZE_K,
    GROUP_SIZE_M row blocks per L2 group, and Triton's num_warps / num_stages.

    Decode knobs (written to JSON only when not at their defaults, so files without them stay valid):
        SPLIT_K: programs sharing one output tile's reduction (GEMM2 only): the slots and K of a
            token on the direct path, K on the sorted path. Each writes an fp32 partial; the
            last to arrive adds them in split order, so results are deterministic.
        GEMV: 1 runs the direct path's GEMM on CUDA cores (its one live row, no 16-row tl.dot tile).
        PDL: 1 (GEMM2 only, SM90+) launches GEMM2 as a programmatic dependent of GEMM1: its
            programs start while GEMM1's last ones run and wait for GEMM1's output.
        FUSED: 1 (GEMM1 only, direct path; the sorted path ignores it as it does GEMV) runs both
            GEMMs in one launch (triton_decode.fused_gemv_kernel): a program per assignment and
            BLOCK_SIZE_N columns of I (GEMM1's K tile, warps and stages for the w13 loop) keeps its
            activation block in registers and streams the matching w2 columns in gemm2's
            BLOCK_SIZE_N rows of H (gemm2's stages) into an fp32 partial row; a small second
            launch adds a token's partial rows in order (gemm2.PDL: as a programmatic dependent).
        PRE: 0-2 (GEMM2 only, direct path) loads the weight tiles of a program's first PRE
            iterations into registers before it waits for GEMM1 (under PDL they stream while
            GEMM1's last programs run); the sorted path ignores it as it does GEMV.
    """

    BLOCK_SIZE_M: int
    BLOCK_SIZE_N: int
    BLOCK_SIZE_K: int
    GROUP_SIZE_M: int = 1
    num_warps: int = 4
    num_stages: int = 3
    SPLIT_K: int = 1
    GEMV: int = 0
    PDL: int = 0
    FUSED: int = 0
    PRE: int = 0

    def __post_init__(self) -> None:
        for name in _KEYS + ("SPLIT_K",):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        for name in ("GEMV", "PDL", "FUSED"):
            if getattr(self, name) not in (0, 1) or isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be 0 or 1, got {getattr(self, name)!r}")
        if self.PRE not in (0, 1, 2) or isinstance(self.PRE, bool):
            raise ValueError(f"PRE must be 0, 1 or 2, got {self.PRE!r}")
        for name in ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {value}")

    def smem_bytes(self, elem_bytes: int, b_tiles: int) -> int:
        """Shared memory of the pipelined operand tiles: A plus b_tiles B tiles per stage."""
        per_stage = (self.BLOCK_SIZE_M + b_tiles * self.BLOCK_SIZE_N) * self.BLOCK_SIZE_K * elem_bytes
        return per_stage * self.num_stages

    def to_json(self) -> Dict[str, int]:
        return {key: value for key, value in asdict(self).items() if key in _KEYS or value != _OPTIONAL[key]}


# The knobs with defaults that JSON entries may leave out, and those defaults.
_OPTIONAL = {f.name: f.default for f in fields(TileConfig) if f.name not in _KEYS}


@dataclass(frozen=True)
class PrefillConfig:
    """Knobs of the prefill kernels (kernels/triton_prefill.py). A MoEConfig that carries one
    runs them on the sorted path; its JSON entry holds "prefill": {the knobs not at their defaults}.

    Fields:
        tma: 1 reads the weight tiles through TMA tensor descriptors built on the host, 2 built
            in the kernel (SM90+; rows of H and I 16-byte aligned, blocks at most 256 wide),
            0 through pointers.
        programs_per_sm: n >= 1 launches a persistent grid of n programs per multiprocessor,
            0 one program per work item.
        tail: 1, 2 or 4: rows are padded per expert to BLOCK_SIZE_M / tail (>= 16), and an
            expert's last tile runs a loop of BLOCK_SIZE_M / 2 or / 4 rows when those hold its rows.
        flatten: 1 has Triton flatten a persistent grid's tile and K loops into one pipelined
            loop (tail 1 and programs_per_sm >= 1 only: one loop per tile); with ws, GEMM1's
            only (GEMM2's loop is warp-specialized instead).
        act_tma: 1 has GEMM2 read its activation rows (contiguous in the sorted layout) through
            TMA descriptors built in the kernel as well, one per row-tile height (tma=2 only),
            so both operands of its products come by TMA; 0 through pointers.
        x_tma: 1 gathers x's rows into the sorted row order first (one [R, H] copy) and has
            GEMM1 read them through TMA descriptors built in the kernel (tma=2 only); 0 gathers
            the rows of each tile through pointers.
        ws: 1 has Triton warp-specialize GEMM2's persistent tile loop (Hopper; act_tma=1): a
            producer warpgroup keeps the loads in flight across tiles for two consumer
            warpgroups that split each tile's rows; with a bias it runs unspecialized (same
            bits). Needs tma=2, tail=1 and a persistent grid; Hopper's compiler takes GEMM2
            num_warps=4 (12 warps then run). GEMM1 stays as it is (specialized on
            Triton 3.6, it left rows unwritten).
        gu1: 1 has GEMM1 multiply a tile's gate and up rows as one [BK, 2 BN] product, its
            weight tiles read as [2, BN, BK] blocks of w13 viewed [E * 2, I, H] (tma=2; gated
            activations; same bits as two products).
    """

    tma: int = 1
    programs_per_sm: int = 1
    tail: int = 2
    flatten: int = 0
    act_tma: int = 0
    x_tma: int = 0
    ws: int = 0
    gu1: int = 0

    def __post_init__(self) -> None:
        for name, choices in (("tma", (0, 1, 2)), ("tail", (1, 2, 4)), ("flatten", (0, 1)), ("act_tma", (0, 1)),
                              ("x_tma", (0, 1)), ("ws", (0, 1)), ("gu1", (0, 1))):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value not in choices:
                raise ValueError(f"prefill {name} must be one of {list(choices)}, got {value!r}")
        value = self.programs_per_sm
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"prefill programs_per_sm must be an int >= 0, got {value!r}")
        if self.flatten and (self.tail != 1 or self.programs_per_sm == 0):
            raise ValueError(f"prefill flatten=1 needs tail=1 and programs_per_sm >= 1, got tail={self.tail}, "
                             f"programs_per_sm={self.programs_per_sm}")
        for name in ("act_tma", "x_tma", "gu1"):
            if getattr(self, name) and self.tma != 2:
                raise ValueError(f"prefill {name}=1 builds its descriptors in the kernel: it needs tma=2, "
                                 f"got tma={self.tma}")
        if self.ws and (self.tma != 2 or not self.act_tma or self.tail != 1 or self.programs_per_sm == 0):
            raise ValueError(f"prefill ws=1 needs tma=2, act_tma=1, tail=1 and programs_per_sm >= 1, "
                             f"got tma={self.tma}, act_tma={self.act_tma}, tail={self.tail}, "
                             f"programs_per_sm={self.programs_per_sm}")

    def to_json(self) -> Dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) != f.default}

    @classmethod
    def from_json(cls, entry: Dict, where: str = "prefill") -> "PrefillConfig":
        names = [f.name for f in fields(cls)]
        if not isinstance(entry, dict) or set(entry) - set(names):
            raise ValueError(f"{where} must be an object holding some of {names}, got {entry!r}")
        return built(where, cls, **entry)


@dataclass(frozen=True)
class MoEConfig:
    """Tiles of both GEMMs; they share BLOCK_SIZE_M (the row blocks of the alignment).
    prefill: run the sorted path on the prefill kernels with these knobs (None: triton_moe's)."""

    gemm1: TileConfig
    gemm2: TileConfig
    prefill: Optional[PrefillConfig] = None

    def __post_init__(self) -> None:
        if self.gemm1.BLOCK_SIZE_M != self.gemm2.BLOCK_SIZE_M:
            raise ValueError(
                f"gemm2.BLOCK_SIZE_M must equal gemm1.BLOCK_SIZE_M={self.gemm1.BLOCK_SIZE_M}, "
                f"got {self.gemm2.BLOCK_SIZE_M}")
        for name in ("SPLIT_K", "PDL", "PRE"):  # GEMM1's activation needs the whole sum; PDL, PRE: GEMM2's launch
            if getattr(self.gemm1, name) != _OPTIONAL[name]:
                raise ValueError(f"gemm1.{name} must be {_OPTIONAL[name]} (a GEMM2 knob), "
                                 f"got {getattr(self.gemm1, name)}")
        if self.gemm2.FUSED:
            raise ValueError("gemm2.FUSED must be 0 (fusing both GEMMs is gemm1's knob)")
        if self.gemm1.FUSED and self.gemm2.SPLIT_K != 1:
            raise ValueError(f"gemm1.FUSED=1 has no GEMM2 launch to split: gemm2.SPLIT_K must be 1, "
                             f"got {self.gemm2.SPLIT_K}")
        if self.prefill is not None:
            if self.row_granule < 16:
                raise ValueError(f"prefill tail={self.prefill.tail} needs BLOCK_SIZE_M >= {16 * self.prefill.tail} "
                                 f"(rows padded to BLOCK_SIZE_M / tail >= 16), got {self.block_m}")
            knobs = [f"{g}.{name}" for g, tile in (("gemm1", self.gemm1), ("gemm2", self.gemm2))
                     for name, default in _OPTIONAL.items() if getattr(tile, name) != default]
            if knobs:
                raise ValueError(f"the prefill kernels take none of the decode knobs, got {knobs} set")

    @property
    def block_m(self) -> int:
        return self.gemm1.BLOCK_SIZE_M

    @property
    def row_granule(self) -> int:
        """Rows each expert's rows are padded to by the alignment (BLOCK_SIZE_M / prefill tail)."""
        return self.block_m // (self.prefill.tail if self.prefill is not None else 1)

    def to_json(self) -> Dict:
        entry = dict(self.gemm1.to_json())
        g2 = self.gemm2.to_json()
        del g2["BLOCK_SIZE_M"]
        entry["gemm2"] = g2
        if self.prefill is not None:
            entry["prefill"] = self.prefill.to_json()
        return entry

    @classmethod
    def from_json(cls, entry: Dict, where: str = "config") -> "MoEConfig":
        """Parse one M entry (missing "gemm2": the down projection uses the same tiles)."""
        if not isinstance(entry, dict):
            raise ValueError(f"{where} must be an object of {list(_KEYS)}, got {entry!r}")
        missing = [key for key in _KEYS if key not in entry]
        if missing:
            raise ValueError(f"{where} lacks {missing}")
        g1 = built(where, TileConfig, **{key: entry[key] for key in _KEYS + tuple(_OPTIONAL) if key in entry})
        prefill = PrefillConfig.from_json(entry["prefill"], f"{where}.prefill") if "prefill" in entry else None
        if "gemm2" not in entry:  # one config for both GEMMs (fusing them is GEMM1's knob alone)
            return built(where, cls, g1, replace(g1, FUSED=0), prefill)
        down = entry["gemm2"]
        allowed = _KEYS[1:] + tuple(_OPTIONAL)
        if not isinstance(down, dict) or set(down) - set(allowed):
            raise ValueError(f"{where}.gemm2 must hold some of {list(allowed)}, got {down!r}")
        # The knobs of GEMM2 are its own: left out means the default, not GEMM1's value.
        g2 = built(f"{where}.gemm2", replace, g1, **dict(_OPTIONAL, **down))
        return built(where, cls, g1, g2, prefill)


def built(where: str, make, *args, **kwargs):
    """make(*args, **kwargs) for an entry of a tuned file: its checks' errors as ValueErrors
    that name the entry (`where`: the file and key)."""
    try:
        return make(*args, **kwargs)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{where}: {err}") from None


def device_name(device: Optional[torch.device] = None) -> str:
    """The name used in config files, e.g. "NVIDIA_H200" (device: a CUDA device, an index, or None
    for the current one; cached per index, since every call of the layer asks)."""
    return _name_of(cuda_index(device))


def cuda_capability(device: Optional[torch.device] = None) -> Tuple[int, int]:
    """torch.cuda.get_device_capability, cached per device index (torch.compile traces the lookup
    itself: dynamo warns about, and sees through, functools caches)."""
    if torch.compiler.is_compiling():
        return torch.cuda.get_device_capability(cuda_index(device))
    return _capability_of(cuda_index(device))


def cuda_index(device) -> int:
    """The index of a CUDA device given as a torch.device, a string, an index or None (current)."""
    if isinstance(device, int):
        return device
    index = None if device is None else torch.device(device).index
    return torch.cuda.current_device() if index is None else index


@functools.lru_cache(maxsize=None)
def _name_of(index: int) -> str:
    return torch.cuda.get_device_name(index).replace(" ", "_")


@functools.lru_cache(maxsize=None)
def _capability_of(index: int) -> Tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def on_hopper(device: Optional[str]) -> bool:
    """Whether a call runs on a Hopper GPU (compute capability 9.x), where the untuned rules that
    were measured on an H200 apply; device: the call's device_name(), None off CUDA. The
    capability is that of a visible GPU of that name (the current one if none has it)."""
    if device is None or not torch.cuda.is_available():
        return False
    index = _index_of(device)
    return torch.cuda.get_device_capability(index)[0] == 9


@functools.lru_cache(maxsize=None)
def _index_of(device: str) -> Optional[int]:
    """The first visible CUDA device named `device` (device_name()), or None."""
    return next((i for i in range(torch.cuda.device_count()) if device_name(i) == device), None)


def config_dtype(dtype: torch.dtype) -> Optional[str]:
    """The dtype part of a config file name: None for bf16/fp16, "float32" for fp32."""
    return "float32" if dtype == torch.float32 else None


def config_file_name(E: int, N: int, device: str, dtype: Optional[str] = None,
                     block_shape: Optional[Tuple[int, int]] = None) -> str:
    """E={E},N={N},device_name={device}[,dtype={dtype}][,block_shape=[bn,bk]].json"""
    name = f"E={E},N={N},device_name={device}"
    if dtype:
        name += f",dtype={dtype}"
    if block_shape:
        name += f",block_shape=[{block_shape[0]},{block_shape[1]}]"
    return name + ".json"


def parse_table(text: str, where: str, parse_entry) -> Dict[int, object]:
    """A tuned file's text -> {M: parse_entry(entry, "where[M]")}; raises ValueError naming the file and key.

    A top-level "triton_version" string (the large engines' tuners record the Triton that timed the
    file) is metadata, not an entry: skipped, so their files load as written."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{where} is not valid JSON: {err}") from None
    if isinstance(raw, dict) and isinstance(raw.get("triton_version"), str):
        raw = {key: entry for key, entry in raw.items() if key != "triton_version"}
    if not isinstance(raw, dict) or not raw:
        raise ValueError(f"{where} must be a non-empty object mapping M to a config")
    out = {}
    for key, entry in raw.items():
        try:
            M = int(key)
        except ValueError:
            raise ValueError(f"{where}: keys must be token counts M, got {key!r}") from None
        out[M] = parse_entry(entry, f"{where}[{key}]")
    return out


def parse_configs(text: str, where: str) -> Dict[int, MoEConfig]:
    """A config file's text -> {M: MoEConfig}; raises ValueError naming the file and key."""
    return parse_table(text, where, MoEConfig.from_json)


def read_table(name: str, parse):
    """parse(text, path) of the tuned file `name`: the user folder first, then the shipped files
    (None: neither has it, said at INFO on the "moekit" logger; the loaders cache the answer, so
    once a table)."""
    folders = [f for f in (settings.tuned_config_dir, SHIPPED_DIR) if f is not None]
    for folder in folders:
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as fh:
                try:
                    text = fh.read()
                except UnicodeDecodeError as err:
                    raise ValueError(f"{path} is not UTF-8 text: {err}") from None
            return parse(text, path)
    logger.info("moekit: no tuned Triton table %s in %s: the untuned rules pick the tiles (`moekit tune` "
                "writes one; MOEKIT_TUNED_CONFIG_DIR points at a folder of them)", name, " or ".join(folders))
    return None


@functools.lru_cache(maxsize=None)
def load_configs(E: int, N: int, device: str, dtype: Optional[str]) -> Optional[Dict[int, MoEConfig]]:
    """The tuned table for (E, N, device, dtype): the user folder first, then the shipped files."""
    return read_table(config_file_name(E, N, device, dtype), parse_configs)


def use_direct(T: int, k: int, E: int) -> bool:
    """Whether the no-sort path serves T tokens: it reads each expert once per assignment,
    so it pays only while few assignments share an expert (T*k within 10% of the expected
    distinct experts E * (1 - (1 - k/E)^T))."""
    if T <= 1:
        return True
    distinct = E * (1.0 - (1.0 - min(k, E) / E) ** T)
    return T * k <= 1.1 * distinct


def default_config(T: int, E: int, k: int, H: int, I: int, elem_bytes: int = 2) -> MoEConfig:
    """Heuristic tiles by tokens per expert (T*k/E): weight streaming for a few, compute tiles for many."""
    if use_direct(T, k, E):
        g1 = TileConfig(16, 64 if I >= 2048 else 32, 128, 1, 4, 4)
        g2 = TileConfig(16, 32 if H > 4096 else 16, 256, 1, 4, 4)
        return MoEConfig(g1, g2)
    per_expert = T * k / E
    if per_expert <= 16:
        g1 = TileConfig(16, 64, 128, 1, 4, 4)
        g2 = TileConfig(16, 64, 128, 1, 4, 4)
    elif per_expert <= 48:
        g1 = TileConfig(32, 64, 128, 1, 4, 4)
        g2 = TileConfig(32, 64, 128, 1, 4, 4)
    elif per_expert <= 128:
        g1 = TileConfig(64, 64, 64, 8, 4, 4)
        g2 = TileConfig(64, 128, 64, 8, 4, 4)
    else:
        g1 = TileConfig(128, 128, 64, 8, 8, 3)
        g2 = TileConfig(128, 128, 64, 8, 8, 4)
    if elem_bytes == 4:  # fp32 tiles are twice the bytes: halve the pipeline depth
        g1 = replace(g1, num_stages=max(2, g1.num_stages - 1))
        g2 = replace(g2, num_stages=max(2, g2.num_stages - 1))
    return MoEConfig(g1, g2)


# Untuned 16-bit calls on Hopper, by rows an expert (bench/results/h200-bf16-default-ab-1.json and -2.json:
# the five shapes of PERF.md at 4 to 2048 rows an expert, against their tuned entries and default_config):
# the prefill kernels' 64-row tiles from 16 rows an expert, their 128-row tiles, GEMM2 warp-specialized, from 64.
_HOPPER_MID = MoEConfig(TileConfig(64, 128, 64, 8, 4, 4), TileConfig(64, 256, 64, 8, 4, 4),
                        PrefillConfig(tma=2, tail=1, flatten=1, act_tma=1, gu1=1))
_HOPPER_LARGE = MoEConfig(TileConfig(128, 128, 64, 8, 8, 3), TileConfig(128, 256, 64, 8, 4, 4),
                          PrefillConfig(tma=2, tail=1, flatten=1, act_tma=1, ws=1, gu1=1))


def hopper_default(T: int, E: int, k: int, H: int, I: int, elem_bytes: int = 2) -> Optional[MoEConfig]:
    """The tiles of an untuned 16-bit call on Hopper from 16 rows an expert, or None (fewer rows:
    default_config's weight-streaming tiles, within 1 % of the tuned entries there; fp32; rows
    of H or I that TMA cannot read, not a multiple of 16 bytes).

    On the five shapes of PERF.md (M = 64 to 16384) these ran 1.07-1.42x default_config's tiles and
    0.95-1.15x the tuned entries (default_config: 0.72-1.0x of those)."""
    if elem_bytes != 2 or (H * elem_bytes) % 16 or (I * elem_bytes) % 16:
        return None
    per_expert = T * k / E
    if per_expert < 16:
        return None
    return _HOPPER_LARGE if per_expert >= 64 else _HOPPER_MID


def get_config(T: int, E: int, k: int, H: int, I: int, dtype: torch.dtype, device: Optional[str],
               untuned_prefill: bool = True) -> MoEConfig:
    """The config for a call: the tuned entry of the nearest M, else on Hopper hopper_default,
    else the heuristic default.

    Args:
        T: tokens.  E: local experts.  k: slots per token.  H, I: hidden and intermediate sizes.
        dtype: activation/weight dtype.  device: device_name() or None (no tuned files).
        untuned_prefill: whether a call without a table may take hopper_default (False: the
            quantized kernels, which fit their tiles from these and run no prefill knobs).
    """
    return pick_config(T, E, k, H, I, dtype, device, untuned_prefill)[0]


def nearest_m(table: Dict[int, object], T: int) -> int:
    """The key of a tuned table that serves T tokens: the nearest M, the smaller of two as near."""
    return min(table, key=lambda M: (abs(M - T), M))


def pick_config(T: int, E: int, k: int, H: int, I: int, dtype: torch.dtype, device: Optional[str],
                untuned_prefill: bool = True) -> Tuple[MoEConfig, str]:
    """get_config's config and where it came from, as words ("table FILE, entry M = m",
    "hopper_default", "default_config")."""
    elem_bytes = torch.finfo(dtype).bits // 8
    if device is not None:
        table = load_configs(E, I, device, config_dtype(dtype))
        if table:
            m = nearest_m(table, T)
            return table[m], f"table {config_file_name(E, I, device, config_dtype(dtype))}, entry M = {m}"
        if untuned_prefill and on_hopper(device):
            config = hopper_default(T, E, k, H, I, elem_bytes)
            if config is not None:
                return config, "hopper_default"
    return default_config(T, E, k, H, I, elem_bytes), "default_config"


# Up to this many tokens search_space adds the decode knobs; the split counts it tries.
DECODE_MAX = 256
_SPLITS_DIRECT = (8, 4, 16, 2)
_SPLITS_SORTED = (2, 4)


def _fits(cfg: TileConfig, elem_bytes: int, b_tiles: int) -> bool:
    """Shared memory within the SM90 limit, and fp32 accumulators of at most ~128 registers
    a thread (b_tiles accumulators of BM x BN over 32 * num_warps threads)."""
    acc_regs = b_tiles * cfg.BLOCK_SIZE_M * cfg.BLOCK_SIZE_N // (32 * cfg.num_warps)
    return cfg.smem_bytes(elem_bytes, b_tiles) <= _SMEM_LIMIT and acc_regs <= 128


def search_space(T: int, E: int, k: int, elem_bytes: int = 2) -> Tuple[list, Dict[int, list]]:
    """Candidate tiles for `moekit tune` at T tokens, most promising first.

    Returns (gemm1 candidates, {BLOCK_SIZE_M: gemm2 candidates}). The search times each
    gemm1 candidate with the default gemm2 of its BLOCK_SIZE_M, then the gemm2 candidates
    of the winner's BLOCK_SIZE_M.
    """
    if use_direct(T, k, E):
        # Weight streaming with one live row: narrow columns, long K tiles, deep pipelines.
        bms, bns1, bns2, bks, warps, stages, group = (16,), (32, 64, 16, 128), (16, 32, 64), (128, 256, 64, 512), (4,), (4, 5, 3), 1
    elif T * k / E <= 32:
        bms, bns1, bns2, bks, warps, stages, group = (16, 32), (64, 32, 128), (64, 32, 128), (128, 256, 64), (4,), (4, 5, 3), 8
        if T <= DECODE_MAX and T * k / E > 16:  # one 64-row block holds an expert's rows: its weights read once
            bms += (64,)
    elif T * k / E <= 192:
        bms, bns1, bns2, bks, warps, stages, group = (64, 32, 128), (64, 128), (128, 64), (64, 128), (4, 8), (4, 3), 8
    else:
        bms, bns1, bns2, bks, warps, stages, group = (128, 64), (128, 64), (128, 256, 64), (64, 128), (8, 4), (3, 4, 5), 8
    g1, g2 = [], {}
    for bm in bms:
        for bk in bks:
            for w in warps:
                for st in stages:
                    for bn in bns1:
                        cfg = TileConfig(bm, bn, bk, group, w, st)
                        if _fits(cfg, elem_bytes, 2):
                            g1.append(cfg)
                    for bn in bns2:
                        cfg = TileConfig(bm, bn, bk, group, w, st)
                        if _fits(cfg, elem_bytes, 1):
                            g2.setdefault(bm, []).append(cfg)
    if T <= DECODE_MAX:
        g1, g2 = _with_decode_knobs(T, E, k, elem_bytes, g1, g2)
    return g1, g2


def _with_decode_knobs(T: int, E: int, k: int, elem_bytes: int, g1: list, g2: Dict[int, list]):
    """search_space's tiles plus the decode knobs: GEMM2 split over SPLIT_K programs (both
    paths) and, on the direct path, the CUDA-core GEMMs first (GEMV tiles of at most 32
    (GEMM1: gate and up) or 64 (GEMM2) weights a thread, so they stay in registers)."""
    if not use_direct(T, k, E):
        return g1, {bm: tiles + [replace(c, SPLIT_K=s) for s in _SPLITS_SORTED for c in tiles]
                    for bm, tiles in g2.items()}
    gemv1, gemv2 = [], []
    for bn in (16, 32, 64):
        for bk in (256, 128, 512):
            for w in (4, 8):
                for st in (3, 4):
                    cfg = TileConfig(16, bn, bk, 1, w, st, GEMV=1)
                    per_thread = bn * bk // (32 * w)
                    if per_thread <= 32 and _fits(cfg, elem_bytes, 2):
                        gemv1.append(cfg)
                    if per_thread <= 64 and _fits(cfg, elem_bytes, 1):
                        gemv2.append(cfg)
    tiles = gemv2 + g2[16]
    return gemv1 + g1, {16: [replace(c, SPLIT_K=s) for s in _SPLITS_DIRECT for c in tiles] + tiles}


# Fused direct-path tiles the tuner times last: (columns of I per program, GEMM1's K tile, warps,
# stages; w2 rows per tile, stages), the winners of an H200 sweep over PERF.md's five shapes at
# M = 1 (bench/triton_m1_h200.py --fused; bench/NOTES-triton.md).
_FUSED_TILES = ((128, 64, 4, 4, 64, 4), (128, 128, 8, 3, 128, 4), (128, 64, 8, 4, 128, 4), (64, 128, 8, 4, 128, 4),
                (256, 128, 16, 2, 128, 3))


def late_variants(cfg: MoEConfig, T: int, E: int, k: int) -> list:
    """Variants the tuner times last at T tokens, on the direct path only (two launches, where a
    launch's gap weighs most): the winner with GEMM2 launched as a programmatic dependent of
    GEMM1 (PDL), also loading its first one or two weight tiles before it waits (PRE), and both GEMMs fused into one launch (gemm1.FUSED) over a few tiles, with
    and without PDL for the partial sum."""
    if not use_direct(T, k, E) or cfg.gemm1.FUSED:
        return []
    out = [] if cfg.gemm2.PDL else [replace(cfg, gemm2=replace(cfg.gemm2, PDL=1))]
    if not cfg.gemm2.PRE:
        out += [replace(cfg, gemm2=replace(cfg.gemm2, PDL=1, PRE=pre)) for pre in (1, 2)]
    for bc, bk, warps, stages, bh, stages2 in _FUSED_TILES:
        for pdl in (1, 0):
            out.append(MoEConfig(TileConfig(16, bc, bk, 1, warps, stages, GEMV=1, FUSED=1),
                                 TileConfig(16, bh, 128, 1, 4, stages2, PDL=pdl)))
    return out


def compile_variant(cfg: MoEConfig) -> MoEConfig:
    """A config that compiles the same kernels as cfg (every SPLIT_K above 1 runs one GEMM2
    kernel, and GEMM1's does not depend on it), so compile jobs can be deduplicated."""
    return replace(cfg, gemm2=replace(cfg.gemm2, SPLIT_K=min(cfg.gemm2.SPLIT_K, 2)))


# Tiles of the prefill kernels: (least rows per expert T*k/E, GEMM1, GEMM2, programs per SM
# of a persistent grid: what fits the registers and shared memory of one SM).
_PREFILL_TILES = (
    (64, TileConfig(128, 128, 64, 8, 8, 3), TileConfig(128, 256, 64, 8, 8, 3), 1),
    (64, TileConfig(128, 128, 64, 8, 8, 4), TileConfig(128, 128, 64, 8, 8, 4), 1),
    (64, TileConfig(128, 64, 64, 8, 4, 3), TileConfig(128, 128, 64, 8, 4, 3), 2),
    (32, TileConfig(64, 128, 64, 8, 4, 4), TileConfig(64, 256, 64, 8, 4, 4), 1),
)
# GEMM2 tiles of the warp-specialized loop (PrefillConfig ws=1), 128 rows: num_warps=4 is one
# consumer warpgroup of two (each holds half the rows' accumulators), the producer adds a
# third; 3 or 4 stages of A and B tiles fit Hopper's shared memory (at most 213 KB). GEMM1
# keeps the first prefill tiles.
_WS_GEMM2_TILES = (TileConfig(128, 256, 64, 8, 4, 3), TileConfig(128, 256, 64, 8, 4, 4),
                   TileConfig(128, 128, 64, 8, 4, 4))


def prefill_space(T: int, E: int, k: int, elem_bytes: int = 2) -> list:
    """Candidates on the prefill kernels (MoEConfigs with a PrefillConfig) for `moekit tune` at
    T tokens: every knob over a few large tiles (descriptors built in the kernel and flattened
    loops on persistent grids only; activation rows by TMA with descriptors built in the kernel;
    warp-specialized GEMM2 loops on _WS_GEMM2_TILES; gate and up in one product or two); none
    below 32 rows per expert (T*k/E), where the weights, not the tensor cores, set the time. The
    BLOCK_SIZE_M = 64 tiles serve up to 512 rows per expert."""
    per_expert = T * k / E
    if use_direct(T, k, E) or per_expert < 32:
        return []
    out = []
    for least, g1, g2, per_sm in _PREFILL_TILES:
        if per_expert < least or (g1.BLOCK_SIZE_M < 128 and per_expert > 512):
            continue
        if not (_fits(g1, elem_bytes, 2) and _fits(g2, elem_bytes, 1)):
            continue
        for tail in (1, 2, 4):
            if g1.BLOCK_SIZE_M // tail < 16:
                continue
            for tma, grid in ((1, per_sm), (1, 0), (0, per_sm), (0, 0), (2, per_sm)):
                out.append(MoEConfig(g1, g2, PrefillConfig(tma, grid, tail)))
            # both operands by TMA: GEMM2's act rows, and GEMM1's x rows gathered first
            for grid, x_tma in ((per_sm, 0), (per_sm, 1), (0, 1)):
                out += [MoEConfig(g1, g2, PrefillConfig(2, grid, tail, act_tma=1, x_tma=x_tma, gu1=gu1))
                        for gu1 in (0, 1)]
            if tail == 1:
                out.append(MoEConfig(g1, g2, PrefillConfig(1, per_sm, tail, flatten=1)))
                out += [MoEConfig(g1, g2, PrefillConfig(2, per_sm, tail, flatten=1, act_tma=1, x_tma=x_tma, gu1=gu1))
                        for x_tma in (0, 1) for gu1 in (0, 1)]
    if per_expert >= 64 and elem_bytes == 2:
        g1 = _PREFILL_TILES[0][1]
        out += [MoEConfig(g1, g2, PrefillConfig(2, 1, 1, act_tma=1, x_tma=x_tma, ws=1, gu1=gu1))
                for g2 in _WS_GEMM2_TILES for x_tma in (0, 1) for gu1 in (0, 1)]
        out += [MoEConfig(g1, g2, PrefillConfig(2, 1, 1, flatten=1, act_tma=1, ws=1, gu1=gu1))
                for g2 in _WS_GEMM2_TILES for gu1 in (0, 1)]
    return out

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
import os
from dataclasses import asdict, dataclass, replace
from typing import Dict, Optional, Tuple

import torch

from ..config import settings

__all__ = [
    "TileConfig",
    "MoEConfig",
    "config_file_name",
    "config_dtype",
    "device_name",
    "parse_configs",
    "load_configs",
    "default_config",
    "get_config",
    "use_direct",
    "search_space",
    "SHIPPED_DIR",
]

SHIPPED_DIR = os.path.join(os.path.dirname(__file__), "configs")
_KEYS = ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "GROUP_SIZE_M", "num_warps", "num_stages")
# Shared memory one program may use on SM90 (227 KB) less room for the compiler's own use.
_SMEM_LIMIT = 220 * 1024


@dataclass(frozen=True)
class TileConfig:
    """Tiles of one GEMM: rows BLOCK_SIZE_M, columns BLOCK_SIZE_N, reduction BLOCK_SIZE_K,
    GROUP_SIZE_M row blocks per L2 group, and Triton's num_warps / num_stages."""

    BLOCK_SIZE_M: int
    BLOCK_SIZE_N: int
    BLOCK_SIZE_K: int
    GROUP_SIZE_M: int = 1
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        for name in _KEYS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        for name in ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {value}")

    def smem_bytes(self, elem_bytes: int, b_tiles: int) -> int:
        """Shared memory of the pipelined operand tiles: A plus b_tiles B tiles per stage."""
        per_stage = (self.BLOCK_SIZE_M + b_tiles * self.BLOCK_SIZE_N) * self.BLOCK_SIZE_K * elem_bytes
        return per_stage * self.num_stages

    def to_json(self) -> Dict[str, int]:
        return asdict(self)


@dataclass(frozen=True)
class MoEConfig:
    """Tiles of both GEMMs; they share BLOCK_SIZE_M (the row blocks of the alignment)."""

    gemm1: TileConfig
    gemm2: TileConfig

    def __post_init__(self) -> None:
        if self.gemm1.BLOCK_SIZE_M != self.gemm2.BLOCK_SIZE_M:
            raise ValueError(
                f"gemm2.BLOCK_SIZE_M must equal gemm1.BLOCK_SIZE_M={self.gemm1.BLOCK_SIZE_M}, "
                f"got {self.gemm2.BLOCK_SIZE_M}")

    @property
    def block_m(self) -> int:
        return self.gemm1.BLOCK_SIZE_M

    def to_json(self) -> Dict:
        entry = dict(self.gemm1.to_json())
        g2 = self.gemm2.to_json()
        del g2["BLOCK_SIZE_M"]
        entry["gemm2"] = g2
        return entry

    @classmethod
    def from_json(cls, entry: Dict, where: str = "config") -> "MoEConfig":
        """Parse one M entry (missing "gemm2": the down projection uses the same tiles)."""
        if not isinstance(entry, dict):
            raise ValueError(f"{where} must be an object of {list(_KEYS)}, got {entry!r}")
        missing = [key for key in _KEYS if key not in entry]
        if missing:
            raise ValueError(f"{where} lacks {missing}")
        g1 = TileConfig(**{key: entry[key] for key in _KEYS})
        down = entry.get("gemm2", {})
        if not isinstance(down, dict) or "BLOCK_SIZE_M" in down or set(down) - set(_KEYS):
            raise ValueError(f"{where}.gemm2 must hold some of {list(_KEYS[1:])}, got {down!r}")
        return cls(g1, replace(g1, **down))


def device_name(device: Optional[torch.device] = None) -> str:
    """The name used in config files, e.g. "NVIDIA_H200"."""
    return torch.cuda.get_device_name(device).replace(" ", "_")


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


def parse_configs(text: str, where: str) -> Dict[int, MoEConfig]:
    """A config file's text -> {M: MoEConfig}; raises ValueError naming the file and key."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{where} is not valid JSON: {err}") from None
    if not isinstance(raw, dict) or not raw:
        raise ValueError(f"{where} must be a non-empty object mapping M to a config")
    out: Dict[int, MoEConfig] = {}
    for key, entry in raw.items():
        try:
            M = int(key)
        except ValueError:
            raise ValueError(f"{where}: keys must be token counts M, got {key!r}") from None
        out[M] = MoEConfig.from_json(entry, f"{where}[{key}]")
    return out


@functools.lru_cache(maxsize=None)
def load_configs(E: int, N: int, device: str, dtype: Optional[str]) -> Optional[Dict[int, MoEConfig]]:
    """The tuned table for (E, N, device, dtype): the user folder first, then the shipped files."""
    name = config_file_name(E, N, device, dtype)
    for folder in (settings.tuned_config_dir, SHIPPED_DIR):
        if folder is None:
            continue
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as fh:
                return parse_configs(fh.read(), path)
    return None


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


def get_config(T: int, E: int, k: int, H: int, I: int, dtype: torch.dtype, device: Optional[str]) -> MoEConfig:
    """The config for a call: the tuned entry of the nearest M, else the heuristic default.

    Args:
        T: tokens.  E: local experts.  k: slots per token.  H, I: hidden and intermediate sizes.
        dtype: activation/weight dtype.  device: device_name() or None (no tuned files).
    """
    if device is not None:
        table = load_configs(E, I, device, config_dtype(dtype))
        if table:
            return table[min(table, key=lambda M: (abs(M - T), M))]
    return default_config(T, E, k, H, I, torch.finfo(dtype).bits // 8)


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
    return g1, g2

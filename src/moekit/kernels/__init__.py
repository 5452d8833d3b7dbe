"""Triton GPU kernels of the experts (alignment, fused GEMMs, quantized GEMMs) with their launchers and tile configs.

Importing this package needs the optional `triton` package (`pip install moekit[gpu]`).
"""

try:
    import triton  # noqa: F401
except ImportError as err:  # pragma: no cover - depends on the environment
    raise ImportError("moekit.kernels needs Triton: `pip install moekit[gpu]`") from err

from .launch import Alignment, fused_moe, moe_align
from .launch_quant import fused_moe_quant, quantize_rows
from .tuning import MoEConfig, TileConfig, get_config

__all__ = ["Alignment", "fused_moe", "moe_align", "fused_moe_quant", "quantize_rows", "MoEConfig", "TileConfig",
           "get_config"]

"""Roofline floors of one MoE layer (PERF.md, "Count first")."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Ceilings", "CPU_CEILINGS", "H200_CEILINGS", "layer_flops", "distinct_experts", "weight_bytes", "floor_seconds"]


@dataclass(frozen=True)
class Ceilings:
    """Measured ceilings of a machine: compute in FLOP/s and memory bandwidth in B/s."""

    name: str
    flops: float
    bandwidth: float


# PERF.md: this CPU box (2 vCPU Zen 3): fp32 GEMM ~100 GFLOP/s on 2 threads, DRAM ~12 GB/s.
CPU_CEILINGS = Ceilings("cpu-2vcpu-zen3", 100e9, 12e9)
# PERF.md: one H200: bf16 GEMM 789 TFLOP/s (fp8 about 2x); its floor table uses 4.3 TB/s
# (between the 4.26 TB/s device copy and the 4.5 TB/s best streaming read).
H200_CEILINGS = Ceilings("NVIDIA H200", 789e12, 4.3e12)


def layer_flops(M: int, k: int, H: int, I: int) -> float:
    """6 * M * k * H * I: two GEMMs (gate+up: 4MkHI, down: 2MkHI)."""
    return 6.0 * M * k * H * I


def distinct_experts(M: int, E: int, k: int) -> float:
    """Expected experts touched by M tokens under uniform routing: E * (1 - (1 - k/E)^M)."""
    return E * (1.0 - (1.0 - k / E) ** M)


def weight_bytes(M: int, E: int, k: int, H: int, I: int, bytes_per_weight: float) -> float:
    return distinct_experts(M, E, k) * 3 * H * I * bytes_per_weight


def floor_seconds(M: int, E: int, k: int, H: int, I: int, bytes_per_weight: float, ceil: Ceilings,
                  flops_scale: float = 1.0) -> float:
    """max(FLOPs / compute ceiling, weight bytes / bandwidth); flops_scale=2 for fp8 compute."""
    return max(layer_flops(M, k, H, I) / (ceil.flops * flops_scale),
               weight_bytes(M, E, k, H, I, bytes_per_weight) / ceil.bandwidth)

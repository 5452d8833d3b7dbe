"""Experts backends (one file each) and the `fused_experts` entry point."""

from . import cpu, grouped_mm, reference  # noqa: F401  (each registers its backend)
from . import cpu_int8, cpu_weight_only  # noqa: F401  (quantized CPU backends)
from .api import check_experts_inputs, experts_forward, fused_experts, problem_of
from .base import BACKENDS, ExpertsBackend, ExpertsProblem, ExpertWeights, get_backend, register_backend

try:  # the Triton backend needs the optional `triton` package
    from . import triton_experts  # noqa: F401
except ImportError:  # pragma: no cover - depends on the environment
    pass

__all__ = [
    "fused_experts", "experts_forward", "check_experts_inputs", "problem_of",
    "BACKENDS", "ExpertsBackend", "ExpertsProblem", "ExpertWeights", "get_backend", "register_backend",
]

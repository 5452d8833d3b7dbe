"""moekit: Mixture-of-Experts inference layers for PyTorch.

Public API: RoutingConfig, route, fused_experts, FusedMoE, available_backends and the
configs beside them. See ARCHITECTURE.md for the map.
"""

from . import balance
from .activations import ACTIVATIONS
from .config import ActivationParams, RoutingConfig, SharedExpertsConfig, settings
from .experts import BACKENDS, ExpertsBackend, ExpertsProblem, ExpertWeights, fused_experts
from .layer import FusedMoE, RoutedExperts
from .oracle import available_backends, choose_backend, explain
from .parallel import ParallelConfig
from .quant import QuantScheme, get_scheme, quantize_experts
from .routing import TopK, route

__version__ = "0.1.0"

__all__ = [
    "balance",
    "ACTIVATIONS",
    "ActivationParams",
    "RoutingConfig",
    "SharedExpertsConfig",
    "settings",
    "BACKENDS",
    "ExpertsBackend",
    "ExpertsProblem",
    "ExpertWeights",
    "fused_experts",
    "FusedMoE",
    "RoutedExperts",
    "available_backends",
    "choose_backend",
    "explain",
    "ParallelConfig",
    "QuantScheme",
    "get_scheme",
    "quantize_experts",
    "TopK",
    "route",
    "__version__",
]

# Hugging Face transformers: register the "moekit" experts implementation (see moekit.hf)
# as soon as transformers loads its MoE module, without importing transformers here.
from .integrations.hf_hook import register_when_imported as _register_hf_when_imported

_register_hf_when_imported()

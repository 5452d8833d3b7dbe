"""moekit: Mixture-of-Experts inference layers for PyTorch.

Public API: RoutingConfig, route, fused_experts, FusedMoE, available_backends and the
configs beside them. See ARCHITECTURE.md for the map.
"""

from .activations import ACTIVATIONS
from .config import ActivationParams, RoutingConfig, SharedExpertsConfig, settings
from .experts import BACKENDS, ExpertsBackend, ExpertsProblem, ExpertWeights, fused_experts
from .layer import FusedMoE, RoutedExperts
from .oracle import available_backends, choose_backend, explain
from .routing import TopK, route

__version__ = "0.1.0"

__all__ = [
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
    "TopK",
    "route",
    "__version__",
]

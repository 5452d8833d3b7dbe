"""Configuration objects (frozen dataclasses) and the environment settings moekit reads once.

Letters used throughout moekit: T tokens, H hidden size, I expert intermediate size,
E experts, k experts per token (top_k), G expert groups.
"""

from __future__ import annotations

import math
import numbers
import os
from dataclasses import dataclass, field
from typing import Callable, Optional, Tuple

__all__ = [
    "RoutingConfig",
    "SharedExpertsConfig",
    "ActivationParams",
    "Settings",
    "settings",
    "SCORINGS",
    "ORDERS",
    "GROUP_SCORES",
    "SHARED_MODES",
]

SCORINGS = ("softmax", "sigmoid", "sqrtsoftplus")
ORDERS = ("score_then_topk", "topk_then_softmax", "topk_then_sigmoid")
GROUP_SCORES = ("top2_sum", "max")
SCALE_PLACES = ("router", "output")
SHARED_MODES = ("separate", "fused", "overlap")


def _int_field(name: str, value) -> int:
    """value as an int >= 1 (Python or numpy integers; not bool, not float)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return int(value)


def _choice(name: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")


@dataclass(frozen=True)
class RoutingConfig:
    """How a router turns logits [T, E] into (weights [T, k] fp32, ids [T, k] int32).

    Fields (ROUTING.md names the model families that use each):
        top_k: experts per token, k >= 1.
        scoring: "softmax" | "sigmoid" | "sqrtsoftplus" (order "score_then_topk" only).
        renormalize: divide the k selected weights by their sum. None (the default) takes the
            order's rule: True for "score_then_topk" and "topk_then_softmax" (whose k weights
            already sum to 1), False for "topk_then_sigmoid" (Llama-4); True there renormalises
            the k sigmoids (Cohere2-MoE). The field holds the resolved bool.
        num_expert_group / topk_group: DeepSeek grouped top-k (G groups, keep g); None = no groups.
        group_score: "top2_sum" | "max"; None picks "top2_sum" when a correction bias is
            given (DeepSeek-V3) and "max" otherwise (DeepSeek-V2).
        routed_scaling_factor: s, multiplies the routed weights (or the routed output).
        scale_on: "router" multiplies the weights by s; "output" leaves the weights
            unscaled and the runner multiplies the routed output by s. Never both.
        order: "score_then_topk" (score all experts, pick k), "topk_then_softmax"
            (gpt-oss: pick on raw logits, softmax over the k), "topk_then_sigmoid"
            (Llama-4: pick on raw logits, sigmoid of the k).
        apply_router_weight_on_input: the weight multiplies the expert input and expert
            outputs are summed unweighted (Llama-4; meaningful for k = 1 only).
        custom: callable (hidden [T, H], logits [T, E], k) -> (weights [T, k], ids [T, k]);
            when set, it replaces every other selection rule.
        group_fallback: with groups that do not fit E (E % G != 0 or E <= G), route without
            groups instead of raising. Off by default: a bad config is an error.
    """

    top_k: int
    scoring: str = "softmax"
    renormalize: Optional[bool] = None
    num_expert_group: Optional[int] = None
    topk_group: Optional[int] = None
    group_score: Optional[str] = None
    routed_scaling_factor: float = 1.0
    scale_on: str = "router"
    order: str = "score_then_topk"
    apply_router_weight_on_input: bool = False
    custom: Optional[Callable] = None
    group_fallback: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "top_k", _int_field("top_k", self.top_k))
        for name in ("num_expert_group", "topk_group"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, _int_field(name, getattr(self, name)))
        if self.renormalize is None:
            object.__setattr__(self, "renormalize", self.order != "topk_then_sigmoid")
        for name in ("renormalize", "apply_router_weight_on_input", "group_fallback"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        s = self.routed_scaling_factor
        if isinstance(s, bool) or not isinstance(s, numbers.Real) or not math.isfinite(s) or s <= 0:
            raise ValueError(f"routed_scaling_factor must be a finite number > 0, got {s!r}")
        object.__setattr__(self, "routed_scaling_factor", float(s))
        if self.apply_router_weight_on_input and self.top_k != 1:
            raise ValueError(f"apply_router_weight_on_input needs top_k == 1 (the input takes one weight), "
                             f"got top_k={self.top_k}")
        _choice("scoring", self.scoring, SCORINGS)
        _choice("order", self.order, ORDERS)
        _choice("scale_on", self.scale_on, SCALE_PLACES)
        if self.group_score is not None:
            _choice("group_score", self.group_score, GROUP_SCORES)
        if self.custom is not None and not callable(self.custom):
            raise TypeError(f"custom must be a callable (hidden, logits, k) -> (weights, ids), got {type(self.custom).__name__}")
        if (self.num_expert_group is None) != (self.topk_group is None):
            raise ValueError(
                "num_expert_group and topk_group must be set together, got "
                f"num_expert_group={self.num_expert_group!r}, topk_group={self.topk_group!r}"
            )
        if self.num_expert_group is not None:
            if self.num_expert_group < 1:
                raise ValueError(f"num_expert_group must be >= 1, got {self.num_expert_group}")
            if not 1 <= self.topk_group <= self.num_expert_group:
                raise ValueError(
                    f"topk_group must be in [1, num_expert_group={self.num_expert_group}], got {self.topk_group}"
                )
            if self.order != "score_then_topk":
                raise ValueError(f"num_expert_group needs order='score_then_topk', got order={self.order!r}")
        elif self.group_score is not None:
            raise ValueError(f"group_score={self.group_score!r} only applies to grouped top-k; "
                             "set num_expert_group and topk_group too, or leave group_score at None")
        if self.order != "score_then_topk" and self.scoring != "softmax":
            raise ValueError(
                f"scoring={self.scoring!r} only applies to order='score_then_topk'; "
                f"order={self.order!r} defines its own weights (leave scoring at 'softmax')"
            )

    def group_score_for(self, has_bias: bool) -> str:
        """The group score in use: group_score, else "top2_sum" with a correction bias, "max" without."""
        return self.group_score or ("top2_sum" if has_bias else "max")

    def renorm_eps(self, grouped: bool, has_bias: bool) -> Tuple[float, bool]:
        """(eps, clamp) of the score-then-top-k renormalisation w / (sum + eps), or w / max(sum, eps)
        with clamp: sqrt-softplus clamps at 1e-20; sigmoid scoring, groups or a correction bias
        add 1e-20 (DeepSeek-V3); plain softmax adds nothing."""
        if self.scoring == "sqrtsoftplus":
            return 1e-20, True
        if self.scoring == "sigmoid" or grouped or has_bias:
            return 1e-20, False
        return 0.0, False

    def uses_groups(self, num_experts: int) -> bool:
        """Whether grouped top-k applies for E = num_experts (after the fallback rule)."""
        if self.num_expert_group is None:
            return False
        return self._group_problem(num_experts) is None

    def _group_problem(self, num_experts: int) -> Optional[str]:
        G = self.num_expert_group
        if num_experts % G != 0:
            return f"num_expert_group={G} must divide the number of experts {num_experts}"
        if num_experts <= G:
            return f"num_expert_group={G} must be smaller than the number of experts {num_experts}"
        if self.top_k > self.topk_group * (num_experts // G):
            return (
                f"top_k={self.top_k} exceeds the experts in the kept groups "
                f"(topk_group={self.topk_group} x {num_experts // G} experts per group)"
            )
        return None

    def validate_for(self, num_experts: int) -> None:
        """Raise ValueError naming the field when this config cannot route over E experts."""
        if num_experts < 1:
            raise ValueError(f"num_experts must be >= 1, got {num_experts}")
        if self.custom is None and self.top_k > num_experts:
            raise ValueError(f"top_k={self.top_k} is larger than the number of experts {num_experts}")
        if self.num_expert_group is not None and not self.group_fallback:
            problem = self._group_problem(num_experts)
            if problem is not None:
                raise ValueError(problem + " (set group_fallback=True to route without groups)")


@dataclass(frozen=True)
class ActivationParams:
    """Parameters of the clamped SwiGLUs, |u| <= limit in each: swigluoai (gpt-oss)
    out = g*sigmoid(alpha*g)*(u+1) with g <= limit; swiglu_limit out = silu(g)*u with g <= limit;
    swiglustep out = min(silu(g), limit)*u (the last two take the limit only)."""

    alpha: float = 1.702
    limit: float = 7.0

    def __post_init__(self) -> None:
        a, lim = self.alpha, self.limit
        if isinstance(a, bool) or not isinstance(a, numbers.Real) or not math.isfinite(a):
            raise ValueError(f"alpha must be a finite number, got {a!r}")
        if isinstance(lim, bool) or not isinstance(lim, numbers.Real) or not lim > 0:
            raise ValueError(f"limit must be a number > 0 (inf: no clamp), got {lim!r}")
        object.__setattr__(self, "alpha", float(a))
        object.__setattr__(self, "limit", float(lim))


@dataclass(frozen=True)
class SharedExpertsConfig:
    """Shared experts every token goes through, beside the routed ones.

    Fields:
        intermediate_size: I_s of the shared SwiGLU-style MLP (all shared experts together).
        gated: multiply the shared output by sigmoid(x W_g^T), W_g [1, H] (Qwen2-MoE).
        mode: "separate" (own MLP, run before the routed experts), "fused" (rides in the
            experts computation as I_s / I always-selected extra experts, DeepSeek style),
            "overlap" (own MLP on a side CUDA stream; same as "separate" on CPU).
        activation: the shared MLP's activation; None means the routed experts' one.
    """

    intermediate_size: int
    gated: bool = False
    mode: str = "separate"
    activation: Optional[str] = None

    def __post_init__(self) -> None:
        from .activations import check_activation  # noqa: PLC0415 (activations imports this module)

        object.__setattr__(self, "intermediate_size", _int_field("intermediate_size", self.intermediate_size))
        if not isinstance(self.gated, bool):
            raise TypeError(f"gated must be a bool, got {self.gated!r}")
        _choice("mode", self.mode, SHARED_MODES)
        if self.activation is not None:
            check_activation(self.activation)


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name} must be an integer, got {raw!r}") from None
    if value < 1:
        raise ValueError(f"environment variable {name} must be >= 1, got {value}")
    return value


@dataclass(frozen=True)
class Settings:
    """Environment settings, read once at import (never inside hot functions).

    MOEKIT_CHUNK_SIZE: tokens per chunk in the runner (bounds workspace memory).
    MOEKIT_TUNED_CONFIG_DIR: a folder of user-tuned Triton config JSON files.
    MOEKIT_CHECK_IDS: "0" disables the id range check on accelerators.
    TRITON_INTERPRET: "1" runs Triton kernels in Triton's CPU interpreter (tests only).
    """

    chunk_size: int = 16384
    tuned_config_dir: Optional[str] = None
    check_ids: bool = True
    triton_interpret: bool = False
    extra: dict = field(default_factory=dict)

    @classmethod
    def from_env(cls) -> "Settings":
        return cls(
            chunk_size=_env_int("MOEKIT_CHUNK_SIZE", 16384),
            tuned_config_dir=os.environ.get("MOEKIT_TUNED_CONFIG_DIR") or None,
            check_ids=os.environ.get("MOEKIT_CHECK_IDS", "1") != "0",
            triton_interpret=os.environ.get("TRITON_INTERPRET", "").lower() in ("1", "true", "yes", "on", "y"),
        )


settings = Settings.from_env()

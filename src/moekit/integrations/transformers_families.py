"""The transformers sparse-MoE block structures whole-block replacement reproduces.

Each BlockFamily names a family's block, router and shared-MLP classes, where its tensors
live, and a function mapping its router module to the RoutingConfig that computes what the
router computes (ROUTING.md). transformers_blocks.patch_model matches blocks against them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import torch
import torch.nn as nn

from ..config import RoutingConfig

__all__ = ["BlockFamily", "FAMILIES"]


def _softmax_renorm(r) -> RoutingConfig:
    return RoutingConfig(top_k=int(r.top_k), scoring="softmax", renormalize=True)


def _softmax_norm_topk(r) -> RoutingConfig:
    return RoutingConfig(top_k=int(r.top_k), scoring="softmax", renormalize=bool(r.norm_topk_prob))


def _softmax_no_renorm(r) -> RoutingConfig:
    return RoutingConfig(top_k=int(r.top_k), scoring="softmax", renormalize=False)


def _sigmoid_renorm(r) -> RoutingConfig:
    return RoutingConfig(top_k=int(r.top_k), scoring="sigmoid", renormalize=True)


def _sigmoid_renorm_scaled(r) -> RoutingConfig:
    """HunYuan-V3: sigmoid, renormalised, times router_scaling_factor."""
    return RoutingConfig(top_k=int(r.top_k), scoring="sigmoid", renormalize=True,
                         routed_scaling_factor=float(r.router_scaling_factor))


def _sigmoid_renorm_uncapped(r) -> RoutingConfig:
    """Laguna: sigmoid, renormalised; its optional tanh softcap of the logits is not reproduced."""
    if r.router_logit_softcapping > 0.0:
        raise ValueError(f"router logit softcapping ({r.router_logit_softcapping}) is not reproduced by moekit")
    return _sigmoid_renorm(r)


def _softmax_biased_renorm(r) -> RoutingConfig:
    """Ernie-4.5: softmax in fp32, the selection bias added to the probabilities, renormalised."""
    return RoutingConfig(top_k=int(r.top_k), scoring="softmax", renormalize=True)


def _topk_first(r) -> RoutingConfig:
    """Cohere2-MoE: top-k on the raw logits, then softmax over the k, or their sigmoids
    renormalised when norm_topk_prob."""
    if r.expert_selection_fn == "softmax":
        return RoutingConfig(top_k=int(r.top_k), order="topk_then_softmax")
    if r.expert_selection_fn == "sigmoid":
        return RoutingConfig(top_k=int(r.top_k), order="topk_then_sigmoid", renormalize=bool(r.norm_topk_prob))
    raise ValueError(f"expert_selection_fn={r.expert_selection_fn!r} is not reproduced by moekit (softmax, sigmoid)")


def _shared_summed(block: nn.Module) -> Optional[str]:
    """Cohere2-MoE adds its shared experts' output ("sum") or averages the two ("average")."""
    if getattr(block, "shared_experts", None) is not None and block.shared_expert_combination_strategy != "sum":
        return (f"shared_expert_combination_strategy={block.shared_expert_combination_strategy!r} is not "
                "reproduced by moekit (it adds the shared experts' output: 'sum')")
    return None


def _grouped_sigmoid(r) -> RoutingConfig:
    return RoutingConfig(
        top_k=int(r.top_k), scoring="sigmoid", renormalize=bool(r.norm_topk_prob),
        num_expert_group=int(r.num_group), topk_group=int(r.topk_group), group_score="top2_sum",
        routed_scaling_factor=float(r.routed_scaling_factor),
    )


def _softmax_scaled(r) -> RoutingConfig:
    """DeepSeek-V2: softmax in fp32, no renormalisation, times routed_scaling_factor; its
    "group_limited_greedy" keeps the topk_group groups of the highest score (ROUTING.md 5, V2)."""
    groups = {}
    if r.topk_method == "group_limited_greedy":
        groups = dict(num_expert_group=int(r.num_group), topk_group=int(r.topk_group), group_score="max")
    elif r.topk_method != "greedy":
        raise ValueError(f"topk_method={r.topk_method!r} is not reproduced by moekit (greedy, group_limited_greedy)")
    return RoutingConfig(top_k=int(r.top_k), scoring="softmax", renormalize=False,
                         routed_scaling_factor=float(r.routed_scaling_factor), **groups)


def _topk_softmax(r) -> RoutingConfig:
    return RoutingConfig(top_k=int(r.top_k), order="topk_then_softmax")


@dataclass(frozen=True)
class BlockFamily:
    """One transformers sparse-MoE block structure that moekit reproduces exactly.

    Fields:
        name: the model_type it comes from.  module: its transformers module name.
        block, router_cls, shared_cls: class names of the block, its router and shared MLP.
        router: attribute of the router in the block.  routing: router module -> RoutingConfig.
        router_dtype: the router logits' dtype (None: the input's).
        router_bias: the router owns a bias [E].
        correction_bias: the name, within the block, of the selection bias [E]
            ("gate.e_score_correction_bias"), or None.
        correction_bias_2d: the family stores that bias as [1, E] (Ernie-4.5).
        shared / shared_gate: attributes of the shared MLP and of its Linear(H, 1) sigmoid gate
            (a shared attribute holding None: that block has no shared experts).
        output_scale: the block attribute scaling the routed output before the shared experts
            are added (Laguna), or None.
        refuse: block -> why moekit cannot reproduce this instance (a setting the code
            branches on), or None.
        returns_scores: forward returns (hidden, router_scores [T, k]) rather than hidden.
        legacy_block: the block's name in older checkpoints (Mixtral: "block_sparse_moe").
    """

    name: str
    module: str
    block: str
    router_cls: str
    router: str
    routing: Callable[[nn.Module], RoutingConfig]
    router_dtype: Optional[torch.dtype] = None
    router_bias: bool = False
    correction_bias: Optional[str] = None
    correction_bias_2d: bool = False
    shared_cls: Optional[str] = None
    shared: Optional[str] = None
    shared_gate: Optional[str] = None
    output_scale: Optional[str] = None
    refuse: Optional[Callable[[nn.Module], Optional[str]]] = None
    returns_scores: bool = False
    legacy_block: Optional[str] = None


FAMILIES: Tuple[BlockFamily, ...] = (
    BlockFamily("mixtral", "mixtral", "MixtralSparseMoeBlock", "MixtralTopKRouter", "gate", _softmax_renorm,
                legacy_block="block_sparse_moe"),
    BlockFamily("qwen2_moe", "qwen2_moe", "Qwen2MoeSparseMoeBlock", "Qwen2MoeTopKRouter", "gate", _softmax_norm_topk,
                shared_cls="Qwen2MoeMLP", shared="shared_expert", shared_gate="shared_expert_gate"),
    BlockFamily("qwen3_moe", "qwen3_moe", "Qwen3MoeSparseMoeBlock", "Qwen3MoeTopKRouter", "gate", _softmax_norm_topk),
    BlockFamily("olmoe", "olmoe", "OlmoeSparseMoeBlock", "OlmoeTopKRouter", "gate", _softmax_norm_topk),
    BlockFamily("deepseek_v3", "deepseek_v3", "DeepseekV3MoE", "DeepseekV3TopkRouter", "gate", _grouped_sigmoid,
                router_dtype=torch.float32, correction_bias="gate.e_score_correction_bias", shared_cls="DeepseekV3MLP",
                shared="shared_experts"),
    BlockFamily("minimax_m2", "minimax_m2", "MiniMaxM2SparseMoeBlock", "MiniMaxM2TopKRouter", "gate", _sigmoid_renorm,
                correction_bias="e_score_correction_bias", legacy_block="block_sparse_moe"),
    BlockFamily("jamba", "jamba", "JambaSparseMoeBlock", "JambaTopKRouter", "router", _softmax_no_renorm),
    BlockFamily("hy_v3", "hy_v3", "HYV3MoE", "HYV3TopKRouter", "gate", _sigmoid_renorm_scaled,
                router_dtype=torch.float32, correction_bias="e_score_correction_bias", shared_cls="HYV3MLP",
                shared="shared_experts"),
    BlockFamily("laguna", "laguna", "LagunaSparseMoeBlock", "LagunaTopKRouter", "gate", _sigmoid_renorm_uncapped,
                correction_bias="gate.e_score_correction_bias", shared_cls="LagunaMLP", shared="shared_experts",
                output_scale="routed_scaling_factor"),
    # DeepSeek-V3's routing without shared experts / with its router forced to fp32 under autocast
    BlockFamily("mimo_v2_flash", "mimo_v2_flash", "MiMoV2FlashMoE", "MiMoV2FlashTopkRouter", "gate", _grouped_sigmoid,
                router_dtype=torch.float32, correction_bias="gate.e_score_correction_bias"),
    BlockFamily("minicpm5_moe", "minicpm5_moe", "MiniCPM5MoeMoE", "MiniCPM5MoeTopkRouter", "gate", _grouped_sigmoid,
                router_dtype=torch.float32, correction_bias="gate.e_score_correction_bias",
                shared_cls="MiniCPM5MoeMLP", shared="shared_experts"),
    BlockFamily("ernie4_5_moe", "ernie4_5_moe", "Ernie4_5_MoeSparseMoeBlock", "Ernie4_5_MoeTopKRouter", "gate",
                _softmax_biased_renorm, router_dtype=torch.float32,
                correction_bias="gate.moe_statics.e_score_correction_bias", correction_bias_2d=True,
                shared_cls="Ernie4_5_MoeMLP", shared="shared_experts"),
    BlockFamily("cohere2_moe", "cohere2_moe", "Cohere2MoeSparseMoeBlock", "Cohere2MoeTopKRouter", "gate", _topk_first,
                shared_cls="Cohere2MoeMLP", shared="shared_experts", refuse=_shared_summed),
    BlockFamily("granitemoe", "granitemoe", "GraniteMoeMoE", "GraniteMoeTopKRouter", "router", _topk_softmax),
    BlockFamily("lara_mini", "lara_mini", "LaraMiniSparseMoeBlock", "LaraMiniTopKRouter", "gate", _softmax_norm_topk,
                router_dtype=torch.float32, shared_cls="LaraMiniMLP", shared="shared_expert"),
    BlockFamily("deepseek_v2", "deepseek_v2", "DeepseekV2Moe", "DeepseekV2TopkRouter", "gate", _softmax_scaled,
                router_dtype=torch.float32, shared_cls="DeepseekV2MLP", shared="shared_experts"),
    BlockFamily("gpt_oss", "gpt_oss", "GptOssMLP", "GptOssTopKRouter", "router", _topk_softmax,
                router_bias=True, returns_scores=True),
)

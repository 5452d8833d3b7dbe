"""Tiny transformers *ForCausalLM models of the families whole-block replacement reproduces (hidden 64, 2 layers, 4 heads,
vocab 128) with seeded random weights, and tie-free prompts for bf16 comparisons."""

import torch
from transformers import AutoConfig, AutoModelForCausalLM

FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v2", "deepseek_v3", "minimax_m2", "jamba",
            "hy_v3", "laguna", "lara_mini", "mimo_v2_flash", "minicpm5_moe", "granitemoe", "ernie4_5_moe", "cohere2_moe",
            "gpt_oss")
ROPE = {"rope_type": "default", "rope_theta": 10000.0}
COMMON = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
              max_position_embeddings=128, bos_token_id=0, eos_token_id=1, pad_token_id=2)
CONFIGS = {
    "mixtral": dict(intermediate_size=32, num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(intermediate_size=96, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                      num_experts=4, num_experts_per_tok=2, norm_topk_prob=False),
    "qwen3_moe": dict(intermediate_size=96, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                      norm_topk_prob=True, head_dim=16),
    "olmoe": dict(intermediate_size=32, num_experts=4, num_experts_per_tok=2),
    "deepseek_v2": dict(intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
                        topk_method="group_limited_greedy", n_group=4, topk_group=2, n_shared_experts=1,
                        first_k_dense_replace=0, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8,
                        qk_nope_head_dim=8, v_head_dim=16, routed_scaling_factor=2.5, rope_parameters=ROPE),
    "deepseek_v3": dict(intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
                        n_group=4, topk_group=2, n_shared_experts=1, first_k_dense_replace=0, q_lora_rank=32,
                        kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                        routed_scaling_factor=2.5, rope_parameters=ROPE),
    "minimax_m2": dict(intermediate_size=32, num_local_experts=8, num_experts_per_tok=2, head_dim=16),
    # attention in layer 1, mamba (its torch path) in layer 0, experts in both
    "jamba": dict(intermediate_size=32, num_experts=4, num_experts_per_tok=2, attn_layer_period=2, attn_layer_offset=1,
                  expert_layer_period=1, expert_layer_offset=0, mamba_d_state=4, mamba_dt_rank=8, mamba_expand=2,
                  use_mamba_kernels=False),
    "hy_v3": dict(intermediate_size=96, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                  num_shared_experts=1, router_scaling_factor=2.5, head_dim=16, mlp_layer_types=["sparse", "sparse"]),
    "laguna": dict(intermediate_size=96, moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=8,
                   num_experts_per_tok=2, head_dim=16, moe_routed_scaling_factor=2.0,
                   layer_types=["full_attention"] * 2, mlp_layer_types=["sparse", "sparse"]),
    "lara_mini": dict(moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=8, num_experts_per_tok=2,
                      head_dim=16, layer_types=["full_attention"] * 2),
    "mimo_v2_flash": dict(intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
                          n_group=4, topk_group=2, routed_scaling_factor=2.5, head_dim=16,
                          layer_types=["full_attention", "sliding_attention"], mlp_layer_types=["sparse", "sparse"]),
    "minicpm5_moe": dict(intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
                         n_group=4, topk_group=2, n_shared_experts=1, routed_scaling_factor=2.5, head_dim=16,
                         mlp_layer_types=["sparse", "sparse"]),
    "granitemoe": dict(intermediate_size=32, num_local_experts=4, num_experts_per_tok=2),
    "ernie4_5_moe": dict(intermediate_size=96, moe_intermediate_size=32, moe_num_experts=8, moe_k=2,
                         moe_num_shared_experts=1, moe_layer_start_index=0, moe_layer_interval=1, head_dim=16),
    # top-k then sigmoid, renormalised, with shared experts summed
    "cohere2_moe": dict(intermediate_size=32, num_experts=8, num_experts_per_tok=2, num_shared_experts=1,
                        shared_expert_combination_strategy="sum", expert_selection_fn="sigmoid", head_dim=16,
                        layer_types=["sliding_attention", "full_attention"], mlp_layer_types=["sparse", "sparse"]),
    "gpt_oss": dict(intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, head_dim=16, sliding_window=8,
                    layer_types=["sliding_attention", "full_attention"], rope_parameters=ROPE),
    # structural clones of those families (same block/router/shared code)
    "minimax": dict(intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, head_dim=16),
    "glm4_moe": dict(intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
                     n_group=2, topk_group=1, n_shared_experts=1, first_k_dense_replace=0, head_dim=16),
    # not reproducible by whole-block replacement
    "phimoe": dict(intermediate_size=32, num_local_experts=4, num_experts_per_tok=2),
}
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def build(family: str, dtype=torch.float32, seed: int = 0, **overrides):
    """A tiny eager-experts model with weights drawn from a seeded generator."""
    config = AutoConfig.for_model(family, **{**COMMON, **CONFIGS[family], **overrides})
    gen = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, experts_implementation="eager")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.copy_(torch.randn(p.shape, generator=gen) * (p.shape[-1] ** -0.5 if p.dim() > 1 else 0.2))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=gen) * 0.05)
    return model.to(dtype).eval()


def _routers(model):
    return [m for n, m in model.named_modules() if n.endswith((".gate", ".router")) and hasattr(m, "top_k")]


def routing_margin(model, ids) -> float:
    """Smallest gap, over tokens and MoE layers, between the k-th and (k+1)-th selection score
    of the eager model (and between kept and dropped groups for grouped routing), in units
    comparable to logits. A small margin means a near-tie that rounding could flip."""
    captured = []
    # a selection bias lives on the router or is passed to it by its block (MiniMax-M2, HunYuan-V3)
    hooks = [r.register_forward_hook(lambda mod, i, o: captured.append(
        (mod, o[0].float(), i[1] if len(i) > 1 else getattr(mod, "e_score_correction_bias", None))))
        for r in _routers(model)]
    with torch.no_grad():
        model(ids)
    for h in hooks:
        h.remove()
    margin = float("inf")
    for router, logits, bias in captured:
        k = router.top_k
        c = logits
        if bias is not None:  # sigmoid + bias (DeepSeek-V3 also in groups)
            c = (logits.sigmoid() + bias.float()) * 4  # sigmoid' <= 1/4
            G, g = getattr(router, "num_group", 1), getattr(router, "topk_group", 1)
            grp = c.view(c.shape[0], G, -1).topk(2, dim=-1).values.sum(-1).sort(dim=-1, descending=True).values
            if g < G:
                margin = min(margin, (grp[:, g - 1] - grp[:, g]).min().item())
            keep = c.view(c.shape[0], G, -1).topk(2, dim=-1).values.sum(-1).topk(g, dim=-1).indices
            mask = torch.zeros(c.shape[0], G, dtype=torch.bool).scatter_(1, keep, True)
            c = c.masked_fill(~mask.repeat_interleave(c.shape[1] // G, dim=1), float("-inf"))
        s = c.sort(dim=-1, descending=True).values
        gap = s[:, k - 1] - s[:, k]
        margin = min(margin, gap[torch.isfinite(gap)].min().item())
    return margin


def tie_free_prompt(model, batch: int = 2, length: int = 12, min_margin: float = 0.05, tries: int = 50):
    """Random ids [batch, length] whose eager routing has no near-tie (see routing_margin)."""
    for seed in range(tries):
        ids = torch.randint(3, 128, (batch, length), generator=torch.Generator().manual_seed(seed))
        if routing_margin(model, ids) > min_margin:
            return ids
    raise AssertionError(f"no prompt with routing margin > {min_margin} in {tries} tries")


def greedy(model, ids, n: int = 16):
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=2)

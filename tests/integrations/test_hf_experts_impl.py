"""The "moekit" experts implementation registered with transformers: whole tiny models of the
families against transformers eager, standalone experts layouts, weight caching and refusals."""

import types

import pytest
import torch
import torch.nn as nn

pytest.importorskip("transformers")

from transformers.activations import ACT2FN  # noqa: E402
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, use_experts_implementation  # noqa: E402

import moekit  # noqa: E402, F401  (registers "moekit")
from moekit.integrations.transformers import experts_layout, prepared_weights  # noqa: E402

from conftest import rel_err  # noqa: E402
from hf_tiny_models import FAMILIES, TOL, build, greedy, tie_free_prompt  # noqa: E402


def _experts_modules(model):
    return [m for m in model.modules() if hasattr(m, "has_gate") and hasattr(m, "down_proj")]


def test_import_moekit_registers_the_implementation():
    assert "moekit" in ALL_EXPERTS_FUNCTIONS


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_eager(family, dtype):
    model = build(family, dtype)
    ids = tie_free_prompt(model, length=8, min_margin=0.02)
    with torch.no_grad():
        ref = model(ids).logits
        model.set_experts_implementation("moekit")
        out = model(ids).logits
    assert all("_moekit_layout" in m.__dict__ for m in _experts_modules(model)), "moekit path was not taken"
    assert rel_err(out, ref) <= TOL[dtype]


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generation_identical_fp32(family):
    model = build(family, seed=1)
    ids = tie_free_prompt(model, batch=1, length=6, min_margin=1e-3)
    ref = greedy(model, ids)
    model.set_experts_implementation("moekit")
    assert torch.equal(greedy(model, ids), ref)


def test_from_pretrained_with_experts_implementation(tmp_path):
    from transformers import AutoModelForCausalLM

    model = build("qwen2_moe")
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, experts_implementation="moekit").eval()
    assert loaded.config._experts_implementation == "moekit"
    ids = tie_free_prompt(model, length=8, min_margin=1e-3)
    with torch.no_grad():
        assert rel_err(loaded(ids).logits, model(ids).logits) <= 1e-5


def test_canonical_layout_is_used_in_place():
    experts = build("mixtral").model.layers[0].mlp.experts
    w = prepared_weights(experts, experts_layout(experts))
    assert w.w13 is experts.gate_up_proj and w.w2 is experts.down_proj
    # one object while the module holds these tensors, so what backends derive from it lives on
    assert prepared_weights(experts, experts_layout(experts)) is w


def test_decode_through_moekit_follows_in_place_weight_edits():
    """The held weights object outlives calls: an edit in place shows in the next decode step."""
    model = build("mixtral").eval()
    experts = model.model.layers[0].mlp.experts
    ids = torch.tensor([[3, 1, 4]])
    with torch.no_grad():
        model.set_experts_implementation("moekit")
        before = model(ids).logits
        experts.down_proj.mul_(-2.0)
        experts.gate_up_proj.add_(0.01)
        after = model(ids).logits
        model.set_experts_implementation("eager")
        ref = model(ids).logits
    assert not torch.equal(before, after)
    assert rel_err(after, ref) <= 1e-4


def test_repacked_layout_is_cached_and_invalidated():
    """gpt-oss stores gate_up transposed and interleaved: repacked once, refreshed on change."""
    model = build("gpt_oss")
    experts = model.model.layers[0].mlp.experts
    layout = experts_layout(experts)
    assert layout.transposed and layout.interleaved and layout.bias and layout.activation == "swigluoai"
    with torch.no_grad():
        first = prepared_weights(experts, layout)
        assert prepared_weights(experts, layout) is first
        E, H, I2 = experts.gate_up_proj.shape
        for e in (0, E - 1):  # gate = even columns, up = odd columns, transposed
            assert torch.equal(first.w13[e, : I2 // 2], experts.gate_up_proj[e, :, 0::2].t())
            assert torch.equal(first.w13[e, I2 // 2:], experts.gate_up_proj[e, :, 1::2].t())
            assert torch.equal(first.w2[e], experts.down_proj[e].t())
        experts.gate_up_proj.mul_(0.5)  # in-place edit bumps _version
        second = prepared_weights(experts, layout)
        assert second is not first and torch.equal(second.w13, first.w13 * 0.5)
        experts.down_proj.data = experts.down_proj.data.clone() * 2  # new storage
        third = prepared_weights(experts, layout)
        assert third is not second and torch.equal(third.w2, second.w2 * 2)
    ids = tie_free_prompt(model, length=6, min_margin=1e-3)
    with torch.no_grad():  # the edited weights reach the output
        ref = model(ids).logits
        model.set_experts_implementation("moekit")
        assert rel_err(model(ids).logits, ref) <= 1e-5


def test_gradients_reach_the_original_parameters():
    experts = build("gpt_oss").model.layers[0].mlp.experts
    experts.config._experts_implementation = "moekit"
    x = torch.randn(5, 64)
    ids = torch.randint(0, 4, (5, 2))
    w = torch.rand(5, 2)
    experts(x, ids, w).square().sum().backward()
    assert experts.gate_up_proj.grad is not None and experts.gate_up_proj.grad.abs().sum() > 0


def _standalone(cls_path, config_path, **cfg):
    import importlib

    mod = importlib.import_module(cls_path[0])
    cmod = importlib.import_module(config_path[0])
    config = getattr(cmod, config_path[1])(**cfg)
    torch.manual_seed(0)
    module = getattr(mod, cls_path[1])(config)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.2)
    return module, config


@pytest.mark.parametrize("case", [
    # transposed, concatenated, no bias
    (("transformers.models.aria.modeling_aria", "AriaExperts"),
     ("transformers.models.aria.configuration_aria", "AriaTextConfig"),
     dict(hidden_size=64, intermediate_size=32, moe_num_experts=4)),
    # non-gated relu^2
    (("transformers.models.nemotron_h.modeling_nemotron_h", "NemotronHExperts"),
     ("transformers.models.nemotron_h.configuration_nemotron_h", "NemotronHConfig"),
     dict(hidden_size=64, moe_intermediate_size=32, n_routed_experts=4, mlp_hidden_act="relu2")),
    # transposed, concatenated swigluoai with biases
    (("transformers.models.openai_privacy_filter.modeling_openai_privacy_filter", "OpenAIPrivacyFilterExperts"),
     ("transformers.models.openai_privacy_filter.configuration_openai_privacy_filter", "OpenAIPrivacyFilterConfig"),
     dict(hidden_size=64, intermediate_size=32, num_local_experts=4)),
    # act_fn is the function F.silu, not a module (used to be refused as "activation function")
    (("transformers.models.lfm2_moe.modeling_lfm2_moe", "Lfm2MoeExperts"),
     ("transformers.models.lfm2_moe.configuration_lfm2_moe", "Lfm2MoeConfig"),
     dict(hidden_size=64, moe_intermediate_size=32, num_experts=4)),
    # SwiGLU with gpt-oss's clamps and no alpha / +1 ("swiglu_limit"); limits the values cross
    (("transformers.models.deepseek_v4.modeling_deepseek_v4", "DeepseekV4Experts"),
     ("transformers.models.deepseek_v4.configuration_deepseek_v4", "DeepseekV4Config"),
     dict(hidden_size=64, intermediate_size=32, num_local_experts=4, swiglu_limit=0.5)),
    (("transformers.models.glm5_next.modeling_glm5_next", "Glm5NextTextExperts"),
     ("transformers.models.glm5_next.configuration_glm5_next", "Glm5NextTextConfig"),
     dict(hidden_size=64, moe_intermediate_size=32, num_local_experts=4, swiglu_limit=0.5)),
    (("transformers.models.hy_v4.modeling_hy_v4", "HYV4Experts"),
     ("transformers.models.hy_v4.configuration_hy_v4", "HYV4Config"),
     dict(hidden_size=64, moe_intermediate_size=32, num_local_experts=4, swiglu_limit=0.5)),
    # swigluoai concatenated, its alpha and limit under other names
    (("transformers.models.minimax_m3_vl.modeling_minimax_m3_vl", "MiniMaxM3VLExperts"),
     ("transformers.models.minimax_m3_vl.configuration_minimax_m3_vl", "MiniMaxM3VLTextConfig"),
     dict(hidden_size=64, intermediate_size=32, num_local_experts=4, swiglu_alpha=1.3, swiglu_limit=0.5)),
    # the default gate computed in fp32
    (("transformers.models.beam.modeling_beam", "BeamExperts"),
     ("transformers.models.beam.configuration_beam", "BeamConfig"),
     dict(hidden_size=64, moe_intermediate_size=32, num_experts=4)),
], ids=["aria-transposed", "nemotron_h-non-gated", "privacy_filter-transposed-bias", "lfm2_moe-functional-silu",
        "deepseek_v4-swiglu_limit", "glm5_next-swiglu_limit", "hy_v4-swiglu_limit", "minimax_m3-swigluoai-named",
        "beam-fp32-gate"])
def test_other_experts_layouts_match_eager(case):
    try:
        module, config = _standalone(*case[:2], **case[2])
    except (ImportError, AttributeError):
        pytest.skip(f"{case[0][1]} is not in this transformers version")
    if not hasattr(module, "has_gate"):
        pytest.skip(f"{case[0][1]} does not use the experts interface in this transformers version")
    T = 11
    x = torch.randn(T, 64)
    ids = torch.stack([torch.randperm(4)[:2] for _ in range(T)])
    ids[:, 0] = ids[:, 0].clamp(max=2)  # expert 3 may still get tokens; experts 0..2 surely do
    w = torch.rand(T, 2)
    with torch.no_grad():
        config._experts_implementation = "eager"
        ref = module(x, ids, w)
        config._experts_implementation = "moekit"
        out = module(x, ids, w)
    assert rel_err(out, ref) <= 1e-5


def _toy_experts(act="silu", custom_gate=None):
    """A tiny experts module decorated with transformers' interface, dispatching to "moekit"."""

    class ToyExperts(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.num_experts = 4
            self.gate_up_proj = nn.Parameter(torch.randn(4, 16, 8))
            self.down_proj = nn.Parameter(torch.randn(4, 8, 8))
            self.act_fn = ACT2FN[config.hidden_act] if isinstance(config.hidden_act, str) else config.hidden_act

        def forward(self, hidden_states, top_k_index, top_k_weights):
            raise AssertionError("eager forward is not used here")

    if custom_gate is not None:
        ToyExperts._apply_gate = custom_gate
    cls = use_experts_implementation(ToyExperts)
    return cls(types.SimpleNamespace(hidden_act=act, _experts_implementation="moekit"))


@pytest.mark.parametrize("family,cls", [("step3p7", "Step3p7Experts"), ("bailing_hybrid", "BailingHybridExperts")])
@pytest.mark.parametrize("layer,activation", [(0, "swiglustep"), (1, "silu")], ids=["limited", "limit-0-disabled"])
def test_clamp_after_the_silu_matches_eager(family, cls, layer, activation):
    """Step-3.7 / Bailing-hybrid clamp silu(gate) and up by a per-layer limit (0: none)."""
    import importlib

    try:
        experts_cls = getattr(importlib.import_module(f"transformers.models.{family}.modeling_{family}"), cls)
    except (ImportError, AttributeError):
        pytest.skip(f"{cls} is not in this transformers version")
    config = types.SimpleNamespace(num_local_experts=4, hidden_size=64, moe_intermediate_size=32, hidden_act="silu",
                                   swiglu_limits=[0.5, 0], limit_after_act=True, _experts_implementation="eager")
    torch.manual_seed(0)
    module = experts_cls(config, layer)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.2)
    x, w = torch.randn(9, 64), torch.rand(9, 2)
    ids = torch.stack([torch.randperm(4)[:2] for _ in range(9)])
    with torch.no_grad():
        ref = module(x, ids, w)
        config._experts_implementation = "moekit"
        out = module(x, ids, w)
    assert experts_layout(module).activation == activation
    assert rel_err(out, ref) <= 1e-5


def test_deepseek_v4_gate_with_another_act_fn_is_refused():
    """DeepSeek-V4's gate applies act_fn where moekit's swiglu_limit has SiLU."""
    try:
        module, config = _standalone(("transformers.models.deepseek_v4.modeling_deepseek_v4", "DeepseekV4Experts"),
                                     ("transformers.models.deepseek_v4.configuration_deepseek_v4", "DeepseekV4Config"),
                                     hidden_size=64, intermediate_size=32, num_local_experts=4, hidden_act="gelu")
    except (ImportError, AttributeError):
        pytest.skip("DeepseekV4Experts is not in this transformers version")
    config._experts_implementation = "moekit"
    with pytest.raises(ValueError, match=r"DeepseekV4Experts\._apply_gate with act_fn GELUActivation: moekit's "
                                         r"swiglu_limit takes SiLU"):
        module(torch.randn(3, 64), torch.zeros(3, 1, dtype=torch.long), torch.ones(3, 1))


@pytest.mark.parametrize("kind, match", [
    ("post_norm", r"ToyExperts: a norm after each expert"),
    ("custom_gate", r"ToyExperts\._apply_gate is a custom gate"),
    ("activation", r"ToyExperts: activation QuickGELUActivation"),
    ("function", r"ToyExperts: activation tanh in the gated act\(gate\) \* up form"),
    ("expert_parallel", r"ToyExperts: transformers' own expert parallelism"),
])
def test_unreproducible_experts_are_refused_by_name(kind, match):
    if kind == "custom_gate":
        module = _toy_experts(custom_gate=lambda self, gu: torch.tanh(gu[..., :8]) * gu[..., 8:])
    elif kind == "activation":
        module = _toy_experts(act="quick_gelu")
    elif kind == "function":
        module = _toy_experts(act=torch.tanh)
    else:
        module = _toy_experts()
        setattr(module, "has_post_expert_norm" if kind == "post_norm" else "_is_expert_parallel", True)
    with pytest.raises(ValueError, match=match):
        module(torch.randn(3, 8), torch.zeros(3, 1, dtype=torch.long), torch.ones(3, 1))


def test_transposed_experts_built_under_inference_mode():
    """Repacked (transposed) weights made under torch.inference_mode have no version counter: the
    repack is rebuilt each call instead of raising, and an in-place write is seen."""
    case = (("transformers.models.aria.modeling_aria", "AriaExperts"),
            ("transformers.models.aria.configuration_aria", "AriaTextConfig"))
    try:
        with torch.inference_mode():
            experts, config = _standalone(*case, hidden_size=64, intermediate_size=32, moe_num_experts=4)
    except (ImportError, AttributeError):
        pytest.skip("Aria is not in this transformers version")
    if not hasattr(experts, "has_gate"):
        pytest.skip("Aria's experts do not use the experts interface in this transformers version")
    x, ids, w = torch.randn(5, 64), torch.stack([torch.randperm(4)[:2] for _ in range(5)]), torch.rand(5, 2)
    with torch.inference_mode():
        for _ in range(2):  # the second call after an in-place write
            config._experts_implementation = "eager"
            ref = experts(x, ids, w)
            config._experts_implementation = "moekit"
            assert rel_err(experts(x, ids, w), ref) <= 1e-5
            experts.down_proj.mul_(2.0)

"""moekit.hf.patch_model: whole sparse-MoE blocks replaced by FusedMoE, against transformers eager."""

import copy

import pytest
import torch

pytest.importorskip("transformers")

import moekit.hf as mh  # noqa: E402
from moekit import FusedMoE  # noqa: E402

from conftest import rel_err  # noqa: E402
from hf_tiny_models import FAMILIES, TOL, build, greedy, tie_free_prompt  # noqa: E402


_BLOCK = {"jamba": "feed_forward", "granitemoe": "block_sparse_moe"}  # the sparse-MoE block's name in a decoder layer, where not "mlp"


def _patched(model, **kw):
    twin = copy.deepcopy(model)
    names = mh.patch_model(twin, **kw)
    return twin, names


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_eager(family, dtype):
    model = build(family, dtype)
    patched, names = _patched(model)
    assert names == [f"model.layers.{i}.{_BLOCK.get(family, 'mlp')}" for i in (0, 1)]
    assert all(isinstance(patched.get_submodule(n), mh.MoEBlock) for n in names)
    ids = tie_free_prompt(model, length=8, min_margin=0.02)
    with torch.no_grad():
        assert rel_err(patched(ids).logits, model(ids).logits) <= TOL[dtype]


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generation_identical_fp32(family):
    model = build(family, seed=2)
    patched, _ = _patched(model)
    ids = tie_free_prompt(model, batch=1, length=6, min_margin=1e-3)
    assert torch.equal(greedy(patched, ids), greedy(model, ids))


@pytest.mark.parametrize("family", FAMILIES)
def test_block_keeps_its_return_contract(family):
    """Each block alone, on T=1 and T=9 tokens: same outputs, same (tuple or tensor) contract."""
    model = build(family)
    name = f"model.layers.1.{_BLOCK.get(family, 'mlp')}"
    block = model.get_submodule(name)
    patched, _ = _patched(model)
    new = patched.get_submodule(name)
    for T in (1, 9):
        x = torch.randn(1, T, 64)
        with torch.no_grad():
            ref, out = block(x), new(x)
        assert type(out) is type(ref)
        if isinstance(ref, tuple):  # gpt-oss: (hidden, router_scores [T, k])
            assert len(out) == len(ref) and out[1].shape == ref[1].shape
            assert torch.allclose(out[1].sort(-1).values, ref[1].sort(-1).values, atol=1e-6)
            out, ref = out[0], ref[0]
        assert out.shape == ref.shape and rel_err(out, ref) <= 1e-5


def test_router_scores_when_the_runner_chunks():
    """gpt-oss returns the routing weights; with several chunks they are recomputed for all T."""
    model = build("gpt_oss")
    block = model.model.layers[0].mlp
    patched, _ = _patched(model)
    new = patched.model.layers[0].mlp
    new.moe.runner.chunk_size = 4
    x = torch.randn(1, 9, 64)
    with torch.no_grad():
        (ref, ref_scores), (out, scores) = block(x), new(x)
    assert scores.shape == ref_scores.shape == (9, 2)
    assert torch.allclose(scores.sort(-1).values, ref_scores.sort(-1).values, atol=1e-6)
    assert rel_err(out, ref) <= 1e-5


def test_zero_tokens():
    model = build("deepseek_v3")
    patched, _ = _patched(model)
    with torch.no_grad():
        out = patched.model.layers[0].mlp(torch.randn(1, 0, 64))
    assert out.shape == (1, 0, 64)


def test_canonical_weights_are_adopted_not_copied():
    model = build("qwen2_moe")
    block = model.model.layers[0].mlp
    mh.patch_model(model)
    moe = model.model.layers[0].mlp.moe
    assert isinstance(moe, FusedMoE)
    assert moe.experts.w13 is block.experts.gate_up_proj and moe.experts.w2 is block.experts.down_proj
    assert moe.gate.weight is block.gate.weight and moe.shared.gate is block.shared_expert_gate.weight
    assert moe.shared.config.gated and moe.shared.config.intermediate_size == 48


def test_family_routing_configs():
    ds = build("deepseek_v3")
    mh.patch_model(ds)
    moe = ds.model.layers[0].mlp.moe
    r = moe.routing
    assert (r.scoring, r.num_expert_group, r.topk_group, r.group_score, r.routed_scaling_factor) == \
        ("sigmoid", 4, 2, "top2_sum", 2.5)
    assert moe.e_score_correction_bias is not None and moe.router_dtype == torch.float32
    oss = build("gpt_oss")
    mh.patch_model(oss)
    moe = oss.model.layers[0].mlp.moe
    assert moe.routing.order == "topk_then_softmax" and moe.activation == "swigluoai"
    assert moe.gate.bias is not None and moe.experts.b13 is not None


@pytest.mark.parametrize("method, groups", [("group_limited_greedy", (4, 2, "max")), ("greedy", (None, None, None))])
def test_deepseek_v2_routing(method, groups):
    """Softmax without renormalisation, times the scaling factor; groups by their best score."""
    model = build("deepseek_v2", topk_method=method)
    patched, _ = _patched(model)
    r = patched.model.layers[0].mlp.moe.routing
    assert (r.scoring, r.renormalize, r.routed_scaling_factor) == ("softmax", False, 2.5)
    assert (r.num_expert_group, r.topk_group, r.group_score) == groups
    ids = tie_free_prompt(model, length=8, min_margin=1e-3)
    with torch.no_grad():
        assert rel_err(patched(ids).logits, model(ids).logits) <= 1e-5
    model.model.layers[0].mlp.gate.topk_method = "noaux_tc"
    with pytest.raises(ValueError, match=r"topk_method='noaux_tc' is not reproduced by moekit"):
        mh.patch_model(model)


@pytest.mark.parametrize("selection", ["softmax", "sigmoid"])
def test_cohere2_selection_and_shared_strategy(selection):
    model = build("cohere2_moe", expert_selection_fn=selection)
    patched, _ = _patched(model)
    r = patched.model.layers[0].mlp.moe.routing
    assert r.order == f"topk_then_{selection}" and r.renormalize
    ids = tie_free_prompt(model, length=8, min_margin=1e-3)
    with torch.no_grad():
        assert rel_err(patched(ids).logits, model(ids).logits) <= 1e-5
    averaged = build("cohere2_moe", shared_expert_combination_strategy="average")
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp \(Cohere2MoeSparseMoeBlock\): "
                                         r"shared_expert_combination_strategy='average' is not reproduced"):
        mh.patch_model(averaged)


def test_ernie_without_shared_experts():
    """Ernie-4.5 builds its shared MLP only when moe_num_shared_experts > 0; its bias is [1, E]."""
    model = build("ernie4_5_moe", moe_num_shared_experts=0)
    patched, _ = _patched(model)
    moe = patched.model.layers[0].mlp.moe
    assert moe.shared is None and moe.e_score_correction_bias.shape == (8,)
    ids = tie_free_prompt(model, length=8, min_margin=1e-3)
    with torch.no_grad():
        assert rel_err(patched(ids).logits, model(ids).logits) <= 1e-5
    state = patched.state_dict()
    assert state["model.layers.0.mlp.gate.moe_statics.e_score_correction_bias"].shape == (1, 8)
    assert not any("shared_experts" in k for k in state)


@pytest.mark.parametrize("family, like", [("minimax", "mixtral"), ("glm4_moe", "deepseek_v3")])
def test_structural_clones_are_recognised(family, like):
    model = build(family)
    assert mh.family_of(model.model.layers[0].mlp).name == like
    patched, _ = _patched(model)
    ids = tie_free_prompt(model, length=8, min_margin=1e-3)
    with torch.no_grad():
        assert rel_err(patched(ids).logits, model(ids).logits) <= 1e-5


def test_unreproducible_block_is_refused_by_name_and_model_unchanged():
    model = build("phimoe")
    before = [type(m) for m in model.modules()]
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp \(PhimoeSparseMoeBlock\): not a block structure"):
        mh.patch_model(model)
    assert [type(m) for m in model.modules()] == before


def test_experts_subclass_overriding_the_interface_forward_is_refused():
    """An experts class that wraps the interface's forward (as Ergo adds a per-expert norm) was
    patched as if it were the plain interface, silently dropping what its forward adds."""
    model = build("mixtral")
    experts = model.model.layers[1].mlp.experts

    class ScaledExperts(type(experts)):
        def forward(self, hidden_states, top_k_index, top_k_weights):
            return 2 * super().forward(hidden_states, top_k_index, top_k_weights)

    experts.__class__ = ScaledExperts
    before = [type(m) for m in model.modules()]
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp \(MixtralSparseMoeBlock\): ScaledExperts overrides"):
        mh.patch_model(model)
    assert [type(m) for m in model.modules()] == before


def test_model_without_moe_is_refused():
    with pytest.raises(ValueError, match="no sparse-MoE block"):
        mh.patch_model(torch.nn.Sequential(torch.nn.Linear(4, 4)))


def test_output_router_logits_is_refused():
    model = build("qwen3_moe", output_router_logits=True)
    with pytest.raises(ValueError, match="output_router_logits"):
        mh.patch_model(model)


def test_bad_backend_name_fails_before_any_change():
    model = build("olmoe")
    with pytest.raises(ValueError, match="backend must be 'auto' or one of"):
        mh.patch_model(model, backend="no-such-backend")
    assert not mh.moe_blocks(model)


def test_explicit_backend_and_repeat_patch():
    model = build("mixtral")
    patched, names = _patched(model, backend="reference")
    assert patched.model.layers[0].mlp.moe.runner.backend == "reference"
    assert mh.patch_model(patched) == []  # already patched: nothing left to do
    ids = tie_free_prompt(model, length=8, min_margin=1e-3)
    with torch.no_grad():
        assert rel_err(patched(ids).logits, model(ids).logits) <= 1e-5


def test_only_the_given_model_changes():
    from transformers.models.mixtral import modeling_mixtral

    forward_before = modeling_mixtral.MixtralSparseMoeBlock.forward
    a, b = build("mixtral"), build("mixtral")
    mh.patch_model(a)
    assert modeling_mixtral.MixtralSparseMoeBlock.forward is forward_before
    assert type(b.model.layers[0].mlp) is modeling_mixtral.MixtralSparseMoeBlock
    assert not mh.moe_blocks(b)


def test_router_jitter_in_training_is_refused():
    model = build("mixtral", router_jitter_noise=0.1)
    mh.patch_model(model)
    model.train()
    with pytest.raises(RuntimeError, match="jitter"):
        model(torch.randint(3, 128, (1, 4)))


def test_eager_graphs_reach_every_patched_layer():
    model = build("qwen2_moe")
    mh.patch_model(model, eager_graphs=6)
    layers = [m for m in model.modules() if isinstance(m, FusedMoE)]
    assert layers and all(m._graphs.max_graphs == 6 for m in layers)

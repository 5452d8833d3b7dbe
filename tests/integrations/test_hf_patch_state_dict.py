"""A patched model's state_dict, save_pretrained and load_state_dict in the replaced blocks'
transformers names and layout: checkpoints that transformers and moekit both read back."""

import copy

import pytest
import torch

pytest.importorskip("transformers")

import moekit.hf as mh  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from conftest import rel_err  # noqa: E402
from hf_tiny_models import FAMILIES, build  # noqa: E402

IDS = torch.randint(3, 128, (2, 7), generator=torch.Generator().manual_seed(0))


def _patched(model):
    twin = copy.deepcopy(model)
    mh.patch_model(twin)
    return twin


def _logits(model):
    with torch.no_grad():
        return model(IDS).logits


@pytest.mark.parametrize("family", [
    "mixtral",  # saved as legacy block_sparse_moe.experts.{e}.w1|w3|w2
    "qwen2_moe",  # shared expert with its sigmoid gate (shared_expert_gate)
    "deepseek_v3",  # e_score_correction_bias, shared experts, per-expert names on save
])
def test_save_pretrained_of_a_patched_model_reloads_in_transformers_and_moekit(family, tmp_path):
    """Regression: save_pretrained wrote moekit's names (mlp.moe.experts.w13, ...), so transformers
    left the experts randomly initialised and moekit.hf.from_pretrained refused the folder."""
    model = build(family)
    patched = _patched(model)
    patched.save_pretrained(tmp_path)
    plain = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert torch.equal(_logits(plain), _logits(model))
    ours = mh.from_pretrained(tmp_path)
    assert torch.equal(_logits(ours), _logits(patched))
    assert rel_err(_logits(ours), _logits(model)) <= 1e-5


@pytest.mark.parametrize("family", FAMILIES)
def test_state_dict_is_the_replaced_blocks_and_loads_back(family):
    """Same names, shapes and values as the unpatched model (gpt-oss: transposed, gate/up
    interleaved, biases), and load_state_dict takes them into another patched model."""
    model = build(family)
    want = model.state_dict()
    got = _patched(model).state_dict()
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert got[name].shape == t.shape and torch.equal(got[name], t), name
    other = _patched(build(family, seed=1))
    assert not torch.equal(_logits(other), _logits(model))
    assert not other.load_state_dict(want).missing_keys
    assert torch.equal(_logits(other), _logits(_patched(model)))


def test_load_state_dict_names_missing_and_misshaped_tensors_by_their_transformers_names():
    model = build("qwen2_moe")
    state = model.state_dict()
    p = "model.layers.0.mlp."
    gone = [p + "experts.down_proj", p + "shared_expert.up_proj.weight"]  # a whole tensor; half of gate_up
    partial = {k: v for k, v in state.items() if k not in gone}
    patched = _patched(model)
    result = patched.load_state_dict(partial, strict=False)
    assert sorted(result.missing_keys) == gone and not result.unexpected_keys
    with pytest.raises(RuntimeError, match=r'Missing key\(s\) in state_dict: "model\.layers\.0\.mlp\.experts\.'
                                           r'down_proj'):
        patched.load_state_dict(partial)
    bad = dict(state)
    bad[p + "experts.gate_up_proj"] = bad[p + "experts.gate_up_proj"][:, :, :-1]
    with pytest.raises(RuntimeError, match=r"size mismatch for model\.layers\.0\.mlp\.experts\.gate_up_proj: copying "
                                           r"a param with shape \(4, 64, 63\) from checkpoint, the shape in current "
                                           r"model is \(4, 64, 64\)"):
        patched.load_state_dict(bad)


def test_state_dict_refuses_a_tensor_without_a_transformers_name():
    """Quantization scales (or EPLB's slots) have no place in the replaced block's checkpoint."""
    patched = _patched(build("mixtral"))
    patched.model.layers[0].mlp.moe.experts.register_buffer("w13_scale", torch.ones(4))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.moe\.experts\.w13_scale has no name in "
                                         r"transformers' layout of the block it replaced \(mixtral\)"):
        patched.state_dict()

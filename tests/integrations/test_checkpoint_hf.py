"""moekit.hf.load_checkpoint / from_pretrained on transformers checkpoints: legacy per-expert
layout (as save_pretrained writes it), stacked 5.x layout, sharded index; and clear errors."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

pytest.importorskip("transformers")

import moekit.hf as mh  # noqa: E402
from moekit.integrations.checkpoint import CheckpointError, load_fused_moe  # noqa: E402

from conftest import rel_err  # noqa: E402
from hf_tiny_models import FAMILIES, build, tie_free_prompt  # noqa: E402


def _same_outputs(loaded, model):
    ids = tie_free_prompt(model, length=8, min_margin=1e-3)
    with torch.no_grad():
        assert rel_err(loaded(ids).logits, model(ids).logits) <= 1e-5


@pytest.mark.parametrize("family", FAMILIES)
def test_save_pretrained_then_moekit_loader(family, tmp_path):
    """transformers 5.x writes Mixtral as block_sparse_moe.experts.{e}.w1/w3/w2, Qwen/OLMoE/DeepSeek as
    experts.{e}.gate_proj/..., gpt-oss stacked, transposed and interleaved; DeepSeek here sharded."""
    model = build(family, seed=3)
    model.save_pretrained(tmp_path, max_shard_size="100KB" if family == "deepseek_v3" else "1GB")
    if family == "deepseek_v3":
        assert (tmp_path / "model.safetensors.index.json").is_file()
    loaded = mh.from_pretrained(tmp_path)
    assert len(mh.moe_blocks(loaded)) == 2
    _same_outputs(loaded, model)


@pytest.mark.parametrize("family", ["qwen2_moe", "deepseek_v3"])
def test_stacked_layout(family, tmp_path):
    """The 5.x in-memory names (experts.gate_up_proj [E, 2I, H], experts.down_proj [E, H, I])."""
    model = build(family, seed=4)
    state = {k: v.clone().contiguous() for k, v in model.state_dict().items()}
    assert any(k.endswith("experts.gate_up_proj") for k in state)
    save_file(state, str(tmp_path / "model.safetensors"))
    model.config.save_pretrained(tmp_path)
    _same_outputs(mh.from_pretrained(tmp_path), model)


def _saved(tmp_path, family="mixtral"):
    model = build(family, seed=5)
    model.save_pretrained(tmp_path)
    return model, tmp_path / "model.safetensors"


def _target(family="mixtral"):
    target = build(family, seed=6)
    mh.patch_model(target)
    return target


def _rewrite(path, edit):
    state = load_file(str(path))
    edit(state)
    save_file(state, str(path))


@pytest.mark.parametrize("edit, match", [
    (lambda s: s.pop("model.layers.1.block_sparse_moe.experts.2.w3.weight"),
     r"missing tensor 'model\.layers\.1\.block_sparse_moe\.experts\.2\.w3\.weight' \(expected shape \[32, 64\]\)"),
    (lambda s: s.pop("model.layers.0.block_sparse_moe.gate.weight"),
     r"missing tensor 'model\.layers\.0\.block_sparse_moe\.gate\.weight' \(expected shape \[4, 64\]\)"),
    (lambda s: s.pop("model.norm.weight"), r"missing tensor 'model\.norm\.weight' \(expected shape \[64\]\)"),
    (lambda s: s.__setitem__("model.layers.0.block_sparse_moe.experts.7.w1.weight", torch.zeros(32, 64)),
     r"unexpected tensor 'model\.layers\.0\.block_sparse_moe\.experts\.7\.w1\.weight'"),
    (lambda s: s.__setitem__("model.extra.weight", torch.zeros(3)), r"unexpected tensor 'model\.extra\.weight'"),
    (lambda s: s.__setitem__("model.layers.0.block_sparse_moe.experts.1.w2.weight", torch.zeros(64, 31)),
     r"'model\.layers\.0\.block_sparse_moe\.experts\.1\.w2\.weight' has shape \[64, 31\], expected \[64, 32\]"),
    (lambda s: s.__setitem__("model.layers.1.self_attn.q_proj.weight", torch.zeros(64, 65)),
     r"'model\.layers\.1\.self_attn\.q_proj\.weight' has shape \[64, 65\], expected \[64, 64\]"),
    (lambda s: s.__setitem__("model.layers.0.block_sparse_moe.gate.weight", torch.zeros(4, 64, dtype=torch.int32)),
     r"'model\.layers\.0\.block_sparse_moe\.gate\.weight' has dtype I32"),
], ids=["missing-expert", "missing-router", "missing-other", "extra-expert", "extra-other", "misshaped-expert",
        "misshaped-other", "int-dtype"])
def test_bad_tensors_are_named_and_nothing_is_loaded(tmp_path, edit, match):
    _, path = _saved(tmp_path)
    _rewrite(path, edit)
    target = _target()
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(CheckpointError, match=match):
        mh.load_checkpoint(target, tmp_path)
    assert all(torch.equal(before[k], v) for k, v in target.state_dict().items())


def test_truncated_file_is_reported(tmp_path):
    _, path = _saved(tmp_path)
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: not a readable safetensors file"):
        mh.load_checkpoint(_target(), tmp_path)


def test_garbage_file_is_reported(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00not json")
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        mh.load_checkpoint(_target(), tmp_path)


def test_sharded_index_problems(tmp_path):
    model = build("olmoe", seed=7)
    model.save_pretrained(tmp_path, max_shard_size="60KB")
    index_path = tmp_path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    key, shard = next(iter(index["weight_map"].items()))
    index["weight_map"][key] = "model-missing.safetensors"
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="model-missing.safetensors"):
        mh.load_checkpoint(_target("olmoe"), tmp_path)


def test_quantized_experts_are_refused(tmp_path):
    model = build("gpt_oss", seed=8)
    state = {k: v.clone().contiguous() for k, v in model.state_dict().items()}
    w = state.pop("model.layers.0.mlp.experts.gate_up_proj")
    state["model.layers.0.mlp.experts.gate_up_proj_blocks"] = w.to(torch.uint8)
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"gate_up_proj_blocks'.*quantized experts"):
        mh.load_checkpoint(_target("gpt_oss"), tmp_path)


def test_from_pretrained_checks_dtype_and_device_before_loading(tmp_path, monkeypatch):
    """dtype="auto" (transformers' habit) used to fail with "module 'torch' has no attribute 'auto'",
    and a bad device only after the whole checkpoint was read."""
    build("olmoe", seed=6).save_pretrained(tmp_path)
    built = []
    monkeypatch.setattr(mh, "patch_model", lambda *a, **kw: built.append(1))
    for dtype in ("auto", torch.int8, "nn", 16):
        with pytest.raises(ValueError, match=r"dtype must be a floating torch.dtype or its name, got"):
            mh.from_pretrained(tmp_path, dtype=dtype)
    with pytest.raises(RuntimeError, match="no_such_device"):
        mh.from_pretrained(tmp_path, device="no_such_device")
    assert built == []
    monkeypatch.undo()
    assert next(mh.from_pretrained(tmp_path, dtype="bfloat16").parameters()).dtype == torch.bfloat16


def test_loading_into_a_meta_model_is_refused(tmp_path):
    """A model built on the meta device used to 'load' every key (copy_ into meta writes nothing)
    and stay on meta, with no error."""
    from transformers import AutoModelForCausalLM

    model = build("mixtral", seed=7)
    model.save_pretrained(tmp_path)
    with torch.device("meta"):
        empty = AutoModelForCausalLM.from_config(model.config)
    mh.patch_model(empty)
    with pytest.raises(CheckpointError, match=r"model.embed_tokens.weight is on the meta device.*to_empty"):
        mh.load_checkpoint(empty, tmp_path)
    layer = mh.moe_blocks(empty)["model.layers.0.mlp"].moe
    with pytest.raises(CheckpointError, match=r"^experts.w13 is on the meta device"):
        load_fused_moe(layer, tmp_path, mh.moe_blocks(empty)["model.layers.0.mlp"].checkpoint_keys("model.layers.0.mlp"))


def test_original_checkpoint_names_are_read_through_transformers_renamings(tmp_path):
    """HunYuan-V3's save_pretrained writes its original names (mlp.router.gate, mlp.expert_bias,
    mlp.shared_mlp); the loader reads them as transformers would, and an error names the tensor
    as read, not every original name."""
    model, path = _saved(tmp_path, "hy_v3")
    keys = load_file(str(path))
    assert any(".mlp.router.gate.weight" in k for k in keys) and any(".mlp.expert_bias" in k for k in keys)
    _same_outputs(mh.from_pretrained(tmp_path), model)
    del keys["model.layers.1.mlp.expert_bias"]
    save_file(keys, str(path))
    with pytest.raises(CheckpointError) as err:
        mh.load_checkpoint(_target("hy_v3"), tmp_path)
    assert "missing tensor 'model.layers.1.mlp.e_score_correction_bias'" in str(err.value)
    assert str(err.value).count("\n") == 1  # that one problem


def test_a_renaming_that_merges_two_tensors_is_refused(tmp_path):
    from moekit.integrations.checkpoint import SafetensorsCheckpoint

    save_file({"a.x": torch.zeros(1), "b.x": torch.zeros(1)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"tensor 'c\.x' appears twice: as 'a\.x' in .* and as 'b\.x' in "):
        SafetensorsCheckpoint(tmp_path, rename=lambda k: "c.x")
    ckpt = SafetensorsCheckpoint(tmp_path, rename=lambda k: k.replace("a.", "z."))
    assert ckpt.keys() == ["b.x", "z.x"] and ckpt.shape("z.x") == (1,) and ckpt.get("z.x").shape == (1,)

"""Quantized checkpoints: moekit's safetensors format round trips, DeepSeek-V3 fp8 block loading."""

import pytest
import torch
from safetensors.torch import save_file

from moekit import FusedMoE, RoutingConfig
from moekit.quant import (
    LAYER_ERROR_BOUND,
    dequantize_weight,
    get_scheme,
    load_deepseek_fp8,
    load_quantized,
    quantize_experts,
    save_quantized,
)

CASES = [("fp8_w8a8", {}), ("fp8_w8a8_channel", {}), ("fp8_w8a8_block128", {}), ("int8_w8a8", {}),
         ("int8_w8a16", dict(group_size=32, symmetric=False)), ("int4_w4a16", {}),
         ("int4_w4a16", dict(group_size=64, symmetric=False))]


def _same(a, b):
    assert a.quant == b.quant
    assert set(a.scales) == set(b.scales)
    for (na, ta), (nb, tb) in zip(sorted(a.per_expert_tensors()), sorted(b.per_expert_tensors())):
        assert na == nb and ta.dtype == tb.dtype and torch.equal(ta.view(torch.uint8), tb.view(torch.uint8))


@pytest.mark.parametrize("name, opts", CASES, ids=[n + "".join(f"-{v}" for v in o.values()) for n, o in CASES])
def test_save_load_round_trip_is_bitwise(name, opts, tmp_path, gen):
    w = quantize_experts(torch.randn(3, 256, 128, generator=gen), torch.randn(3, 128, 128, generator=gen), name,
                         b13=torch.randn(3, 256, generator=gen), b2=torch.randn(3, 128, generator=gen), **opts)
    path = tmp_path / "layer.safetensors"
    save_quantized(path, w)
    _same(load_quantized(path), w)


def test_several_layers_per_file_and_static_scales(tmp_path, gen):
    a = quantize_experts(torch.randn(2, 64, 32, generator=gen), torch.randn(2, 32, 32, generator=gen), "fp8_w8a8",
                         a13_scale=torch.tensor([0.1, 0.2]), a2_scale=torch.tensor([0.3, 0.4]))
    b = quantize_experts(torch.randn(2, 32, 32, generator=gen), torch.randn(2, 32, 32, generator=gen), "int8_w8a8")
    path = tmp_path / "model.safetensors"
    save_quantized(path, {"layers.0.": a, "layers.1.": b})  # layer 1 is non-gated: w13 has I rows
    _same(load_quantized(path, "layers.0."), a)
    _same(load_quantized(path, "layers.1."), b)
    with pytest.raises(ValueError, match=r"no layer with prefix 'layers.2.' \(prefixes: \['layers.0.', 'layers.1.'\]"):
        load_quantized(path, "layers.2.")


def test_tensors_that_share_memory_are_saved(tmp_path, gen):
    """One tensor as both static activation scales, and one layer under two prefixes: safetensors
    refused tensors sharing memory, so save_quantized raised instead of writing them."""
    s = torch.rand(2, generator=gen) + 0.5
    a = quantize_experts(torch.randn(2, 64, 32, generator=gen), torch.randn(2, 32, 32, generator=gen), "fp8_w8a8",
                         a13_scale=s, a2_scale=s)
    b = quantize_experts(torch.randn(2, 64, 64, generator=gen), torch.randn(2, 64, 32, generator=gen), "int4_w4a16",
                         group_size=32, symmetric=False, b13=torch.randn(2, 64, generator=gen))
    path = tmp_path / "shared.safetensors"
    save_quantized(path, {"a.": a, "b.": b, "c.": b})
    _same(load_quantized(path, "a."), a)
    _same(load_quantized(path, "b."), b)
    _same(load_quantized(path, "c."), b)


def test_not_a_moekit_file_or_wrong_version_is_an_error(tmp_path):
    plain = tmp_path / "plain.safetensors"
    save_file({"w13": torch.zeros(1)}, str(plain))
    with pytest.raises(ValueError, match="is not a moekit quantized-experts file"):
        load_quantized(plain)
    old = tmp_path / "old.safetensors"
    save_file({"w13": torch.zeros(1)}, str(old), metadata={"moekit.format": "quantized-experts", "moekit.version": "0"})
    with pytest.raises(ValueError, match="format version '0'"):
        load_quantized(old)


def test_saving_unquantized_or_malformed_weights_is_an_error(tmp_path, gen):
    from moekit.experts.base import ExpertWeights

    with pytest.raises(ValueError, match="must be quantized ExpertWeights"):
        save_quantized(tmp_path / "x.safetensors", ExpertWeights(torch.zeros(1, 4, 4), torch.zeros(1, 4, 2)))
    w = quantize_experts(torch.randn(2, 256, 128, generator=gen), torch.randn(2, 128, 128, generator=gen), "int4_w4a16")
    bad = ExpertWeights(w.w13, w.w2, scales={"w13_scale": w.scales["w13_scale"]}, quant=w.quant)
    with pytest.raises(ValueError, match=r"needs scales\['w2_scale'\]"):
        save_quantized(tmp_path / "x.safetensors", bad)


@pytest.mark.parametrize("b13, b2, error, match", [
    (torch.zeros(2, 3), None, ValueError, r"b13 must have shape \[2, 256\], got \[2, 3\]"),
    (None, torch.zeros(2, 128, dtype=torch.int64), TypeError, r"b2 must be a float tensor, got torch.int64"),
], ids=["b13-wrong-shape", "b2-int64"])
def test_saving_malformed_biases_is_an_error(b13, b2, error, match, tmp_path, gen):
    """Regression: save_quantized wrote biases of the wrong shape or dtype (refused only when run)."""
    from moekit.experts.base import ExpertWeights

    w = quantize_experts(torch.randn(2, 256, 128, generator=gen), torch.randn(2, 128, 128, generator=gen), "int8_w8a8")
    with pytest.raises(error, match=match):
        save_quantized(tmp_path / "x.safetensors", ExpertWeights(w.w13, w.w2, b13, b2, scales=w.scales, quant=w.quant))
    assert not (tmp_path / "x.safetensors").exists()


def test_a_file_with_a_bad_tensor_is_rejected_on_load(tmp_path, gen):
    w = quantize_experts(torch.randn(2, 256, 128, generator=gen), torch.randn(2, 128, 128, generator=gen), "int8_w8a8")
    path = tmp_path / "x.safetensors"
    save_quantized(path, w)
    from safetensors import safe_open
    from safetensors.torch import load_file

    tensors = load_file(str(path))
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
    tensors["scales.w2_scale"] = tensors["scales.w2_scale"][:, :64].contiguous()
    save_file(tensors, str(path), metadata=meta)
    with pytest.raises(ValueError, match=r"scales\['w2_scale'\] must be \[2, 128\]"):
        load_quantized(path)


@pytest.mark.parametrize("name, opts, key, value, match", [
    ("int4_w4a16", dict(symmetric=False), "scales.w13_zero", 16, r"scales\['w13_zero'\] holds 16; int4 zero points"),
    ("int8_w8a16", {}, "scales.w2_scale", float("nan"), r"scales\['w2_scale'\] holds non-finite"),
    ("fp8_w8a8_block128", {}, "scales.w13_scale", float("inf"), r"scales\['w13_scale'\] holds non-finite"),
    ("fp8_w8a8", dict(a13_scale=torch.ones(2), a2_scale=torch.ones(2)), "scales.a2_scale", 0.0,
     r"scales\['a2_scale'\] \(static activation scales\) must be > 0"),
], ids=["int4-zero-16", "nan-scale", "inf-block-scale", "zero-static-scale"])
def test_a_file_with_corrupted_values_is_rejected_on_load(name, opts, key, value, match, tmp_path, gen):
    """Regression: corrupted scales and zero points loaded and ran (NaN outputs, or weights off the int4 grid)."""
    w = quantize_experts(torch.randn(2, 256, 128, generator=gen), torch.randn(2, 128, 128, generator=gen), name, **opts)
    path = tmp_path / "x.safetensors"
    save_quantized(path, w)
    from safetensors import safe_open
    from safetensors.torch import load_file

    tensors = load_file(str(path))
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
    tensors[key].view(-1)[-1] = value
    save_file(tensors, str(path), metadata=meta)
    with pytest.raises(ValueError, match=match):
        load_quantized(path)


# -- DeepSeek-V3 style fp8 block checkpoints -----------------------------------------------

def _fp8_blocks(w):
    """[N, K] float -> (float8_e4m3fn [N, K], weight_scale_inv [N/128, K/128]) by 128x128 blocks."""
    N, K = w.shape
    q = torch.empty(N, K, dtype=torch.float8_e4m3fn)
    s = torch.empty(N // 128, K // 128)
    for i in range(N // 128):
        for j in range(K // 128):
            blk = w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]
            s[i, j] = blk.abs().max() / 448
            q[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128] = (blk / s[i, j]).to(torch.float8_e4m3fn)
    return q, s


def _deepseek_layer(gen, E=3, H=256, I=128, prefix="model.layers.3.mlp.experts"):
    tensors, floats = {}, []
    for e in range(E):
        gate, up, down = (torch.randn(I, H, generator=gen) * H ** -0.5, torch.randn(I, H, generator=gen) * H ** -0.5,
                          torch.randn(H, I, generator=gen) * I ** -0.5)
        floats.append((gate, up, down))
        for proj, w in (("gate_proj", gate), ("up_proj", up), ("down_proj", down)):
            q, s = _fp8_blocks(w)
            tensors[f"{prefix}.{e}.{proj}.weight"] = q
            tensors[f"{prefix}.{e}.{proj}.weight_scale_inv"] = s
    tensors["model.layers.3.mlp.gate.weight"] = torch.randn(E, H, generator=gen)  # unrelated keys are ignored
    return tensors, floats


def test_deepseek_fp8_blocks_stack_into_the_block128_layout(gen):
    tensors, floats = _deepseek_layer(gen)
    w = load_deepseek_fp8(tensors, "model.layers.3.mlp.experts", 3)
    assert w.quant == "fp8_w8a8_block128"
    assert w.w13.shape == (3, 256, 256) and w.w13.dtype == torch.float8_e4m3fn and w.w2.shape == (3, 256, 128)
    assert w.scales["w13_scale"].shape == (3, 2, 2) and w.scales["w2_scale"].shape == (3, 2, 1)
    p = "model.layers.3.mlp.experts.1."
    assert torch.equal(w.w13[1, 128:].view(torch.uint8), tensors[p + "up_proj.weight"].view(torch.uint8))
    assert torch.equal(w.scales["w13_scale"][1, 1], tensors[p + "up_proj.weight_scale_inv"][0])
    s = get_scheme("fp8_w8a8_block128")
    deq13 = dequantize_weight(w.w13, w.scales["w13_scale"], None, s)
    ref13 = torch.stack([torch.cat((g, u)) for g, u, _ in floats])
    assert float((deq13 - ref13).norm() / ref13.norm()) < 0.04


def test_deepseek_layer_from_files_runs_in_a_fused_moe(tmp_path, gen):
    tensors, floats = _deepseek_layer(gen)
    keys = sorted(tensors)
    save_file({k: tensors[k] for k in keys[:len(keys) // 2]}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({k: tensors[k] for k in keys[len(keys) // 2:]}, str(tmp_path / "model-00002-of-00002.safetensors"))
    from_dir = load_deepseek_fp8(tmp_path, "model.layers.3.mlp.experts", 3)
    from_files = load_deepseek_fp8(sorted(tmp_path.iterdir()), "model.layers.3.mlp.experts", 3)
    assert torch.equal(from_dir.w13.view(torch.uint8), from_files.w13.view(torch.uint8))
    moe = FusedMoE(3, 256, 128, RoutingConfig(top_k=2), dtype=torch.bfloat16, quant="fp8_w8a8_block128")
    moe.load_quantized(from_dir)
    ref = FusedMoE(3, 256, 128, RoutingConfig(top_k=2), dtype=torch.bfloat16).requires_grad_(False)
    ref.load_weights(torch.stack([torch.cat((g, u)) for g, u, _ in floats]), torch.stack([d for _, _, d in floats]))
    x, logits = torch.randn(6, 256, generator=gen).to(torch.bfloat16), torch.randn(6, 3, generator=gen)
    out, want = moe(x, logits), ref(x, logits)
    assert float((out.float() - want.float()).norm() / want.float().norm()) <= LAYER_ERROR_BOUND["fp8_w8a8_block128"]


def test_deepseek_loader_errors_name_the_tensor(gen):
    tensors, _ = _deepseek_layer(gen, E=2)
    p = "model.layers.3.mlp.experts"
    with pytest.raises(ValueError, match=r"lacks 'model.layers.3.mlp.experts.2.gate_proj.weight' \(expert 2"):
        load_deepseek_fp8(tensors, p, 3)
    bad = dict(tensors)
    bad[f"{p}.1.down_proj.weight"] = bad[f"{p}.1.down_proj.weight"].float()
    with pytest.raises(TypeError, match=r"down_proj.weight must be float8_e4m3fn, got torch.float32"):
        load_deepseek_fp8(bad, p, 2)
    bad = dict(tensors)
    bad[f"{p}.0.up_proj.weight_scale_inv"] = torch.ones(2, 3)
    with pytest.raises(ValueError, match=r"0.up_proj.weight_scale_inv must be \[1, 2\]"):
        load_deepseek_fp8(bad, p, 2)
    bad = dict(tensors)
    bad[f"{p}.1.gate_proj.weight_scale_inv"] = torch.full((1, 2), float("nan"))
    with pytest.raises(ValueError, match=r"1.gate_proj.weight_scale_inv holds non-finite values"):
        load_deepseek_fp8(bad, p, 2)
    with pytest.raises(ValueError, match="num_experts must be an int >= 1"):
        load_deepseek_fp8(tensors, p, 0)


def test_deepseek_loader_refuses_more_experts_than_num_experts(tmp_path, gen):
    """Regression: num_experts below the checkpoint's expert count silently dropped the extra experts."""
    tensors, _ = _deepseek_layer(gen, E=3)
    save_file(tensors, str(tmp_path / "layer.safetensors"))
    for source in (tensors, tmp_path):
        with pytest.raises(ValueError, match=r"holds 3 experts under 'model.layers.3.mlp.experts' \(ids up to 2\), "
                                             r"but num_experts=2"):
            load_deepseek_fp8(source, "model.layers.3.mlp.experts", 2)


def test_deepseek_loader_rejects_sizes_that_break_the_blocks():
    t = {}
    for proj, shape in (("gate_proj", (64, 128)), ("up_proj", (64, 128)), ("down_proj", (128, 64))):
        t[f"x.0.{proj}.weight"] = torch.zeros(shape).to(torch.float8_e4m3fn)
        t[f"x.0.{proj}.weight_scale_inv"] = torch.ones(1, 1)
    with pytest.raises(ValueError, match="multiples of 128 .*got H=128, I=64"):
        load_deepseek_fp8(t, "x", 1)

"""Checkpoint loading into a plain FusedMoE (no transformers): every layout against tensors
written element by element, and the reader's own errors."""

import json

import pytest
import torch
from safetensors.torch import save_file

from moekit import FusedMoE, RoutingConfig, SharedExpertsConfig
from moekit.integrations.checkpoint import (
    CheckpointError,
    MoEKeys,
    SafetensorsCheckpoint,
    canonical_layout,
    load_fused_moe,
)

E, H, I, I_S = 4, 24, 10, 20  # odd-ish sizes; H != 2I so transposition cannot hide


def _layer(bias=False, shared=None, correction=False, activation="silu"):
    routing = RoutingConfig(top_k=2, scoring="sigmoid" if correction else "softmax")
    return FusedMoE(E, H, I, routing, activation=activation, bias=bias, gate=True, gate_bias=bias,
                    shared_experts=shared, correction_bias=correction)


def _truth(gen):
    """Canonical tensors: w13 [E, 2I, H] (gate rows then up rows), w2 [E, H, I], biases."""
    return dict(w13=torch.randn(E, 2 * I, H, generator=gen), w2=torch.randn(E, H, I, generator=gen),
                b13=torch.randn(E, 2 * I, generator=gen), b2=torch.randn(E, H, generator=gen),
                gate=torch.randn(E, H, generator=gen), gate_bias=torch.randn(E, generator=gen))


def _per_expert(t, p, names=("gate_proj", "up_proj", "down_proj"), bias=False):
    out = {}
    g, u, d = names
    for e in range(E):
        out[f"{p}experts.{e}.{g}.weight"] = t["w13"][e, :I].clone()
        out[f"{p}experts.{e}.{u}.weight"] = t["w13"][e, I:].clone()
        out[f"{p}experts.{e}.{d}.weight"] = t["w2"][e].clone()
        if bias:
            out[f"{p}experts.{e}.{g}.bias"] = t["b13"][e, :I].clone()
            out[f"{p}experts.{e}.{u}.bias"] = t["b13"][e, I:].clone()
            out[f"{p}experts.{e}.{d}.bias"] = t["b2"][e].clone()
    return out


def _gpt_oss_style(t, p):
    """Stacked, transposed [E, H, 2I] with gate in even and up in odd columns, element by element."""
    gu = torch.empty(E, H, 2 * I)
    gub = torch.empty(E, 2 * I)
    for j in range(I):
        gu[:, :, 2 * j] = t["w13"][:, j, :]
        gu[:, :, 2 * j + 1] = t["w13"][:, I + j, :]
        gub[:, 2 * j] = t["b13"][:, j]
        gub[:, 2 * j + 1] = t["b13"][:, I + j]
    return {f"{p}experts.gate_up_proj": gu, f"{p}experts.gate_up_proj_bias": gub,
            f"{p}experts.down_proj": t["w2"].transpose(1, 2).contiguous(), f"{p}experts.down_proj_bias": t["b2"].clone()}


@pytest.mark.parametrize("layout", ["per_expert", "per_expert_w1w3w2", "stacked", "stacked_gpt_oss"])
def test_layouts_load_to_the_canonical_tensors(layout, tmp_path, gen):
    t = _truth(gen)
    p = "blk."
    bias = layout == "stacked_gpt_oss"
    tensors = {f"{p}gate.weight": t["gate"]}
    if bias:
        tensors[f"{p}gate.bias"] = t["gate_bias"]
    if layout == "per_expert":
        tensors.update(_per_expert(t, p))
    elif layout == "per_expert_w1w3w2":
        tensors.update(_per_expert(t, p, names=("w1", "w3", "w2")))
    elif layout == "stacked":
        tensors.update({f"{p}experts.gate_up_proj": t["w13"], f"{p}experts.down_proj": t["w2"]})
    else:
        tensors.update(_gpt_oss_style(t, p))
    save_file(tensors, str(tmp_path / "model.safetensors"))
    layer = _layer(bias=bias, activation="swigluoai" if bias else "silu")
    keys = MoEKeys((p,), transposed=bias, interleaved=bias)
    consumed = load_fused_moe(layer, tmp_path, keys)
    assert sorted(consumed) == sorted(tensors)
    assert torch.equal(layer.experts.w13, t["w13"]) and torch.equal(layer.experts.w2, t["w2"])
    assert torch.equal(layer.gate.weight, t["gate"])
    if bias:
        assert torch.equal(layer.experts.b13, t["b13"]) and torch.equal(layer.experts.b2, t["b2"])
        assert torch.equal(layer.gate.bias, t["gate_bias"])


def test_shared_experts_gate_and_correction_bias(tmp_path, gen):
    t = _truth(gen)
    p = "m.layers.3.mlp."
    gate_proj, up_proj, down_proj = (torch.randn(I_S, H, generator=gen), torch.randn(I_S, H, generator=gen),
                                     torch.randn(H, I_S, generator=gen))
    sg, cb = torch.randn(1, H, generator=gen), torch.randn(E, generator=gen)
    tensors = {f"{p}gate.weight": t["gate"], f"{p}gate.e_score_correction_bias": cb,
               f"{p}shared_expert.gate_proj.weight": gate_proj, f"{p}shared_expert.up_proj.weight": up_proj,
               f"{p}shared_expert.down_proj.weight": down_proj, f"{p}shared_expert_gate.weight": sg,
               **_per_expert(t, p)}
    save_file(tensors, str(tmp_path / "one.safetensors"))
    layer = _layer(shared=SharedExpertsConfig(I_S, gated=True), correction=True)
    load_fused_moe(layer, tmp_path / "one.safetensors",
                   MoEKeys((p,), shared="shared_expert", shared_gate="shared_expert_gate"))
    assert torch.equal(layer.shared.gate_up, torch.cat((gate_proj, up_proj)))
    assert torch.equal(layer.shared.down, down_proj) and torch.equal(layer.shared.gate, sg)
    assert torch.equal(layer.e_score_correction_bias, cb)


def test_bf16_checkpoint_into_fp32_layer(tmp_path, gen):
    t = _truth(gen)
    tensors = {k: v.to(torch.bfloat16) for k, v in {"gate.weight": t["gate"], **_per_expert(t, "")}.items()}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    layer = _layer()
    load_fused_moe(layer, tmp_path, MoEKeys(("",)))
    assert torch.equal(layer.experts.w13, t["w13"].to(torch.bfloat16).float())


def test_canonical_layout_against_a_loop(gen):
    t = _truth(gen)
    stored = _gpt_oss_style(t, "")
    w = canonical_layout(stored["experts.gate_up_proj"], stored["experts.down_proj"],
                         stored["experts.gate_up_proj_bias"], stored["experts.down_proj_bias"],
                         transposed=True, interleaved=True)
    assert torch.equal(w.w13, t["w13"]) and torch.equal(w.w2, t["w2"]) and torch.equal(w.b13, t["b13"])
    assert w.w13.is_contiguous() and w.w2.is_contiguous()
    same = canonical_layout(t["w13"], t["w2"])
    assert same.w13 is t["w13"] and same.w2 is t["w2"]  # nothing moves: no copy


def test_two_prefixes_present_is_an_error(tmp_path, gen):
    t = _truth(gen)
    tensors = {"a.gate.weight": t["gate"], "b.gate.weight": t["gate"].clone(), **_per_expert(t, "a.")}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"several prefixes \['a\.', 'b\.'\]"):
        load_fused_moe(_layer(), tmp_path, MoEKeys(("a.", "b.")))


def test_block_absent_names_the_expected_key(tmp_path, gen):
    save_file({"other.weight": torch.zeros(2)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"missing tensor 'blk\.gate\.weight' \(expected shape \[4, 24\]\)"):
        load_fused_moe(_layer(), tmp_path, MoEKeys(("blk.",)))


def test_reader_errors(tmp_path, gen):
    with pytest.raises(CheckpointError, match="no such checkpoint"):
        SafetensorsCheckpoint(tmp_path / "absent.safetensors")
    for name in ("x.safetensors", "y.safetensors"):
        save_file({"a": torch.zeros(1)}, str(tmp_path / name))
    with pytest.raises(CheckpointError, match=r"found \['x\.safetensors', 'y\.safetensors'\]"):
        SafetensorsCheckpoint(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "x.safetensors",
                                                                                      "b": "x.safetensors"}}))
    with pytest.raises(CheckpointError, match="lists tensor 'b' but the shard lacks it"):
        SafetensorsCheckpoint(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "x.safetensors",
                                                                                      "b": "y.safetensors"}}))
    with pytest.raises(CheckpointError, match="tensor 'a' is in the shard but not in the index"):
        SafetensorsCheckpoint(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text("{}")
    with pytest.raises(CheckpointError, match="needs a 'weight_map'"):
        SafetensorsCheckpoint(tmp_path)


QUANT = ["fp8_w8a8", "fp8_w8a8_channel", "fp8_w8a8_block128", "int8_w8a8", "int8_w8a16", "int4_w4a16"]
QE, QH, QI = 4, 128, 128  # sizes every scheme's groups and blocks fit


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)  # float8 has no torch.equal; bytes compare every dtype


@pytest.mark.parametrize("layout", [
    "per_expert",  # regression: float rows were copied into fp8 storage / refused as not integer for int8 and int4
    "per_expert_w1w3w2",
    "per_expert_bias",  # biases stay float parameters beside the quantized storage
    "stacked",  # regression: int4 expected the packed [E, 2I, H/2] of the checkpoint
])
@pytest.mark.parametrize("quant", QUANT)
def test_float_checkpoint_into_quantized_layer_quantizes_on_load(quant, layout, tmp_path, gen):
    """Either layout gives bit for bit what load_weights (quantize on load) gives for the stacked tensors."""
    w13 = torch.randn(QE, 2 * QI, QH, generator=gen) * QH ** -0.5
    w2 = torch.randn(QE, QH, QI, generator=gen) * QI ** -0.5
    b13, b2 = torch.randn(QE, 2 * QI, generator=gen), torch.randn(QE, QH, generator=gen)
    bias = layout == "per_expert_bias"
    names = ("w1", "w3", "w2") if layout == "per_expert_w1w3w2" else ("gate_proj", "up_proj", "down_proj")
    tensors = {}
    for e in range(QE):
        if layout == "stacked":
            tensors = {"experts.gate_up_proj": w13, "experts.down_proj": w2}
            break
        for name, t, bt in ((names[0], w13[e, :QI], b13[e, :QI]), (names[1], w13[e, QI:], b13[e, QI:]),
                            (names[2], w2[e], b2[e])):
            tensors[f"experts.{e}.{name}.weight"] = t.clone()
            if bias:
                tensors[f"experts.{e}.{name}.bias"] = bt.clone()
    save_file(tensors, str(tmp_path / "model.safetensors"))
    routing = RoutingConfig(top_k=2)
    layer = FusedMoE(QE, QH, QI, routing, bias=bias, quant=quant)
    want = FusedMoE(QE, QH, QI, routing, bias=bias, quant=quant)
    want.load_weights(w13, w2, *((b13, b2) if bias else ()))
    assert sorted(load_fused_moe(layer, tmp_path, MoEKeys(("",)))) == sorted(tensors)
    got, ref = layer.experts.state_dict(), want.experts.state_dict()
    assert sorted(got) == sorted(ref)
    for name in ref:
        assert got[name].dtype == ref[name].dtype and torch.equal(_bits(got[name]), _bits(ref[name])), name
    if bias:
        assert layer.experts.b13.dtype == torch.float32 and torch.equal(layer.experts.b13, b13)


def test_float_checkpoint_into_quantized_layer_checks_float_shapes(tmp_path, gen):
    """Shapes are the float ones (int4 packs H / 2 in storage), named per key before anything loads."""
    tensors = {f"experts.{e}.{n}.weight": torch.randn(QI, QH // 2, generator=gen)
               for e in range(QE) for n in ("gate_proj", "up_proj")}
    tensors.update({f"experts.{e}.down_proj.weight": torch.randn(QH, QI, generator=gen) for e in range(QE)})
    save_file(tensors, str(tmp_path / "model.safetensors"))
    layer = FusedMoE(QE, QH, QI, RoutingConfig(top_k=2), quant="int4_w4a16")
    before = _bits(layer.experts.w13).clone()
    with pytest.raises(CheckpointError, match=r"tensor 'experts\.0\.gate_proj\.weight' has shape \[128, 64\], "
                                              r"expected \[128, 128\]"):
        load_fused_moe(layer, tmp_path, MoEKeys(("",)))
    assert torch.equal(_bits(layer.experts.w13), before)

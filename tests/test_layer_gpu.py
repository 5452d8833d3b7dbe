"""FusedMoE on CUDA as a model uses it: the oracle's pick against the same layer on `reference`.

Every precision (16-bit and each quantization scheme) x shared-expert mode x input form (3-D,
non-contiguous, fp16 beside bf16 weights) x token count (0, 1, a few, a prefill-sized batch),
the layer's own gate and DeepSeek-style routing, compared with the layer's weights copied into
a `reference` layer (the fp32 loop, emulating the scheme).
"""

import logging

import pytest
import torch

from moekit import FusedMoE, RoutingConfig, SharedExpertsConfig
from moekit.quant import TOLERANCE, get_scheme

from conftest import TOL, rel_err

pytestmark = pytest.mark.gpu
DEV = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a dry run of the checks only

E, H, I = 16, 256, 128
QUANTS = [None, "fp8_w8a8", "fp8_w8a8_channel", "fp8_w8a8_block128", "int8_w8a8", "int8_w8a16", "int4_w4a16"]
SHARED = {
    "none": None,
    "separate": SharedExpertsConfig(2 * I, mode="separate"),
    "gated-overlap": SharedExpertsConfig(I, gated=True, mode="overlap"),
}


def _pair(quant, shared, dtype, routing, **kw):
    """(layer on CUDA with backend auto, the same weights in a reference layer on CUDA)."""
    args = dict(routing=routing, dtype=dtype, device=DEV, quant=quant, gate=True,
                shared_experts=SHARED[shared], **kw)
    layer = FusedMoE(E, H, I, backend="auto", **args).eval()
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**30, (1,))))
    w13 = torch.randn(E, 2 * I, H, generator=gen) / H ** 0.5
    w2 = torch.randn(E, H, I, generator=gen) / I ** 0.5
    layer.load_weights(w13.to(DEV), w2.to(DEV))
    with torch.no_grad():
        for p in list(layer.gate.parameters()) + ([] if layer.shared is None else list(layer.shared.parameters())):
            p.copy_(torch.randn(p.shape, generator=gen) / H ** 0.5)
        if layer.e_score_correction_bias is not None:
            layer.e_score_correction_bias.copy_(torch.randn(E, generator=gen) * 0.1)
    ref = FusedMoE(E, H, I, backend="reference", **args).eval()
    ref.load_state_dict(layer.state_dict())
    return layer, ref


def _tolerance(quant, dtype):
    return TOL[dtype] if quant is None else TOLERANCE[get_scheme(quant).precision]


def _inputs(form, T, dtype):
    if form == "3d":  # [B, S, H]
        return torch.randn(2, T, H, device=DEV, dtype=dtype)
    if form == "strided":  # [T, H] rows of a wider buffer, then a transposed [S, B, H] view
        wide = torch.randn(T, 2 * H, device=DEV, dtype=dtype)
        return wide[:, ::2]
    return torch.randn(T, H, device=DEV, dtype=dtype)


@pytest.mark.parametrize("quant", QUANTS, ids=[q or "bf16" for q in QUANTS])
@pytest.mark.parametrize("shared", list(SHARED))
@pytest.mark.parametrize("T,form", [(0, "2d"), (1, "2d"), (5, "strided"), (300, "3d")])
def test_layer_against_reference(quant, shared, T, form, caplog):
    layer, ref = _pair(quant, shared, torch.bfloat16, RoutingConfig(top_k=4))
    x = _inputs(form, T, torch.bfloat16)
    with caplog.at_level(logging.INFO, logger="moekit"), torch.inference_mode():
        out = layer(x)
        want = ref(x)
    assert out.shape == x.shape and out.dtype == x.dtype
    if x.numel():
        assert torch.isfinite(out).all()
        assert rel_err(out, want) <= _tolerance(quant, torch.bfloat16), rel_err(out, want)
        assert DEV == "cpu" or "backend triton" in caplog.text, caplog.text


@pytest.mark.parametrize("quant", [None, "fp8_w8a8_block128", "int4_w4a16"], ids=["fp16", "fp8-block", "int4"])
@pytest.mark.parametrize("T", [1, 64])
def test_fp16_layer_with_deepseek_routing(quant, T):
    routing = RoutingConfig(top_k=4, scoring="sigmoid", num_expert_group=4, topk_group=2, routed_scaling_factor=2.5)
    layer, ref = _pair(quant, "separate", torch.float16, routing, correction_bias=True)
    x = torch.randn(T, H, device=DEV, dtype=torch.float16)
    with torch.inference_mode():
        out, want = layer(x), ref(x)
    assert torch.isfinite(out).all() and rel_err(out, want) <= _tolerance(quant, torch.float16), rel_err(out, want)


@pytest.mark.parametrize("T", [1, 48])
def test_fp16_input_to_bf16_layer_and_fused_shared(T):
    """x in fp16 through a bf16 layer whose shared MLP rides in the grouped GEMM as extra experts."""
    layer, ref = _pair(None, "none", torch.bfloat16, RoutingConfig(top_k=2))
    fused, fused_ref = (FusedMoE(E, H, I, RoutingConfig(top_k=2), dtype=torch.bfloat16, device=DEV, gate=True,
                                 shared_experts=SharedExpertsConfig(2 * I, mode=m), backend=b).eval()
                        for m, b in (("fused", "auto"), ("separate", "reference")))
    fused_ref.load_state_dict(fused.state_dict())
    x = torch.randn(T, H, device=DEV, dtype=torch.float16)
    with torch.inference_mode():
        for a, b in ((layer, ref), (fused, fused_ref)):
            out, want = a(x), b(x)
            assert out.dtype == torch.float16 and rel_err(out, want) <= TOL[torch.bfloat16], rel_err(out, want)


def test_layer_moved_to_cuda_after_construction():
    """A layer built and loaded on the CPU, then .cuda(): the quantized storage and its scales move."""
    cpu = FusedMoE(E, H, I, RoutingConfig(top_k=2), dtype=torch.bfloat16, quant="int8_w8a16", gate=True).eval()
    cpu.load_weights(torch.randn(E, 2 * I, H) / 16, torch.randn(E, H, I) / 11)
    x = torch.randn(7, H, dtype=torch.bfloat16)
    with torch.inference_mode():
        want = cpu(x)
        out = cpu.to(DEV)(x.to(DEV))
    assert rel_err(out.cpu(), want) <= TOLERANCE["int8_w8a16"] * 2, rel_err(out.cpu(), want)

"""FusedMoE over random combinations of its options: the oracle's pick against `reference`.

Each example draws a routing variant, an activation, biases, a shared-expert mode, a precision
(float or a quantization scheme), sizes and a token count, builds the layer with backend "auto"
and a `reference` layer with the same state, and compares their outputs within PERF.md's
tolerance for the precision. Combinations the layer refuses by design (fused shared experts in
a quantized layer, say) are drawn around, not skipped, so every example checks an output.
On CPU in CI; on CUDA (marker gpu) in 16-bit with the fp8 block scheme too.
"""

import pytest
import torch

from moekit import FusedMoE, RoutingConfig, SharedExpertsConfig
from moekit.activations import ACTIVATIONS, is_gated
from moekit.quant import TOLERANCE, get_scheme

from conftest import TOL, rel_err
from hypothesis_or_skip import given, settings, st

ROUTINGS = {
    "softmax": lambda E, k: RoutingConfig(top_k=k),
    "softmax-no-renorm": lambda E, k: RoutingConfig(top_k=k, renormalize=False),
    "sigmoid-scaled": lambda E, k: RoutingConfig(top_k=k, scoring="sigmoid", routed_scaling_factor=2.0),
    "sqrtsoftplus": lambda E, k: RoutingConfig(top_k=k, scoring="sqrtsoftplus"),
    "deepseek-v3": lambda E, k: RoutingConfig(top_k=k, scoring="sigmoid", num_expert_group=4, topk_group=2,
                                              routed_scaling_factor=2.5),
    "gpt-oss": lambda E, k: RoutingConfig(top_k=k, order="topk_then_softmax"),
    "llama4": lambda E, k: RoutingConfig(top_k=1, order="topk_then_sigmoid", renormalize=False,
                                         apply_router_weight_on_input=True),
    "scale-on-output": lambda E, k: RoutingConfig(top_k=k, scoring="sigmoid", routed_scaling_factor=3.0,
                                                  scale_on="output"),
}
QUANTS = [None, "fp8_w8a8", "fp8_w8a8_channel", "int8_w8a8", "int8_w8a16", "int4_w4a16"]
GPU_QUANTS = QUANTS + ["fp8_w8a8_block128"]
SHARED = ["none", "separate", "gated", "fused"]


def _draw_case(draw, device):
    routing = draw(st.sampled_from(sorted(ROUTINGS)))
    quant = draw(st.sampled_from(QUANTS if device == "cpu" else GPU_QUANTS))
    E = draw(st.sampled_from([8, 12, 16]))
    # DeepSeek routing picks among its kept groups: 2 of 4 groups, E / 2 experts
    k = draw(st.integers(1, min(E // 2 if routing == "deepseek-v3" else E, 6)))
    group = draw(st.sampled_from([32, 64])) if quant in ("int8_w8a16", "int4_w4a16") else 1  # whole groups
    if quant == "fp8_w8a8_block128":  # whole 128 x 128 blocks
        H, I = draw(st.sampled_from([128, 256])), draw(st.sampled_from([128, 256]))
    elif group > 1:
        H, I = draw(st.sampled_from([64, 128, 192])), draw(st.sampled_from([64, 128]))
    else:
        H, I = draw(st.sampled_from([8, 24, 40, 64])), draw(st.sampled_from([8, 16, 20, 48]))
    shared = draw(st.sampled_from(SHARED))
    activation = draw(st.sampled_from(ACTIVATIONS))
    if shared == "fused" and (quant is not None or routing == "llama4"):
        shared = "separate"  # fused shared experts ride in float experts without a weight on the input
    return dict(routing=routing, quant=quant, E=E, k=k, H=H, I=I, group=group, shared=shared,
                activation=activation, bias=draw(st.booleans()),
                dtype=draw(st.sampled_from([torch.float32, torch.bfloat16] if device == "cpu"
                                           else [torch.bfloat16, torch.float16])),
                T=draw(st.sampled_from([0, 1, 3, 17, 64])), seed=draw(st.integers(0, 2**31 - 1)))


def _shared_config(mode, I):
    if mode == "none":
        return None
    if mode == "fused":  # a multiple of the routed I, the routed activation (gated or not alike)
        return SharedExpertsConfig(2 * I, mode="fused")
    return SharedExpertsConfig(I + 8, gated=mode == "gated", mode="separate")


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_layer_on_the_oracles_pick_matches_reference(data):
    _check(_draw_case(data.draw, "cpu"), "cpu")


@pytest.mark.gpu
@settings(max_examples=250, deadline=None)
@given(data=st.data())
def test_layer_on_cuda_matches_reference(data):
    _check(_draw_case(data.draw, "cuda"), "cuda")


def _check(c, device):
    gen = torch.Generator().manual_seed(c["seed"])
    quant = None if c["quant"] is None else get_scheme(c["quant"], **(
        {"group_size": c["group"]} if c["group"] > 1 else {}))
    args = dict(routing=ROUTINGS[c["routing"]](c["E"], c["k"]), activation=c["activation"], bias=c["bias"],
                dtype=c["dtype"], quant=quant, gate=True, shared_experts=_shared_config(c["shared"], c["I"]),
                correction_bias=c["routing"] == "deepseek-v3", device=device)
    layer = FusedMoE(c["E"], c["H"], c["I"], backend="auto", **args).eval()
    E, H, I = c["E"], c["H"], c["I"]
    width = 2 * I if is_gated(c["activation"]) else I
    biases = (torch.randn(E, width, generator=gen) * 0.1, torch.randn(E, H, generator=gen) * 0.1) if c["bias"] else ()
    tensors = (torch.randn(E, width, H, generator=gen) / H ** 0.5, torch.randn(E, H, I, generator=gen) / I ** 0.5,
               *biases)
    layer.load_weights(*(t.to(device) for t in tensors))
    with torch.no_grad():
        for p in list(layer.gate.parameters()) + ([] if layer.shared is None else list(layer.shared.parameters())):
            p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
        if layer.e_score_correction_bias is not None:
            layer.e_score_correction_bias.copy_(torch.randn(E, generator=gen) * 0.1)
    ref = FusedMoE(E, H, I, backend="reference", **args).eval()
    ref.load_state_dict(layer.state_dict())
    x = torch.randn(c["T"], H, generator=gen).to(device, c["dtype"])
    with torch.inference_mode():
        out, want = layer(x), ref(x)
    assert out.shape == x.shape and out.dtype == x.dtype
    if c["T"]:
        tol = TOL[c["dtype"]] if quant is None else TOLERANCE[quant.precision]
        assert torch.isfinite(out).all()
        assert rel_err(out, want) <= tol, (rel_err(out, want), tol)

"""FusedMoE end to end: against route + reference + a hand-written shared MLP; all shared modes agree."""

import pytest
import torch

from moekit import ActivationParams, FusedMoE, RoutingConfig, SharedExpertsConfig, route
from moekit.experts.reference import reference_experts

from conftest import TOL, rel_err

E, H, I = 8, 48, 16


def shared_by_hand(layer, x):
    s = layer.shared
    h = x.float() @ s.gate_up.float().t()
    I_s = s.down.shape[1]
    y = (torch.nn.functional.silu(h[:, :I_s]) * h[:, I_s:]) @ s.down.float().t()
    if s.gate is not None:
        y = y * torch.sigmoid(x.float() @ s.gate.float().t())
    return y


def expected(layer, x, logits):
    cfg = layer.routing
    w, ids = route(logits, cfg, layer.e_score_correction_bias)
    out = reference_experts(x, layer.experts.expert_weights(), w, ids)
    if cfg.scale_on == "output":
        out = out * cfg.routed_scaling_factor
    if layer.shared is not None:
        out = out + shared_by_hand(layer, x)
    return out


ROUTINGS = {
    "mixtral": RoutingConfig(top_k=2),
    "deepseek-v3": RoutingConfig(top_k=3, scoring="sigmoid", num_expert_group=4, topk_group=2, routed_scaling_factor=2.5),
    "scale-on-output": RoutingConfig(top_k=2, scoring="sigmoid", routed_scaling_factor=2.5, scale_on="output"),
}


@pytest.mark.parametrize("mode", ["separate", "fused", "overlap"])
@pytest.mark.parametrize("gated", [False, True], ids=["ungated", "sigmoid-gated"])
@pytest.mark.parametrize("routing", list(ROUTINGS), ids=list(ROUTINGS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_layer_with_shared_experts(mode, gated, routing, dtype, gen):
    torch.manual_seed(int(torch.randint(0, 2**30, (1,), generator=gen)))
    layer = FusedMoE(E, H, I, ROUTINGS[routing], dtype=dtype,
                     shared_experts=SharedExpertsConfig(2 * I, gated=gated, mode=mode),
                     correction_bias=routing == "deepseek-v3")
    if layer.e_score_correction_bias is not None:
        layer.e_score_correction_bias.normal_(0, 0.1)
    x = torch.randn(2, 13, H, dtype=dtype)
    logits = torch.randn(2, 13, E)
    with torch.no_grad():
        out = layer(x, logits)
        ref = expected(layer, x.reshape(-1, H), logits.reshape(-1, E))
    assert out.shape == x.shape and out.dtype == dtype
    assert rel_err(out.reshape(-1, H), ref) <= TOL[dtype]


def test_fused_shared_cache_follows_weight_updates():
    layer = FusedMoE(E, H, I, RoutingConfig(top_k=2), shared_experts=SharedExpertsConfig(I, mode="fused"))
    x, logits = torch.randn(5, H), torch.randn(5, E)
    with torch.no_grad():
        a = layer(x, logits)
        layer.shared.down.mul_(2.0)  # in-place update must invalidate the fused copy
        b = layer(x, logits)
        assert rel_err(b, expected(layer, x, logits)) <= 1e-5
    assert not torch.equal(a, b)


def test_owned_gate_computes_logits():
    layer = FusedMoE(E, H, I, RoutingConfig(top_k=2), gate=True, gate_bias=True)
    x = torch.randn(7, H)
    with torch.no_grad():
        logits = layer.gate(x)
        assert torch.equal(layer(x), layer(x, logits))


def test_llama4_style_weight_on_input():
    cfg = RoutingConfig(top_k=1, order="topk_then_sigmoid", apply_router_weight_on_input=True)
    layer = FusedMoE(E, H, I, cfg, shared_experts=SharedExpertsConfig(I))
    x, logits = torch.randn(9, H), torch.randn(9, E)
    with torch.no_grad():
        w, ids = route(logits, cfg)
        ref = reference_experts(x, layer.experts.expert_weights(), w, ids, apply_router_weight_on_input=True)
        ref = ref + shared_by_hand(layer, x)
        assert rel_err(layer(x, logits), ref) <= 1e-5


def test_chunking_gives_the_same_result(monkeypatch):
    layer = FusedMoE(E, H, I, RoutingConfig(top_k=2))
    x, logits = torch.randn(50, H), torch.randn(50, E)
    with torch.no_grad():
        whole = layer(x, logits)
        layer.runner.chunk_size = 7
        chunked = layer(x, logits)
    # BLAS may block a GEMM differently for other row counts: equal up to fp32 rounding
    assert rel_err(chunked, whole) <= 1e-6


def test_zero_tokens():
    layer = FusedMoE(E, H, I, RoutingConfig(top_k=2), shared_experts=SharedExpertsConfig(I))
    out = layer(torch.randn(0, H), torch.randn(0, E))
    assert out.shape == (0, H)


def test_load_weights_round_trip():
    layer = FusedMoE(E, H, I, RoutingConfig(top_k=2), bias=True)
    w13, w2 = torch.randn(E, 2 * I, H), torch.randn(E, H, I)
    b13, b2 = torch.randn(E, 2 * I), torch.randn(E, H)
    layer.load_weights(w13, w2, b13, b2)
    assert torch.equal(layer.experts.w13, w13) and torch.equal(layer.experts.b2, b2)
    with pytest.raises(ValueError, match=r"w2 must have shape \[8, 48, 16\], got \[8, 16, 48\]"):
        layer.load_weights(w13, w2.transpose(1, 2))


def test_explicit_backend_is_honoured_or_refused():
    # What the call brings (here inputs that require grad) is refused per call, with the reason.
    layer = FusedMoE(E, H, I, RoutingConfig(top_k=2), backend="reference", quant="int8_w8a8")
    layer.load_weights(torch.randn(E, 2 * I, H), torch.randn(E, H, I))
    with pytest.raises(ValueError, match="backend='reference' cannot run .*no gradient flows"):
        layer(torch.randn(3, H, requires_grad=True), torch.randn(3, E))


@pytest.mark.parametrize("backend,quant,sizes,why", [
    ("grouped_mm", None, (45, 19), "grouped_mm"),  # odd sizes: no device or dtype helps
    ("cpu_int8", None, (H, I), "runs quant='int8_w8a8' only"),  # an int8 backend on float weights
    ("cpu_wo", "int8_w8a8", (H, I), "weight-only"),  # a weight-only backend on 8-bit activations
    ("grouped_mm", "fp8_w8a8", (H, I), "unquantized weights only"),
], ids=["odd-sizes", "int8-backend-float-layer", "weight-only-backend-w8a8", "float-backend-fp8"])
def test_explicit_backend_that_can_never_serve_is_refused_at_construction(backend, quant, sizes, why):
    """Regression: such a layer was built and failed at its first forward."""
    with pytest.raises(ValueError, match=f"backend='{backend}' can never run this layer .*{why}"):
        FusedMoE(E, *sizes, RoutingConfig(top_k=2), backend=backend, quant=quant)


def test_explicit_backend_for_another_device_is_kept_for_later():
    """A CPU-built layer may name a GPU backend: .to('cuda') comes later."""
    layer = FusedMoE(E, H, I, RoutingConfig(top_k=2), backend="triton")
    assert layer.runner.backend == "triton"


def test_oracle_logs_choice_once(caplog):
    layer = FusedMoE(E, H, I, RoutingConfig(top_k=2), name="logged_layer")
    with caplog.at_level("INFO", logger="moekit"):
        for _ in range(3):
            layer(torch.randn(4, H), torch.randn(4, E))
    lines = [r.getMessage() for r in caplog.records if "logged_layer" in r.getMessage()]
    assert len(lines) == 1 and "backend cpu" in lines[0]


def test_expert_weights_object_lives_while_the_tensors_do():
    layer = FusedMoE(E, H, I, RoutingConfig(top_k=2), bias=True)
    w = layer.experts.expert_weights()
    assert layer.experts.expert_weights() is w  # backends keep what they derive from it across calls
    layer.experts.b2 = torch.nn.Parameter(torch.randn(E, H))
    w2 = layer.experts.expert_weights()
    assert w2 is not w and w2.b2 is layer.experts.b2
    x, logits = torch.randn(1, H), torch.randn(1, E)
    with torch.no_grad():
        layer(x, logits)  # the decode path derives its native projections from the held object
        layer.to(torch.bfloat16)  # (parameters keep their objects, with new data: derived state rebuilt)
        assert layer.experts.expert_weights().w13.dtype == torch.bfloat16
        xb = x.bfloat16()
        assert rel_err(layer(xb, logits), expected(layer, xb, logits)) <= TOL[torch.bfloat16]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("tokens", [1, 9])
def test_decode_follows_in_place_weight_and_bias_writes(dtype, tokens, gen):
    """The weights object (and what the backend derived from it) outlives calls: writes into the
    weights and biases in place show in the next call (decode's native path and the sorted one)."""
    torch.manual_seed(int(torch.randint(0, 2**30, (1,), generator=gen)))
    layer = FusedMoE(E, H, I, RoutingConfig(top_k=2), bias=True, dtype=dtype)
    x, logits = torch.randn(tokens, H, dtype=dtype), torch.randn(tokens, E)
    with torch.no_grad():
        before = layer(x, logits)
        layer.experts.w13.mul_(-1.5)
        layer.experts.w2.add_(0.25)
        layer.experts.b13.normal_()
        layer.experts.b2.normal_()
        after = layer(x, logits)
        assert rel_err(after, expected(layer, x, logits)) <= TOL[dtype]
        layer.load_weights(torch.randn(E, 2 * I, H), torch.randn(E, H, I), torch.randn(E, 2 * I), torch.randn(E, H))
        assert rel_err(layer(x, logits), expected(layer, x, logits)) <= TOL[dtype]
    assert not torch.equal(before, after)


@pytest.mark.parametrize("tokens", [1, 9])
def test_layer_built_under_inference_mode(tokens, gen):
    """Parameters made under torch.inference_mode have no version counter: the fused shared
    weights and the decode path's bias tables were keyed on it and raised RuntimeError. They
    are built afresh instead, so in-place writes there still show in the next call."""
    torch.manual_seed(int(torch.randint(0, 2**30, (1,), generator=gen)))
    with torch.inference_mode():
        layer = FusedMoE(E, H, I, RoutingConfig(top_k=2), bias=True,
                         shared_experts=SharedExpertsConfig(2 * I, mode="fused"))
        layer.experts.b13.normal_()
        layer.experts.b2.normal_()
        x, logits = torch.randn(tokens, H), torch.randn(tokens, E)
        assert rel_err(layer(x, logits), expected(layer, x, logits)) <= 1e-5
        layer.shared.down.mul_(-2.0)
        layer.experts.b2.normal_()
        assert rel_err(layer(x, logits), expected(layer, x, logits)) <= 1e-5


def test_inference_mode_weights_are_said_once(caplog, monkeypatch):
    """Rebuilding derived weights on every call costs time: the warning says so, once."""
    import logging

    from moekit.experts import base

    monkeypatch.setattr(base, "_warned_inference", False)
    with torch.inference_mode():
        layer = FusedMoE(E, H, I, RoutingConfig(top_k=2), shared_experts=SharedExpertsConfig(I, mode="fused"))
        with caplog.at_level(logging.WARNING, logger="moekit"):
            for _ in range(3):
                layer(torch.randn(2, H), torch.randn(2, E))
    said = [r for r in caplog.records if "torch.inference_mode" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.WARNING


def test_refused_load_weights_writes_nothing():
    """b13 used to be copied before b2 was checked: a refused call left the layer half loaded."""
    layer = FusedMoE(E, H, I, RoutingConfig(top_k=2), bias=True)
    before = {n: p.detach().clone() for n, p in layer.named_parameters()}
    good = (torch.randn(E, 2 * I, H), torch.randn(E, H, I), torch.randn(E, 2 * I))
    for b2, exc, match in ((torch.randn(E, H + 1), ValueError, r"b2 must have shape \[8, 48\], got \[8, 49\]"),
                           (torch.zeros(E, H, dtype=torch.int64), TypeError, "b2 must be a float tensor")):
        with pytest.raises(exc, match=match):
            layer.load_weights(*good, b2)
        assert all(torch.equal(p, before[n]) for n, p in layer.named_parameters())


def test_shared_modes_agree_with_activation_params(gen):
    """The separate / overlap shared MLP ran swigluoai with the default alpha and limit, while
    mode "fused" (the experts backend) took the layer's activation_params: the modes differed."""
    torch.manual_seed(int(torch.randint(0, 2**30, (1,), generator=gen)))
    params = ActivationParams(alpha=0.8, limit=0.75)  # a limit the inputs below exceed
    layers = {mode: FusedMoE(E, H, I, RoutingConfig(top_k=2), activation="swigluoai", activation_params=params,
                             shared_experts=SharedExpertsConfig(2 * I, gated=True, mode=mode))
              for mode in ("separate", "overlap", "fused")}
    for layer in layers.values():
        layer.load_state_dict(layers["fused"].state_dict())
    x, logits = 3 * torch.randn(7, H), torch.randn(7, E)
    with torch.no_grad():
        s = layers["separate"].shared
        h = x @ s.gate_up.t()
        g, u = h[:, :2 * I].clamp(max=params.limit), h[:, 2 * I:].clamp(-params.limit, params.limit)
        shared = (g * torch.sigmoid(params.alpha * g) * (u + 1)) @ s.down.t() * torch.sigmoid(x @ s.gate.t())
        w, ids = route(logits, layers["fused"].routing)
        ref = reference_experts(x, layers["fused"].experts.expert_weights(), w, ids,
                                activation="swigluoai", activation_params=params) + shared
        for mode, layer in layers.items():
            assert rel_err(layer(x, logits), ref) <= 1e-5, mode


@pytest.mark.parametrize("convert", ["half", "bfloat16", "to"])
def test_correction_bias_stays_fp32_through_dtype_casts(convert, gen):
    """.half() / .to(bf16) rounded the fp32 correction bias to 16 bits: other experts were picked
    than in fp32, and update_correction_bias's steps of 1e-3 vanished at |bias| >= 0.5 in bf16."""
    from moekit.balance import update_correction_bias

    layer = FusedMoE(E, H, I, RoutingConfig(top_k=2, scoring="sigmoid"), correction_bias=True)
    bias = 0.5 + torch.rand(E, generator=gen)  # values 16 bits cannot hold
    layer.e_score_correction_bias.copy_(bias)
    layer = {"half": lambda m: m.half(), "bfloat16": lambda m: m.bfloat16(),
             "to": lambda m: m.to("cpu", torch.bfloat16)}[convert](layer)
    assert layer.experts.w13.dtype != torch.float32
    assert layer.e_score_correction_bias.dtype == torch.float32
    assert torch.equal(layer.e_score_correction_bias, bias)
    ids = torch.randint(0, E, (64, 2), generator=gen, dtype=torch.int32)
    update_correction_bias(layer.e_score_correction_bias, ids, gamma=1e-3)
    assert not torch.equal(layer.e_score_correction_bias, bias)

"""Bad input raises errors that name the argument and what was expected."""

import pytest
import torch

from moekit import ActivationParams, FusedMoE, RoutingConfig, SharedExpertsConfig, fused_experts

E, H, I, k, T = 4, 16, 8, 2, 5


@pytest.fixture
def ok():
    return dict(
        hidden_states=torch.randn(T, H), w13=torch.randn(E, 2 * I, H), w2=torch.randn(E, H, I),
        topk_weights=torch.rand(T, k), topk_ids=torch.randint(0, E, (T, k), dtype=torch.int32),
    )


def call(args, **kw):
    a = dict(args)
    return fused_experts(a.pop("hidden_states"), a.pop("w13"), a.pop("w2"), a.pop("topk_weights"),
                         a.pop("topk_ids"), **kw)


@pytest.mark.parametrize(
    "field,value,match",
    [
        ("hidden_states", torch.randn(T, H, 1), "hidden_states must be 2-D"),
        ("hidden_states", torch.randint(0, 3, (T, H)), "hidden_states must be float32"),
        ("w13", torch.randn(E, I, H), r"w13 must be \[E=4, 16, H=16\]"),
        ("w2", torch.randn(E, H + 1, I), "w2 must be"),
        ("topk_ids", torch.randint(0, E, (T + 1, k)), "topk_ids must be"),
        ("topk_ids", torch.rand(T, k), "topk_ids must be an integer tensor"),
        ("topk_ids", torch.full((T, k), E, dtype=torch.int32), r"topk_ids must lie in \[0, 4\)"),
        ("topk_ids", torch.full((T, k), -1, dtype=torch.int32), r"topk_ids must lie in"),
        ("topk_weights", torch.rand(T, k + 1), "topk_weights must have the shape"),
        ("topk_weights", torch.ones(T, k, dtype=torch.int64), "topk_weights must be a float tensor"),
        ("w13", [1, 2], "w13 must be a torch.Tensor"),
        ("w2", torch.randn(E - 1, H, I), "w13 and w2 must hold the same number of experts"),
        ("topk_ids", torch.zeros(T, 0, dtype=torch.int32), r"topk_ids must be \[T=5, k\] with k >= 1"),
        # float64 is a float dtype: the message said "must be float tensors, got torch.float64"
        ("w2", torch.randn(E, H, I, dtype=torch.float64), "w13 and w2 must be float32, bfloat16 or float16, got "
         "torch.float32 and torch.float64"),
    ],
)
def test_fused_experts_rejects(ok, field, value, match):
    ok[field] = value
    with pytest.raises((ValueError, TypeError), match=match):
        call(ok)


def test_unknown_activation(ok):
    with pytest.raises(ValueError, match="activation must be one of"):
        call(ok, activation="swish")


def test_unknown_backend(ok):
    with pytest.raises(ValueError, match="backend must be 'auto' or one of"):
        call(ok, backend="cuda_magic")


def test_bias_shape(ok):
    with pytest.raises(ValueError, match=r"b13 must be \[E=4, 16\]"):
        call(ok, b13=torch.randn(E, I))


def test_bias_dtype(ok):
    with pytest.raises(TypeError, match="b2 must be a float tensor, got torch.int64"):
        call(ok, b2=torch.zeros(E, H, dtype=torch.int64))


def test_router_logits_must_follow_x():
    layer = FusedMoE(E, H, I, RoutingConfig(top_k=k))
    x = torch.randn(2, 3, H)
    assert layer(x, torch.randn(2, 3, E)).shape == (2, 3, H)
    assert layer(x, torch.randn(6, E)).shape == (2, 3, H)  # [T, E] over the flattened tokens
    for bad in (torch.randn(3, 2, E), torch.randn(6 * E)):
        with pytest.raises(ValueError, match="router_logits must be"):
            layer(x, bad)


def test_expert_map_values(ok):
    with pytest.raises(ValueError, match="expert_map entries must be -1 or a local expert id"):
        call(ok, expert_map=torch.tensor([0, 1, 2, 3, 7], dtype=torch.int32))


def test_weight_on_input_needs_k1(ok):
    with pytest.raises(ValueError, match="apply_router_weight_on_input needs top_k == 1"):
        call(ok, apply_router_weight_on_input=True)


@pytest.mark.skipif(not torch.backends.mps.is_available() and not torch.cuda.is_available(),
                    reason="needs a second device type")
def test_device_mismatch(ok):  # pragma: no cover - depends on hardware
    ok["w2"] = ok["w2"].to("cuda" if torch.cuda.is_available() else "mps")
    with pytest.raises(ValueError, match="w2 is on"):
        call(ok)


def test_device_mismatch_meta(ok):
    ok["w2"] = ok["w2"].to("meta")
    with pytest.raises(ValueError, match="w2 is on meta, expected cpu"):
        call(ok)


@pytest.mark.parametrize(
    "kw,exc,match",
    [
        (dict(num_experts=0), ValueError, "num_experts must be an int >= 1"),
        (dict(routing="softmax"), TypeError, "routing must be a RoutingConfig"),
        (dict(routing=RoutingConfig(top_k=9)), ValueError, "top_k=9 is larger"),
        (dict(activation="tanh"), ValueError, "activation must be one of"),
        (dict(backend="nope"), ValueError, "backend must be 'auto'"),
        (dict(shared_experts=SharedExpertsConfig(12, mode="fused")), ValueError, "multiple of 8"),
        (dict(shared_experts=16), TypeError, "shared_experts must be a SharedExpertsConfig"),
        # accepted before: a truthy string built a gate, bad dtypes failed in torch or in forward
        (dict(gate="no"), TypeError, "gate must be a bool, got 'no'"),
        (dict(bias=1), TypeError, "bias must be a bool, got 1"),
        (dict(correction_bias="yes"), TypeError, "correction_bias must be a bool"),
        (dict(gate_bias=True), ValueError, "gate_bias=True needs gate=True"),
        (dict(dtype=torch.float64), TypeError, r"dtype must be None or one of .*got torch.float64"),
        (dict(dtype=torch.int32), TypeError, r"dtype must be None or one of .*got torch.int32"),
        (dict(gate=True, router_dtype="float32"), TypeError, r"router_dtype must be None or one of .*got 'float32'"),
        (dict(activation="swigluoai", activation_params=dict(alpha=1.0)), TypeError,
         "activation_params must be an ActivationParams or None, got dict"),
        (dict(routing=RoutingConfig(top_k=1, apply_router_weight_on_input=True),
              shared_experts=SharedExpertsConfig(8, mode="fused")), ValueError,
         "shared_experts mode 'fused' cannot be combined with routing.apply_router_weight_on_input"),
    ],
)
def test_layer_construction_errors(kw, exc, match):
    args = dict(num_experts=E, hidden_size=H, intermediate_size=I, routing=RoutingConfig(top_k=2))
    args.update(kw)
    with pytest.raises(exc, match=match):
        FusedMoE(**args)


def test_layer_takes_numpy_integer_sizes():
    np = pytest.importorskip("numpy")  # refused before, where RoutingConfig took them
    layer = FusedMoE(np.int64(E), np.int32(H), np.int64(I), RoutingConfig(top_k=np.int64(2)))
    assert (layer.num_experts, layer.hidden_size, layer.intermediate_size) == (E, H, I)
    assert type(layer.num_experts) is int and layer(torch.randn(3, H), torch.randn(3, E)).shape == (3, H)
    for bad in (True, 4.0, 0):
        with pytest.raises(ValueError, match=f"num_experts must be an int >= 1, got {bad!r}"):
            FusedMoE(bad, H, I, RoutingConfig(top_k=1))


def test_layer_forward_errors():
    layer = FusedMoE(E, H, I, RoutingConfig(top_k=2))
    with pytest.raises(ValueError, match="router_logits is required"):
        layer(torch.randn(3, H))
    with pytest.raises(ValueError, match=r"x must be \[.., H=16\]"):
        layer(torch.randn(3, H + 1), torch.randn(3, E))
    with pytest.raises(ValueError, match="router_logits must be"):
        layer(torch.randn(3, H), torch.randn(4, E))
    with pytest.raises(ValueError, match="router_logits contains NaN"):
        layer(torch.randn(2, H), torch.tensor([[float("nan")] * E] * 2))
    # logits on another device than x reached the router and the backend unchecked
    with pytest.raises(ValueError, match="router_logits is on meta, expected cpu"):
        layer(torch.randn(3, H), torch.randn(3, E, device="meta"))


@pytest.mark.parametrize(
    "make,exc,match",
    [  # each was accepted before: bool or string flags, an activation failing only in the layer,
       # swigluoai clamps that silently produced garbage (a limit <= 0 clamps up with min > max)
        (lambda: SharedExpertsConfig(True), ValueError, "intermediate_size must be an int >= 1, got True"),
        (lambda: SharedExpertsConfig(8, gated="yes"), TypeError, "gated must be a bool, got 'yes'"),
        (lambda: SharedExpertsConfig(8, activation="tanh"), ValueError, "activation must be one of"),
        (lambda: ActivationParams(alpha=float("nan")), ValueError, "alpha must be a finite number, got nan"),
        (lambda: ActivationParams(limit=-1.0), ValueError, r"limit must be a number > 0 \(inf: no clamp\), got -1.0"),
        (lambda: ActivationParams(limit=float("nan")), ValueError, "limit must be a number > 0"),
        (lambda: ActivationParams(alpha="1.7"), ValueError, "alpha must be a finite number, got '1.7'"),
    ],
)
def test_config_errors(make, exc, match):
    with pytest.raises(exc, match=match):
        make()


def test_config_accepts_numpy_and_int_numbers():
    np = pytest.importorskip("numpy")
    assert SharedExpertsConfig(np.int64(16)).intermediate_size == 16
    assert ActivationParams(alpha=2, limit=float("inf")) == ActivationParams(alpha=2.0, limit=float("inf"))

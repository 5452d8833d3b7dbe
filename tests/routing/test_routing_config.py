"""RoutingConfig validation: invalid combinations name the field."""

import pytest
import torch

from moekit import RoutingConfig, route


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(top_k=0), "top_k"),
        (dict(top_k=2, scoring="tanh"), "scoring"),
        (dict(top_k=2, order="random"), "order"),
        (dict(top_k=2, num_expert_group=4), "topk_group"),
        (dict(top_k=2, num_expert_group=4, topk_group=5), "topk_group"),
        (dict(top_k=2, num_expert_group=4, topk_group=2, order="topk_then_softmax"), "num_expert_group"),
        (dict(top_k=2, routed_scaling_factor=0.0), "routed_scaling_factor"),
        (dict(top_k=2, group_score="mean"), "group_score"),
        (dict(top_k=2, scale_on="input"), "scale_on"),
        (dict(top_k=2, order="topk_then_sigmoid", scoring="sigmoid"), "scoring"),
        (dict(top_k=2.0), "top_k must be an int"),
        (dict(top_k=2, num_expert_group=2.0, topk_group=1), "num_expert_group must be an int"),
        (dict(top_k=2, num_expert_group=2, topk_group="1"), "topk_group must be an int"),
        (dict(top_k=2, routed_scaling_factor=float("inf")), "routed_scaling_factor must be a finite number"),
        (dict(top_k=2, routed_scaling_factor="2"), "routed_scaling_factor must be a finite number"),
        (dict(top_k=2, order="topk_then_sigmoid", apply_router_weight_on_input=True),
         "apply_router_weight_on_input needs top_k == 1"),
    ],
)
def test_invalid_config_names_field(kw, match):
    with pytest.raises(ValueError, match=match):
        RoutingConfig(**kw)


def test_flags_must_be_bools_and_numpy_ints_are_ints():
    for name in ("renormalize", "apply_router_weight_on_input", "group_fallback"):
        with pytest.raises(TypeError, match=f"{name} must be a bool"):
            RoutingConfig(top_k=1, **{name: "no"})
    np = pytest.importorskip("numpy")
    cfg = RoutingConfig(top_k=np.int64(2), num_expert_group=np.int32(4), topk_group=np.int64(2))
    assert type(cfg.top_k) is int and type(cfg.num_expert_group) is int and cfg.topk_group == 2


def test_custom_must_be_callable():
    with pytest.raises(TypeError, match="custom"):
        RoutingConfig(top_k=1, custom=3)


def test_topk_larger_than_experts():
    with pytest.raises(ValueError, match="top_k=9 is larger than the number of experts 8"):
        route(torch.randn(2, 8), RoutingConfig(top_k=9))


@pytest.mark.parametrize("E,G", [(30, 4), (4, 4)])
def test_groups_that_do_not_fit_are_errors(E, G):
    cfg = RoutingConfig(top_k=2, num_expert_group=G, topk_group=2)
    with pytest.raises(ValueError, match="num_expert_group"):
        route(torch.randn(2, E), cfg)


def test_group_fallback_routes_without_groups():
    cfg = RoutingConfig(top_k=2, num_expert_group=4, topk_group=2, group_fallback=True)
    z = torch.randn(5, 30)
    w, ids = route(z, cfg)
    w2, ids2 = route(z, RoutingConfig(top_k=2))
    assert torch.equal(ids, ids2) and torch.equal(w, w2)


def test_group_score_without_groups_is_refused():
    """group_score without num_expert_group was accepted and silently ignored."""
    with pytest.raises(ValueError, match=r"group_score='max' only applies to grouped top-k"):
        RoutingConfig(top_k=2, group_score="max")


def test_topk_beyond_kept_groups():
    cfg = RoutingConfig(top_k=5, num_expert_group=4, topk_group=1)
    with pytest.raises(ValueError, match="top_k=5 exceeds"):
        route(torch.randn(2, 16), cfg)


def test_correction_bias_shape():
    with pytest.raises(ValueError, match="correction_bias must have shape"):
        route(torch.randn(2, 8), RoutingConfig(top_k=2), torch.zeros(7))


@pytest.mark.parametrize("bias, exc, match", [
    ([0.0] * 8, TypeError, r"correction_bias must be a torch.Tensor \[8\] or None, got list"),  # was AttributeError
    (torch.zeros(8, dtype=torch.int64), TypeError, r"correction_bias must be a float tensor \[8\], got torch.int64"),
    (torch.zeros(8, dtype=torch.bool), TypeError, r"correction_bias must be a float tensor \[8\], got torch.bool"),
])
def test_correction_bias_type(bias, exc, match):
    """A non-tensor bias crashed inside route; an integer or bool bias was silently added to the scores."""
    with pytest.raises(exc, match=match):
        route(torch.randn(2, 8), RoutingConfig(top_k=2, scoring="sigmoid"), bias)


def test_correction_bias_with_custom_names_custom():
    """The refusal used to say "needs order='score_then_topk' ..., got order='score_then_topk'"."""
    cfg = RoutingConfig(top_k=2, custom=lambda h, z, k: (torch.ones(z.shape[0], k), torch.zeros(z.shape[0], k, dtype=torch.long)))
    with pytest.raises(ValueError, match=r"correction_bias does not apply to a custom routing function"):
        route(torch.randn(2, 8), cfg, torch.zeros(8))
    with pytest.raises(ValueError, match=r"correction_bias needs order='score_then_topk', got order='topk_then_softmax'"):
        route(torch.randn(2, 8), RoutingConfig(top_k=2, order="topk_then_softmax"), torch.zeros(8))


def test_config_must_be_routing_config():
    with pytest.raises(TypeError, match="config must be a RoutingConfig, got dict"):  # was AttributeError
        route(torch.randn(2, 8), {"top_k": 2})


def test_router_logits_must_be_2d():
    with pytest.raises(ValueError, match="router_logits must be 2-D"):
        route(torch.randn(2, 3, 8), RoutingConfig(top_k=2))


def test_renormalize_defaults_to_the_orders_rule_and_is_honoured():
    """Regression: renormalize (default True) was silently ignored by the top-k-first orders, so
    top-k then sigmoid with renormalize=True (Cohere2-MoE) gave unnormalised weights."""
    assert RoutingConfig(top_k=2).renormalize is True
    assert RoutingConfig(top_k=2, order="topk_then_softmax").renormalize is True
    assert RoutingConfig(top_k=1, order="topk_then_sigmoid").renormalize is False  # Llama-4
    assert RoutingConfig(top_k=2) == RoutingConfig(top_k=2, renormalize=True)
    z = torch.tensor([[0.5, -1.0, 2.0, 0.1]])
    picked = torch.tensor([2.0, 0.5]).sigmoid()
    w, ids = route(z, RoutingConfig(top_k=2, order="topk_then_sigmoid", renormalize=True))
    assert ids.tolist() == [[2, 0]]
    torch.testing.assert_close(w, (picked / picked.sum()).view(1, 2))
    w, _ = route(z, RoutingConfig(top_k=2, order="topk_then_sigmoid"))
    torch.testing.assert_close(w, picked.view(1, 2))

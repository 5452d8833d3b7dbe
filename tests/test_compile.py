"""torch.compile(fullgraph=True) of a FusedMoE on CPU: the routing and the backend trace without a
graph break, the outputs match eager, and value checks become assertions inside the graph.

Backends that run host-driven code (`cpu`, `cpu_int8`, `cpu_wo`) or data-dependent shapes
(`reference`) are traced with graph breaks instead (plain torch.compile); `grouped_mm` and
`triton` (tests/kernels/test_triton_interpret.py) trace whole."""

import pytest
import torch

from moekit import FusedMoE, RoutingConfig

from conftest import TOL, rel_err

E, H, I = 8, 64, 32


def _layers(routing, **kw):
    layer = FusedMoE(E, H, I, routing, dtype=torch.bfloat16, backend="grouped_mm", **kw).eval()
    ref = FusedMoE(E, H, I, routing, dtype=torch.bfloat16, backend="reference", **kw).eval()
    ref.load_state_dict(layer.state_dict())
    return layer, ref


@pytest.mark.parametrize("routing", [
    RoutingConfig(top_k=2),
    RoutingConfig(top_k=3, scoring="sigmoid", num_expert_group=4, topk_group=2, routed_scaling_factor=2.5),
], ids=["softmax", "deepseek"])
def test_fullgraph_layer_matches_eager(routing):
    deepseek = routing.num_expert_group is not None
    layer, ref = _layers(routing, correction_bias=deepseek)
    if deepseek:
        layer.e_score_correction_bias.normal_(0, 0.1)
        ref.e_score_correction_bias.copy_(layer.e_score_correction_bias)
    compiled = torch.compile(layer, fullgraph=True)
    with torch.no_grad():
        for T in (1, 5, 9):  # fresh inputs; the compiled graph serves several token counts
            x, logits = torch.randn(T, H, dtype=torch.bfloat16), torch.randn(T, E)
            out = compiled(x, logits)
            assert out.shape == (T, H) and out.dtype == torch.bfloat16
            assert rel_err(out, ref(x, logits)) <= TOL[torch.bfloat16]


def test_value_checks_are_assertions_in_the_graph():
    """NaN logits and a non-finite correction bias still raise under torch.compile on CPU."""
    routing = RoutingConfig(top_k=2, scoring="sigmoid", num_expert_group=4, topk_group=2)
    layer, _ = _layers(routing, correction_bias=True)
    compiled = torch.compile(layer, fullgraph=True)
    x, logits = torch.randn(4, H, dtype=torch.bfloat16), torch.randn(4, E)
    with torch.no_grad():
        compiled(x, logits)
        bad = logits.clone()
        bad[2, 5] = float("nan")
        with pytest.raises(RuntimeError, match="router_logits contains NaN"):
            compiled(x, bad)
        layer.e_score_correction_bias[3] = float("inf")
        with pytest.raises(RuntimeError, match="correction_bias must be finite"):
            compiled(x, logits)

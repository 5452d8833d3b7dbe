"""FusedMoE(eager_graphs=N): eager CUDA calls replay CUDA graphs of the routed step (moekit.graphs).

CPU: the argument is checked, calls run directly, copies and pickles of the layer start with no
graphs. GPU (gpu mark): calls with repeated token counts run, capture, then replay, bit for bit
equal to a layer without graphs; in-place weight updates reach the replays, moved weights drop
the graphs, autograd-enabled calls run directly.
"""

import copy
import pickle

import pytest
import torch

from moekit import FusedMoE, RoutingConfig, SharedExpertsConfig
from moekit.graphs import EagerGraphs


def test_argument_is_checked_and_cpu_calls_run_directly():
    with pytest.raises(ValueError, match="eager_graphs must be an int >= 0, got -1"):
        FusedMoE(8, 32, 16, RoutingConfig(top_k=2), eager_graphs=-1)
    with pytest.raises(ValueError, match="eager_graphs must be an int >= 0, got True"):
        EagerGraphs(True)
    layer = FusedMoE(8, 32, 16, RoutingConfig(top_k=2), eager_graphs=4)
    plain = copy.deepcopy(layer)
    plain._graphs = EagerGraphs(0)
    x, logits = torch.randn(5, 32), torch.randn(5, 8)
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(layer(x, logits), plain(x, logits))
    assert len(layer._graphs) == 0 and not layer._graphs.usable((x, logits))
    again = pickle.loads(pickle.dumps(layer))
    assert again._graphs.max_graphs == 4 and len(again._graphs) == 0


def test_fused_shared_storage_follows_in_place_writes():
    """What a captured step reads (FusedMoE._graph_storage) includes, in mode "fused", the
    versions of the weights behind the concatenated copy, so an in-place write drops the graphs
    (the GPU test below replays); other modes read the weights themselves and keep theirs."""
    for mode, changes in (("fused", True), ("separate", False)):
        layer = FusedMoE(8, 32, 16, RoutingConfig(top_k=2), shared_experts=SharedExpertsConfig(16, mode=mode))
        before = layer._graph_storage()
        with torch.no_grad():
            layer.shared.down.mul_(2.0)
        assert (layer._graph_storage() != before) == changes, mode


def _pair(**kw):
    torch.manual_seed(0)
    base = FusedMoE(16, 256, 128, RoutingConfig(top_k=4), dtype=torch.bfloat16, device="cuda", **kw)
    for p in base.parameters():
        torch.nn.init.normal_(p, std=0.05)
    graphed = copy.deepcopy(base)
    graphed._graphs = EagerGraphs(4)
    return base, graphed


@pytest.mark.gpu
@pytest.mark.parametrize("shared", [None, "overlap"])
def test_replays_equal_direct_calls(shared):
    kw = {} if shared is None else dict(shared_experts=SharedExpertsConfig(64, gated=True, mode=shared))
    base, graphed = _pair(**kw)
    gen = torch.Generator(device="cuda").manual_seed(1)
    with torch.no_grad():
        for T in (1, 5, 1, 1, 5, 5, 37, 1):
            x = torch.randn(T, 256, device="cuda", generator=gen).bfloat16()
            logits = torch.randn(T, 16, device="cuda", generator=gen)
            assert torch.equal(graphed(x, logits), base(x, logits)), T
        assert len(graphed._graphs) == 2  # T = 1 and 5 captured; 37 ran once, directly
        # in place: the replay reads the new weights
        w13 = torch.randn(16, 256, 256, device="cuda", generator=gen) * 0.05
        w2 = torch.randn(16, 256, 128, device="cuda", generator=gen) * 0.05
        base.load_weights(w13, w2)
        graphed.load_weights(w13, w2)
        x = torch.randn(1, 256, device="cuda", generator=gen).bfloat16()
        logits = torch.randn(1, 16, device="cuda", generator=gen)
        assert torch.equal(graphed(x, logits), base(x, logits)) and len(graphed._graphs) == 2
        # moved: new storage drops every graph, the call runs directly
        graphed.experts.w13 = torch.nn.Parameter(graphed.experts.w13.detach().clone(), requires_grad=False)
        assert torch.equal(graphed(x, logits), base(x, logits)) and len(graphed._graphs) == 0
    # autograd on: direct calls only
    assert torch.equal(graphed(x, logits).detach(), base(x, logits).detach()) and len(graphed._graphs) == 0


@pytest.mark.gpu
def test_fused_shared_replays_follow_in_place_updates():
    """Mode "fused" runs on a concatenated copy of the routed and shared weights; a replay read
    the copy taken at capture, so in-place writes (load_weights, the shared MLP's weights) did not
    reach it. They now drop the graphs, and the next calls capture again."""
    base, graphed = _pair(shared_experts=SharedExpertsConfig(128, gated=True, mode="fused"))
    gen = torch.Generator(device="cuda").manual_seed(2)
    x = torch.randn(3, 256, device="cuda", generator=gen).bfloat16()
    logits = torch.randn(3, 16, device="cuda", generator=gen)
    with torch.no_grad():
        for _ in range(3):  # run, capture, replay
            assert torch.equal(graphed(x, logits), base(x, logits))
        assert len(graphed._graphs) == 1
        w13 = torch.randn(16, 256, 256, device="cuda", generator=gen) * 0.05
        w2 = torch.randn(16, 256, 128, device="cuda", generator=gen) * 0.05
        for layer in (base, graphed):
            layer.load_weights(w13, w2)
            layer.shared.down.mul_(-2.0)
        for _ in range(3):
            assert torch.equal(graphed(x, logits), base(x, logits))
        assert len(graphed._graphs) == 1

"""EplbState in one process: trigger schedule, FusedMoE with redundant experts, async = sync."""

import time

import pytest
import torch

import moekit
from conftest import TOL, rel_err
from moekit.eplb import EplbConfig, EplbState, enable_eplb, initial_placement
from moekit.experts.base import ExpertWeights


def _weights(S, H=4, I=2):
    w = ExpertWeights(torch.randn(S, 2 * I, H), torch.randn(S, H, I))
    return lambda: w


@pytest.mark.parametrize("interval,expected",
                         [(8, [2, 10, 18]), (3, [1, 4, 7, 10, 13, 16, 19]), (1, list(range(1, 21)))],
                         ids=["quarter-then-every-8", "short-interval", "every-step"])
def test_trigger_schedule_counts_dummy_steps(interval, expected):
    state = EplbState([_weights(6)], 4, EplbConfig(num_redundant=2, step_interval=interval, window_size=2))
    fired = []
    for step in range(1, 21):
        before = state.rearrangements
        state.step(dummy=(step % 3 == 0))  # dummy steps advance the counter like real ones
        if state.rearrangements != before:
            fired.append(step)
    assert fired == expected
    assert state.steps == 20


def test_config_errors():
    with pytest.raises(ValueError, match="num_redundant must be an int >= 0"):
        EplbConfig(num_redundant=-1)
    with pytest.raises(ValueError, match="mode must be one of"):
        EplbConfig(mode="eager")
    with pytest.raises(ValueError, match="step_interval must be an int >= 1"):
        EplbConfig(step_interval=0)
    with pytest.raises(ValueError, match="must hold this rank's S=6 slots"):
        EplbState([_weights(5)], 4, EplbConfig(num_redundant=2))
    with pytest.raises(ValueError, match="num_nodes=2 must divide the 1 expert-parallel ranks"):
        EplbState([_weights(7)], 4, EplbConfig(num_redundant=3, num_nodes=2))
    with pytest.raises(ValueError, match="num_groups=3 must divide the number of experts E=4"):
        EplbState([_weights(7)], 4, EplbConfig(num_redundant=3, num_groups=3))


def _skewed_logits(T, E, hot=(0, 1)):
    logits = torch.randn(T, E)
    logits[:, list(hot)] += 2.5
    return logits


def _plain_copy(layer, E, H, I, routing, **kw):
    plain = moekit.FusedMoE(E, H, I, routing, **kw)
    plain.load_weights(layer.experts.w13.detach().clone(), layer.experts.w2.detach().clone(),
                       *(None if b is None else b.detach().clone() for b in (layer.experts.b13, layer.experts.b2)))
    return plain


@pytest.mark.parametrize("bias,shared", [(False, None), (True, None),
                                         (False, moekit.SharedExpertsConfig(8, mode="fused"))],
                         ids=["plain", "bias", "fused-shared-experts"])
def test_fused_moe_with_redundant_experts_matches_plain_layer(bias, shared):
    E, H, I, k = 6, 24, 8, 2
    routing = moekit.RoutingConfig(top_k=k)
    layers = [moekit.FusedMoE(E, H, I, routing, bias=bias, shared_experts=shared) for _ in range(2)]
    for m in layers:
        if bias:
            torch.nn.init.normal_(m.experts.b13)
            torch.nn.init.normal_(m.experts.b2)
    plains = [_plain_copy(m, E, H, I, routing, bias=bias, shared_experts=shared) for m in layers]
    for m, p in zip(layers, plains):
        if shared is not None:
            p.shared.load_state_dict(m.shared.state_dict())
    # One rank is always balanced, so the default min_improvement would keep every placement;
    # None applies the policy's plans, whose moves are what this test checks.
    state = enable_eplb(layers, EplbConfig(num_redundant=4, step_interval=4, window_size=3, min_improvement=None))
    assert layers[0].experts.w13.shape[0] == E + 4
    for slot, e in enumerate(state.phy2log[0].tolist()):  # replicas are exact copies
        assert torch.equal(layers[0].experts.w13[slot], plains[0].experts.w13[e])
    changed = False
    for step in range(6):
        x, logits = torch.randn(13 + step, H), _skewed_logits(13 + step, E)
        for m, p in zip(layers, plains):
            out, ref = m(x, logits), p(x, logits)
            assert rel_err(out, ref) <= TOL[torch.float32]
        changed = state.step() or changed
    assert changed and state.rearrangements == 2  # steps 1 and 5
    hot_replicas = state.replica_count[:, :2].sum(-1)
    assert bool((hot_replicas >= 4).all()), state.replica_count  # the hot experts got the spare slots
    for layer in range(2):  # after the move every slot holds its expert's exact bytes
        for slot, e in enumerate(state.phy2log[layer].tolist()):
            assert torch.equal(layers[layer].experts.w13[slot], plains[layer].experts.w13[e])
            assert torch.equal(layers[layer].experts.w2[slot], plains[layer].experts.w2[e])


def test_recorded_load_matches_routing():
    E, H, I = 5, 8, 4
    routing = moekit.RoutingConfig(top_k=2)
    layer = moekit.FusedMoE(E, H, I, routing)
    state = enable_eplb(layer, EplbConfig(num_redundant=3, step_interval=1000))
    x, logits = torch.randn(11, H), torch.randn(11, E)
    state.set_num_tokens(7)  # rows 7..10 are padding
    layer(x, logits)
    ids = layer.runner.last_topk.ids
    physical = state.recorder.current[0]
    logical = torch.zeros(E, dtype=torch.int64).scatter_add_(0, state.phy2log[0], physical)
    assert logical.tolist() == torch.bincount(ids[:7].reshape(-1).long(), minlength=E).tolist()


def test_num_tokens_holds_for_one_step():
    E, H = 5, 8
    layer = moekit.FusedMoE(E, H, 4, moekit.RoutingConfig(top_k=2))
    state = enable_eplb(layer, EplbConfig(num_redundant=3, step_interval=1000, window_size=4))
    state.set_num_tokens(2)  # a padded step: 2 real rows of 5
    layer(torch.randn(5, H), torch.randn(5, E))
    state.step()
    layer(torch.randn(6, H), torch.randn(6, E))  # a full step: all 6 rows count
    state.step()
    assert state.recorder.window_load().sum().item() == (2 + 6) * 2


def test_bad_load_leaves_weights_and_maps_alone():
    E, H, I = 4, 8, 4
    layer = moekit.FusedMoE(E, H, I, moekit.RoutingConfig(top_k=2))
    state = enable_eplb(layer, EplbConfig(num_redundant=2))
    w13, phy2log = layer.experts.w13.detach().clone(), state.phy2log.clone()
    for load, error, message in ((torch.ones(1, E - 1), ValueError, r"logical_load must be \[L=1, E=4\]"),
                                 (torch.ones(1, E + 1), ValueError, r"got \(1, 5\)"),
                                 (torch.ones(2, E), ValueError, r"got \(2, 4\)"),
                                 (-torch.ones(1, E), ValueError, "non-negative"),
                                 ([[1, 2, 3, 4]], TypeError, "must be a torch.Tensor")):
        with pytest.raises(error, match=message):
            state.rearrange(load)
        assert torch.equal(layer.experts.w13, w13) and torch.equal(state.phy2log, phy2log)


def test_refused_enable_leaves_layers_alone():
    routing = moekit.RoutingConfig(top_k=2)
    layers = [moekit.FusedMoE(4, 8, 4, routing) for _ in range(2)]
    x, logits = torch.randn(5, 8), torch.randn(5, 4)
    before = [m(x, logits) for m in layers]
    with pytest.raises(ValueError, match="num_groups=3"):
        enable_eplb(layers, EplbConfig(num_redundant=2, num_groups=3))
    with pytest.raises(ValueError, match="logical_weights has no 'w2'"):  # the second layer's weights lack w2
        enable_eplb(layers, EplbConfig(num_redundant=2),
                    logical_weights=[layers[0].experts.expert_weights(), _NoW2(layers[1].experts.expert_weights())])
    for m, y in zip(layers, before):
        assert m.experts.w13.shape[0] == 4 and m.runner.eplb is None
        assert torch.equal(m(x, logits), y)


class _NoW2:
    def __init__(self, w):
        self.w, self.num_experts = w, w.num_experts

    def per_expert_tensors(self):
        return [(n, t) for n, t in self.w.per_expert_tensors() if n != "w2"]


def test_load_weights_takes_logical_tensors():
    E, H, I = 4, 8, 6
    routing = moekit.RoutingConfig(top_k=2)
    layer = moekit.FusedMoE(E, H, I, routing, bias=True)
    state = enable_eplb(layer, EplbConfig(num_redundant=4))
    state.rearrange(torch.tensor([[50, 1, 1, 9]]))  # a placement other than the initial one
    w13, w2, b13, b2 = torch.randn(E, 2 * I, H), torch.randn(E, H, I), torch.randn(E, 2 * I), torch.randn(E, H)
    layer.load_weights(w13, w2, b13, b2)
    plain = moekit.FusedMoE(E, H, I, routing, bias=True)
    plain.load_weights(w13, w2, b13, b2)
    x, logits = torch.randn(9, H), torch.randn(9, E)
    assert rel_err(layer(x, logits), plain(x, logits)) <= TOL[torch.float32]
    with pytest.raises(ValueError, match=r"per-expert tensor \[E=4"):
        layer.load_weights(w13[:3], w2[:3])


def test_enable_eplb_errors():
    routing = moekit.RoutingConfig(top_k=1)
    layer = moekit.FusedMoE(4, 8, 4, routing)
    enable_eplb(layer, EplbConfig(num_redundant=0))
    with pytest.raises(ValueError, match="already has EPLB enabled"):
        enable_eplb(layer, EplbConfig())
    with pytest.raises(ValueError, match="every layer must have E=4"):
        enable_eplb([moekit.FusedMoE(4, 8, 4, routing), moekit.FusedMoE(6, 8, 4, routing)], EplbConfig())
    with pytest.raises(TypeError, match="EplbConfig"):
        enable_eplb(moekit.FusedMoE(4, 8, 4, routing), {"num_redundant": 1})


def _run_until_idle(state, max_steps=2000):
    for _ in range(max_steps):
        if not state.rearranging:
            return
        time.sleep(0.002)
        state.step()
    raise AssertionError("the asynchronous rearrangement did not finish")


def test_async_mode_gives_the_sync_result():
    E, H, I, L = 8, 16, 8, 3
    routing = moekit.RoutingConfig(top_k=2)
    base = [moekit.FusedMoE(E, H, I, routing) for _ in range(L)]
    results = {}
    load = (torch.randn(L, E) * 2).exp().round()
    load[:, -2:] += 1000  # the last experts get the replicas: the placement must move
    for mode in ("sync", "async"):
        layers = [_plain_copy(m, E, H, I, routing) for m in base]
        state = enable_eplb(layers, EplbConfig(num_redundant=4, step_interval=10_000, mode=mode,
                                               min_improvement=None))  # one rank: apply the plan regardless
        state.rearrange(load)
        _run_until_idle(state)
        assert state.rearrangements == 1
        results[mode] = (state.phy2log.clone(), [m.experts.w13.detach().clone() for m in layers])
    assert torch.equal(results["sync"][0], results["async"][0])
    assert not torch.equal(results["sync"][0][0], torch.arange(E + 4) % E)  # the placement did move
    for a, b in zip(results["sync"][1], results["async"][1]):
        assert torch.equal(a, b)


def test_close_finishes_an_async_rearrangement():
    E, H, I, L = 8, 16, 8, 2
    routing = moekit.RoutingConfig(top_k=2)
    layers = [moekit.FusedMoE(E, H, I, routing) for _ in range(L)]
    plain = [_plain_copy(m, E, H, I, routing) for m in layers]
    state = enable_eplb(layers, EplbConfig(num_redundant=4, step_interval=10_000, mode="async",
                                           min_improvement=None))  # one rank: apply the plan regardless
    load = (torch.randn(L, E) * 2).exp().round()
    load[:, -2:] += 1000  # the last experts get the replicas: the placement must move
    state.rearrange(load)
    assert state.rearranging
    state.close()
    assert not state.rearranging and state.rearrangements == 1
    assert not torch.equal(state.phy2log[0], torch.arange(E + 4) % E)  # every layer committed
    x, logits = torch.randn(7, H), torch.randn(7, E)
    for m, p in zip(layers, plain):
        assert rel_err(m(x, logits), p(x, logits)) <= TOL[torch.float32]
    state.close()  # nothing running: a no-op
    # One process too (no worker group to release): close() used to leave the worker restartable,
    # and a rearrangement started after it could still be running at interpreter shutdown.
    with pytest.raises(RuntimeError, match=r"close\(\) has stopped the asynchronous worker"):
        state.rearrange(load)
    assert not state.rearranging


def test_a_failure_elsewhere_stops_a_waiting_worker():
    """A worker waiting with a staged layer when another rank's failed kept waiting, and the next
    rearrangement's release woke it to carry on with its old plan beside the new worker."""
    from moekit.eplb.async_worker import FAILED, STAGED

    E, H, I, L = 8, 16, 8, 3
    routing = moekit.RoutingConfig(top_k=2)
    layers = [moekit.FusedMoE(E, H, I, routing) for _ in range(L)]
    plain = [_plain_copy(m, E, H, I, routing) for m in layers]
    state = enable_eplb(layers, EplbConfig(num_redundant=4, step_interval=10_000, mode="async"))
    worker = state._worker
    load = (torch.randn(L, E) * 2).exp().round()
    load[:, -2:] += 1000  # every layer's placement moves
    state.rearrange(load)
    deadline = time.monotonic() + 30
    while worker._status != STAGED and time.monotonic() < deadline:
        time.sleep(1e-3)
    stale = worker._thread
    with worker._lock:  # what the all-reduce reports when another rank's worker failed
        worker._status = FAILED
    with pytest.raises(RuntimeError, match="failed on another rank"):
        state.step()
    stale.join(timeout=10)
    assert not stale.is_alive() and not state.rearranging
    state.rearrange(load)  # a new run completes alone
    state.close()
    assert state.rearrangements == 1
    x, logits = torch.randn(7, H), torch.randn(7, E)
    for m, p in zip(layers, plain):
        assert rel_err(m(x, logits), p(x, logits)) <= TOL[torch.float32]


def test_async_trigger_through_steps():
    E, H, I = 6, 8, 4
    routing = moekit.RoutingConfig(top_k=2)
    layer = moekit.FusedMoE(E, H, I, routing)
    plain = _plain_copy(layer, E, H, I, routing)
    state = enable_eplb(layer, EplbConfig(num_redundant=6, step_interval=4, mode="async"))
    x, logits = torch.randn(40, H), _skewed_logits(40, E)
    layer(x, logits)
    state.step()  # step 1: the trigger starts the worker
    assert state.rearranging
    _run_until_idle(state)
    assert state.replica_count[0, :2].sum() >= 4
    assert rel_err(layer(x, logits), plain(x, logits)) <= TOL[torch.float32]


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(phy2log=torch.tensor([[0, 1, 2, 3, 0.5, 1]])), TypeError,  # 0.5 was truncated to expert 0
     r"phy2log must be an integer tensor \[L=1, R=6\], got torch.float32"),
    (dict(phy2log=[[0, 1, 2, 3, 0, 1]]), TypeError, "phy2log must be an integer tensor .* got list"),  # AttributeError
    (dict(num_logical=4.0), ValueError, "num_logical must be an int >= 1 .* got 4.0"),  # failed inside torch.zeros
    (dict(num_logical=0), ValueError, "num_logical must be an int >= 1 .* got 0"),  # blamed a "load" argument
    (dict(weights="not callable"), TypeError, "weights must list, per layer, a callable"),
], ids=["float_phy2log", "list_phy2log", "float_E", "zero_E", "weights_not_callable"])
def test_state_argument_errors(kwargs, exc, match):
    w = ExpertWeights(torch.randn(6, 4, 2), torch.randn(6, 2, 2))
    args = dict(weights=[lambda: w], num_logical=4, config=EplbConfig(num_redundant=2))
    if kwargs.get("weights") == "not callable":
        kwargs = dict(weights=[w])
    args.update(kwargs)
    with pytest.raises(exc, match=match):
        EplbState(args.pop("weights"), args.pop("num_logical"), args.pop("config"), **args)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_one_rank_keeps_its_placement_by_default(mode):
    """One rank holds every slot, so no plan lowers its load: the default moves no weights."""
    E, H, I, L = 8, 16, 8, 2
    layers = [moekit.FusedMoE(E, H, I, moekit.RoutingConfig(top_k=2)) for _ in range(L)]
    state = enable_eplb(layers, EplbConfig(num_redundant=4, step_interval=10_000, mode=mode))
    before = [m.experts.w13.detach().clone() for m in layers]
    load = torch.ones(L, E)
    load[:, -2:] += 1000  # a plan would give the hot experts the spare slots
    assert torch.equal(state.plan(load), state.phy2log_host)
    assert not state.rearrange(load)
    _run_until_idle(state)
    assert torch.equal(state.phy2log.cpu(), initial_placement(L, E, E + 4))
    assert all(torch.equal(m.experts.w13, b) for m, b in zip(layers, before))


def test_min_improvement_must_be_a_fraction():
    for bad in (-0.1, 1.0, "0.1", True):
        with pytest.raises(ValueError, match="min_improvement must be None or a number in \\[0, 1\\)"):
            EplbConfig(min_improvement=bad)

"""Every routing variant against an independent per-token implementation written here."""

import math

import pytest
import torch

from moekit import RoutingConfig, route


def _scores(z: torch.Tensor, scoring: str) -> torch.Tensor:
    """The elementwise scoring, computed on the same fp32 logits (selection is what we test)."""
    if scoring == "softmax":
        return torch.softmax(z, dim=-1)
    if scoring == "sigmoid":
        return torch.sigmoid(z)
    return torch.sqrt(torch.nn.functional.softplus(z))


def loop_route(z, cfg: RoutingConfig, bias=None):
    """Per-token Python loop: the math of ROUTING.md, line by line."""
    z = z.float()
    T, E = z.shape
    k = cfg.top_k
    W, I = [], []
    for t in range(T):
        row = z[t]
        if cfg.order == "score_then_topk":
            p = _scores(row.unsqueeze(0), cfg.scoring)[0].tolist()
            c = list(p) if bias is None else [p[e] + float(bias[e]) for e in range(E)]
            if cfg.num_expert_group is not None:
                G, n = cfg.num_expert_group, E // cfg.num_expert_group
                gscore = []
                for g in range(G):
                    vals = sorted(c[g * n:(g + 1) * n], reverse=True)
                    mode = cfg.group_score or ("top2_sum" if bias is not None else "max")
                    gscore.append(vals[0] + vals[1] if mode == "top2_sum" and n >= 2 else vals[0])
                kept = sorted(range(G), key=lambda g: (-gscore[g], g))[: cfg.topk_group]
                c = [c[e] if e // n in kept else -math.inf for e in range(E)]
            ids = sorted(range(E), key=lambda e: (-c[e], e))[:k]
            w = [p[e] for e in ids]
            if cfg.renormalize:
                s = sum(w)
                w = [x / s for x in w]
        else:
            r = row.tolist()
            ids = sorted(range(E), key=lambda e: (-r[e], e))[:k]
            zk = torch.tensor([r[e] for e in ids])
            w = (torch.softmax(zk, 0) if cfg.order == "topk_then_softmax" else torch.sigmoid(zk)).tolist()
        if cfg.scale_on == "router":
            w = [x * cfg.routed_scaling_factor for x in w]
        W.append(w)
        I.append(ids)
    return torch.tensor(W, dtype=torch.float64).reshape(T, k), torch.tensor(I, dtype=torch.int64).reshape(T, k)


def tie_free_logits(T, E, gen):
    """Logits whose values (and hence scores) are at least 0.02 apart within each row."""
    base = torch.stack([torch.randperm(E, generator=gen) for _ in range(T)]).float() if T else torch.zeros(0, E)
    return base * 0.05 + 0.02 * torch.rand(T, E, generator=gen) - 0.025 * E


def tie_free_bias(E, gen):
    return torch.randperm(E, generator=gen).float() * 1e-3


CASES = [
    # (name, config kwargs, E, uses bias)
    ("softmax renorm", dict(top_k=2), 8, False),
    ("softmax no renorm", dict(top_k=3, renormalize=False), 16, False),
    ("softmax k=1", dict(top_k=1), 4, False),
    ("softmax k=E", dict(top_k=6), 6, False),
    ("sigmoid renorm", dict(top_k=4, scoring="sigmoid"), 32, False),
    ("sigmoid no renorm", dict(top_k=2, scoring="sigmoid", renormalize=False), 8, False),
    ("sqrtsoftplus", dict(top_k=4, scoring="sqrtsoftplus"), 16, False),
    ("bias no groups, scaled", dict(top_k=4, scoring="sigmoid", routed_scaling_factor=2.5), 16, True),
    ("deepseek-v3 grouped", dict(top_k=8, scoring="sigmoid", num_expert_group=8, topk_group=4,
                                  routed_scaling_factor=2.5), 64, True),
    ("deepseek-v2 grouped max", dict(top_k=6, num_expert_group=8, topk_group=3, renormalize=False,
                                      routed_scaling_factor=16.0), 64, False),
    ("grouped explicit top2_sum no bias", dict(top_k=3, num_expert_group=4, topk_group=2, group_score="top2_sum"), 16, False),
    ("scale on output", dict(top_k=2, scoring="sigmoid", routed_scaling_factor=3.0, scale_on="output"), 8, True),
    ("gpt-oss topk then softmax", dict(top_k=4, order="topk_then_softmax"), 32, False),
    ("llama4 topk then sigmoid", dict(top_k=1, order="topk_then_sigmoid", renormalize=False,
                                       apply_router_weight_on_input=True), 16, False),
]


@pytest.mark.parametrize("T", [0, 1, 7, 65])
@pytest.mark.parametrize("name,kw,E,use_bias", CASES, ids=[c[0] for c in CASES])
def test_route_matches_loop(name, kw, E, use_bias, T, gen):
    cfg = RoutingConfig(**kw)
    z = tie_free_logits(T, E, gen)
    bias = tie_free_bias(E, gen) if use_bias else None
    w, ids = route(z, cfg, bias)
    assert w.dtype == torch.float32 and ids.dtype == torch.int32
    assert tuple(w.shape) == (T, cfg.top_k) == tuple(ids.shape)
    w_ref, ids_ref = loop_route(z, cfg, bias)
    assert torch.equal(ids.long(), ids_ref)
    torch.testing.assert_close(w.double(), w_ref, rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_route_low_precision_logits_are_upcast(dtype, gen):
    cfg = RoutingConfig(top_k=2)
    z = tie_free_logits(9, 8, gen).to(dtype)
    w, ids = route(z, cfg)
    w_ref, ids_ref = loop_route(z.float(), cfg)
    assert torch.equal(ids.long(), ids_ref)
    torch.testing.assert_close(w.double(), w_ref, rtol=2e-6, atol=1e-7)


def test_ties_go_to_lowest_index():
    # every logit equal: the k lowest expert indices win, in order
    z = torch.zeros(3, 8)
    _, ids = route(z, RoutingConfig(top_k=3))
    assert ids.tolist() == [[0, 1, 2]] * 3
    z = torch.tensor([[1.0, 2.0, 2.0, 0.0, 2.0]])
    _, ids = route(z, RoutingConfig(top_k=2, order="topk_then_softmax"))
    assert ids.tolist() == [[1, 2]]


def test_softmax_renorm_equals_topk_then_softmax(gen):
    # ROUTING.md: softmax -> top-k -> renormalize equals top-k on z -> softmax over the k picked
    z = tie_free_logits(33, 16, gen)
    w1, i1 = route(z, RoutingConfig(top_k=4))
    w2, i2 = route(z, RoutingConfig(top_k=4, order="topk_then_softmax"))
    assert torch.equal(i1, i2)
    torch.testing.assert_close(w1, w2, rtol=1e-5, atol=1e-6)


def test_bias_selects_but_does_not_weigh():
    z = torch.tensor([[0.0, 0.1, 0.2, 0.3]])
    bias = torch.tensor([10.0, 0.0, 0.0, 0.0])
    w, ids = route(z, RoutingConfig(top_k=1, scoring="sigmoid", renormalize=False), bias)
    assert ids.tolist() == [[0]]
    assert w.item() == pytest.approx(0.5)  # sigmoid(0): the unbiased score


def test_custom_routing_function(gen):
    def pick_first_two(hidden, logits, k):
        T = logits.shape[0]
        return torch.full((T, k), 0.5), torch.arange(k).expand(T, k)

    x = torch.randn(5, 4)
    w, ids = route(torch.randn(5, 8), RoutingConfig(top_k=2, custom=pick_first_two), hidden_states=x)
    assert ids.dtype == torch.int32 and ids.tolist() == [[0, 1]] * 5
    assert torch.all(w == 0.5)


def test_custom_routing_bad_output_is_reported():
    def bad(hidden, logits, k):
        return torch.ones(logits.shape[0], k), torch.full((logits.shape[0], k), 99)

    with pytest.raises(ValueError, match="outside"):
        route(torch.randn(3, 8), RoutingConfig(top_k=2, custom=bad))


@pytest.mark.parametrize("returned,exc,match", [
    # each reached the experts before: NaN / inf weights gave NaN outputs, the others an AttributeError
    (lambda T, k: (torch.full((T, k), float("nan")), torch.zeros(T, k, dtype=torch.long)), ValueError,
     "returned NaN or infinite weights"),
    (lambda T, k: (torch.full((T, k), float("inf")), torch.zeros(T, k, dtype=torch.long)), ValueError,
     "returned NaN or infinite weights"),
    (lambda T, k: (1.0, torch.zeros(T, k, dtype=torch.long)), TypeError, "must return tensors .* got float and Tensor"),
    (lambda T, k: (torch.ones(T, k), torch.zeros(T, k, dtype=torch.long).numpy()), TypeError, "got Tensor and ndarray"),
    (lambda T, k: (torch.ones(T, k, dtype=torch.long), torch.zeros(T, k, dtype=torch.long)), TypeError,
     "weights of dtype torch.int64, expected a float dtype"),
    (lambda T, k: (torch.ones(T, k, device="meta"), torch.zeros(T, k, dtype=torch.long)), ValueError,
     "weights on meta and ids on cpu, expected both on cpu"),
], ids=["nan-weights", "inf-weights", "float-weights", "numpy-ids", "int-weights", "weights-on-meta"])
def test_custom_routing_bad_return_types_are_reported(returned, exc, match):
    cfg = RoutingConfig(top_k=2, custom=lambda hidden, logits, k: returned(logits.shape[0], k))
    with pytest.raises(exc, match=match):
        route(torch.randn(3, 8), cfg)


def test_nan_logits_raise():
    z = torch.randn(4, 8)
    z[2, 3] = float("nan")
    with pytest.raises(ValueError, match="router_logits contains NaN"):
        route(z, RoutingConfig(top_k=2))


def test_neg_inf_logits_are_never_picked(gen):
    z = tie_free_logits(20, 8, gen)
    z[:, 0] = float("-inf")
    _, ids = route(z, RoutingConfig(top_k=3))
    assert not (ids == 0).any()
    bias = torch.zeros(8)
    bias[0] = 5.0  # a correction bias large enough to win, were the logit finite
    for cfg in (RoutingConfig(top_k=3, scoring="sigmoid"),
                RoutingConfig(top_k=4, scoring="sigmoid", num_expert_group=4, topk_group=2)):
        _, ids = route(z, cfg, bias)
        assert not (ids == 0).any()
    z[:, 1] = -200.0  # its softmax score underflows to 0 like expert 0's, and still wins
    _, ids = route(z, RoutingConfig(top_k=7))
    assert not (ids == 0).any()


def test_a_never_picked_expert_does_not_sink_its_group():
    """Regression: with two experts a group, an -inf logit made its group's top-2 sum -inf, so
    the group's strong other expert could never be picked."""
    z = torch.tensor([[4.0, float("-inf"), -1.0, -1.0, -1.0, -1.0, -1.0, -1.0]])
    cfg = RoutingConfig(top_k=1, scoring="sigmoid", num_expert_group=4, topk_group=1)
    _, ids = route(z, cfg, torch.zeros(8))  # group scores: sigmoid(4) = 0.98 against 2 sigmoid(-1) = 0.54
    assert ids.tolist() == [[0]]


@pytest.mark.parametrize("row", [[float("inf")] + [0.0] * 7, [float("-inf")] * 8], ids=["+inf", "all--inf"])
def test_logits_no_expert_can_take_raise(row):
    z = torch.randn(3, 8)
    z[1] = torch.tensor(row)
    with pytest.raises(ValueError, match=r"router_logits contains NaN, \+inf or a row with no finite logit"):
        route(z, RoutingConfig(top_k=2))


def test_non_finite_correction_bias_raises():
    bias = torch.zeros(8)
    bias[3] = float("nan")
    with pytest.raises(ValueError, match="correction_bias must be finite"):
        route(torch.randn(2, 8), RoutingConfig(top_k=2, scoring="sigmoid"), bias)

"""The one-launch Triton router on CPU under Triton's interpreter, against the torch router.

route() takes the kernel on CUDA only, so these tests call moekit.kernels.triton_router directly
and compare it with moekit.routing.route_torch on the same logits: the same ids, weights within
an ulp or two (the kernel may add a sum in another order).
"""

import math

import pytest
import torch

from triton_child import IN_INTERPRETER, run_in_interpreter

if not IN_INTERPRETER:

    def test_router_kernel_under_the_triton_interpreter():
        run_in_interpreter(__file__)

else:
    from hypothesis import given
    from hypothesis import settings as hyp_settings
    from hypothesis import strategies as st

    from moekit import RoutingConfig
    from moekit.kernels.triton_router import kernel_refusal, triton_route
    from moekit.routing.router import route_torch

    # numpy evaluates both sides of a tl.where: exp overflows where softplus takes z itself, and
    # rows of -inf logits subtract -inf (their NaN weights match torch's)
    pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp", "ignore:invalid value encountered")

    CONFIGS = [
        # (name, config kwargs, E, uses bias)
        ("softmax renorm", dict(top_k=2), 8, False),
        ("softmax no renorm", dict(top_k=3, renormalize=False), 60, False),
        ("softmax k=1", dict(top_k=1), 5, False),
        ("softmax k=E", dict(top_k=6), 6, False),
        ("qwen3", dict(top_k=8), 128, False),
        ("sigmoid renorm", dict(top_k=4, scoring="sigmoid"), 32, False),
        ("sigmoid no renorm", dict(top_k=2, scoring="sigmoid", renormalize=False), 8, False),
        ("sqrtsoftplus", dict(top_k=4, scoring="sqrtsoftplus"), 16, False),
        ("bias no groups, scaled", dict(top_k=4, scoring="sigmoid", routed_scaling_factor=2.5), 16, True),
        ("deepseek-v3 grouped", dict(top_k=8, scoring="sigmoid", num_expert_group=8, topk_group=4,
                                      routed_scaling_factor=2.5), 256, True),
        ("deepseek-v2 grouped max, 20 a group", dict(top_k=6, num_expert_group=8, topk_group=3, renormalize=False,
                                                      routed_scaling_factor=16.0), 160, False),
        ("grouped top2_sum no bias", dict(top_k=3, num_expert_group=4, topk_group=2, group_score="top2_sum"), 16,
         False),
        ("grouped, one expert a group", dict(top_k=2, num_expert_group=8, topk_group=3, group_score="top2_sum"), 16,
         True),
        ("scale on output", dict(top_k=2, scoring="sigmoid", routed_scaling_factor=3.0, scale_on="output"), 8, True),
        ("gpt-oss topk then softmax", dict(top_k=4, order="topk_then_softmax"), 32, False),
        ("llama4 topk then sigmoid", dict(top_k=1, order="topk_then_sigmoid", renormalize=False,
                                           apply_router_weight_on_input=True), 16, False),
        ("cohere2 topk then sigmoid, renormalised", dict(top_k=3, order="topk_then_sigmoid", renormalize=True), 16,
         False),
        ("many experts", dict(top_k=10), 512, False),
    ]

    def _same(z, cfg, bias=None):
        w, ids, flag = triton_route(z, cfg, bias, check_nan=True)
        w_ref, ids_ref = route_torch(z, cfg, bias)
        assert w.dtype == torch.float32 and ids.dtype == torch.int32
        assert tuple(w.shape) == tuple(ids.shape) == (z.shape[0], cfg.top_k)
        assert int(flag) == 0
        assert torch.equal(ids, ids_ref), (ids, ids_ref)
        torch.testing.assert_close(w, w_ref, rtol=1e-6, atol=1e-30, equal_nan=True)  # all--inf rows: NaN both

    @pytest.mark.parametrize("T", [0, 1, 7, 37])
    @pytest.mark.parametrize("name,kw,E,use_bias", CONFIGS, ids=[c[0] for c in CONFIGS])
    def test_kernel_matches_torch_router(name, kw, E, use_bias, T, gen):
        cfg = RoutingConfig(**kw)
        z = torch.randn(T, E, generator=gen) * 2
        bias = torch.randn(E, generator=gen) * 0.05 if use_bias else None
        _same(z, cfg, bias)

    @pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
    @pytest.mark.parametrize("name,kw,E,use_bias", CONFIGS, ids=[c[0] for c in CONFIGS])
    def test_ties_of_low_precision_logits(name, kw, E, use_bias, dtype, gen):
        # logits on a coarse grid: many exact ties in every row, broken towards the lowest index.
        # No bias with groups: a group's p(a) + 0.25 + p(b) - 0.25 and another's p(a) + p(b) tie
        # in exact arithmetic, and numpy's exp here and torch's differ in the last bit (on the GPU
        # both take libdevice's: tests/kernels/test_triton_router_gpu.py keeps the bias).
        cfg = RoutingConfig(**kw)
        z = (torch.randint(-3, 4, (19, E), generator=gen).float() * 0.5).to(dtype)
        use_bias = use_bias and "num_expert_group" not in kw
        bias = (torch.randint(-1, 2, (E,), generator=gen).float() * 0.25) if use_bias else None
        _same(z, cfg, bias)

    def test_all_equal_logits_pick_the_lowest_indices():
        w, ids, _ = triton_route(torch.zeros(3, 8), RoutingConfig(top_k=3), None, check_nan=False)
        assert ids.tolist() == [[0, 1, 2]] * 3
        torch.testing.assert_close(w, torch.full((3, 3), 1 / 3))

    @pytest.mark.parametrize("kw", [dict(top_k=3), dict(top_k=3, scoring="sigmoid"),
                                    dict(top_k=3, order="topk_then_softmax"),
                                    dict(top_k=4, num_expert_group=4, topk_group=2, scoring="sigmoid"),
                                    dict(top_k=2, num_expert_group=8, topk_group=2, scoring="sigmoid",
                                         group_score="top2_sum")])
    def test_neg_inf_logits_come_last(kw, gen):
        # rows with fewer finite logits than k: the -inf experts fill up in index order
        cfg = RoutingConfig(**kw)
        z = torch.randn(6, 16, generator=gen)
        z[0, :15] = -math.inf
        z[1, 1:] = -math.inf
        z[2, ::2] = -math.inf
        z[3, :14] = -math.inf
        z[4] = -3.0  # two experts a group (the last config): group 2 = (6, -inf) must win
        z[4, 4], z[4, 5] = 6.0, -math.inf
        _same(z, cfg)

    def test_neg_inf_logits_lose_to_any_bias_and_underflow(gen):
        z = torch.randn(4, 16, generator=gen)
        z[:, 3] = -math.inf
        z[1, 5] = -200.0  # softmax score 0, like the -inf expert's: still ahead of it
        bias = torch.zeros(16)
        bias[3] = 5.0  # the -inf expert's bias would win the selection
        for cfg, b in ((RoutingConfig(top_k=4, scoring="sigmoid"), bias), (RoutingConfig(top_k=15), None)):
            _, ids, _ = triton_route(z, cfg, b, check_nan=False)
            assert not (ids == 3).any()
            _same(z, cfg, b)

    def test_bad_logits_and_bias_set_the_flag(gen):
        cfg = RoutingConfig(top_k=2, scoring="sigmoid")
        for row in ([math.inf] + [0.0] * 7, [-math.inf] * 8):
            z = torch.randn(3, 8, generator=gen)
            z[1] = torch.tensor(row)
            _, ids, flag = triton_route(z, cfg, None, check_nan=True)
            assert int(flag) > 0 and ids.min() >= 0 and ids.max() < 8
        z = torch.randn(3, 8, generator=gen)
        for bad in (math.nan, math.inf):
            bias = torch.zeros(8)
            bias[2] = bad
            assert int(triton_route(z, cfg, bias, check_nan=True)[2]) > 0

    def test_strided_rows_and_fp64_logits(gen):
        cfg = RoutingConfig(top_k=2, scoring="sigmoid")
        z = torch.randn(9, 40, generator=gen, dtype=torch.float64)[:, :32]  # row stride 40
        _same(z, cfg)

    def test_nan_sets_the_flag_and_ids_stay_in_range(gen):
        cfg = RoutingConfig(top_k=4, num_expert_group=4, topk_group=2, scoring="sigmoid")
        z = torch.randn(5, 16, generator=gen)
        z[2, 3] = math.nan
        z[4, :] = math.nan
        _, ids, flag = triton_route(z, cfg, None, check_nan=True)
        assert int(flag) > 0
        _, ids, flag = triton_route(z, cfg, None, check_nan=False)
        assert flag is None
        assert ids.min() >= 0 and ids.max() < 16
        for row in ids.tolist():  # k distinct experts per token even then
            assert len(set(row)) == 4

    def test_refusals_name_the_reason():
        assert "custom" in kernel_refusal(RoutingConfig(top_k=1, custom=lambda h, z, k: (z, z)), 8)
        assert "experts" in kernel_refusal(RoutingConfig(top_k=1), 5000)
        assert kernel_refusal(RoutingConfig(top_k=8), 256) is None

    @hyp_settings(max_examples=40, deadline=None)
    @given(
        E=st.integers(1, 96), k_frac=st.floats(0.0, 1.0), T=st.integers(0, 20),
        order=st.sampled_from(["score_then_topk", "topk_then_softmax", "topk_then_sigmoid"]),
        scoring=st.sampled_from(["softmax", "sigmoid", "sqrtsoftplus"]), renorm=st.booleans(),
        groups=st.sampled_from([None, 2, 4, 8]), bias=st.booleans(), scale=st.sampled_from([1.0, 2.5]),
        coarse=st.booleans(), seed=st.integers(0, 2 ** 31 - 1),
    )
    def test_kernel_matches_torch_router_property(E, k_frac, T, order, scoring, renorm, groups, bias, scale, coarse,
                                                  seed):
        gen = torch.Generator().manual_seed(seed)
        k = max(1, round(k_frac * E))
        score_first = order == "score_then_topk"
        kw = dict(top_k=k, order=order, scoring=scoring if score_first else "softmax", renormalize=renorm,
                  routed_scaling_factor=scale)
        if score_first and groups is not None and E % groups == 0 and E > groups:
            topg = 1 + seed % groups
            if k <= topg * (E // groups):
                kw.update(num_expert_group=groups, topk_group=topg)
        cfg = RoutingConfig(**kw)
        z = (torch.randint(-4, 5, (T, E), generator=gen).float() * 0.5) if coarse else torch.randn(T, E, generator=gen)
        b = torch.randn(E, generator=gen) * 0.1 if bias and score_first else None
        _same(z, cfg, b)

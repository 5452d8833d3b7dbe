"""moekit.balance: each loss against a per-token loop in the test (and transformers where it has one),
fp64 gradchecks, and the aux-loss-free bias update balancing a skewed router."""

import math

import pytest
import torch

from moekit import RoutingConfig, route
from moekit.balance import (
    expert_counts,
    load_balancing_loss,
    router_z_loss,
    sequence_balance_loss,
    update_correction_bias,
)


# -- independent implementations (plain loops over tokens and experts, float64) ------------

def loop_load_balancing(layers, k, mask=None):
    """E * sum_e (count_e / N) * (sum_t p_te / N) over all layers' rows; mask weights rows."""
    E = layers[0].shape[1]
    counts, probs, n = [0.0] * E, [0.0] * E, 0.0
    for z in layers:
        for t in range(z.shape[0]):
            m = 1.0 if mask is None else float(mask.reshape(-1)[t])
            p = torch.softmax(z[t].double(), dim=0).tolist()
            chosen = sorted(range(E), key=lambda e: -p[e])[:k]
            for e in range(E):
                counts[e] += m * (e in chosen)
                probs[e] += m * p[e]
            n += m
    return E * sum((counts[e] / n) * (probs[e] / n) for e in range(E))


def loop_sequence_balance(scores, ids, seq_len, alpha, mask=None):
    """DeepSeek-V3: per sequence alpha * sum_e f_e P_e, averaged over sequences with tokens."""
    T, E = scores.shape
    k = ids.shape[1]
    losses = []
    for b in range(T // seq_len):
        rows = [t for t in range(b * seq_len, (b + 1) * seq_len) if mask is None or mask.reshape(-1)[t]]
        if not rows:
            continue
        n = len(rows)
        total = 0.0
        for e in range(E):
            f = E / (k * n) * sum(int(e in ids[t].tolist()) for t in rows)
            P = sum(float(scores[t, e]) / float(scores[t].double().sum()) for t in rows) / n
            total += f * P
        losses.append(alpha * total)
    return sum(losses) / len(losses) if losses else 0.0


def hf_loss():
    mixtral = pytest.importorskip("transformers.models.mixtral.modeling_mixtral")
    return mixtral.load_balancing_loss_func


# -- load_balancing_loss -------------------------------------------------------------------

@pytest.mark.parametrize("L", [1, 3], ids=["one-layer", "three-layers"])
@pytest.mark.parametrize("k", [1, 2, 5], ids=["k1", "k2", "k=E"])
@pytest.mark.parametrize("masked", [False, True], ids=["no-mask", "padding-mask"])
def test_load_balancing_matches_transformers_and_loop(L, k, masked, gen):
    E, B, S = 5, 3, 7  # odd sizes; T = 21
    layers = tuple(torch.randn(B * S, E, generator=gen) * 2 for _ in range(L))
    mask = None
    if masked:
        mask = (torch.rand(B, S, generator=gen) > 0.3).long()
        mask[0, 0] = 1  # at least one real token
    ours = load_balancing_loss(layers, k, E, attention_mask=mask)
    theirs = hf_loss()(layers, E, k, mask)
    assert ours.shape == () and ours.dtype == torch.float32
    assert torch.allclose(ours, theirs, rtol=1e-5, atol=1e-6), (ours, theirs)
    assert math.isclose(float(ours), loop_load_balancing(layers, k, mask), rel_tol=1e-5)


def test_load_balancing_gradient_matches_transformers(gen):
    z = (torch.randn(12, 4, generator=gen) * 2).requires_grad_()
    g_ours, = torch.autograd.grad(load_balancing_loss(z, 2), z)
    g_hf, = torch.autograd.grad(hf_loss()((z,), 4, 2), z)
    assert torch.allclose(g_ours, g_hf, rtol=1e-5, atol=1e-7)
    assert g_ours.abs().sum() > 0


def test_load_balancing_tensor_equals_one_layer_tuple_and_fp64_gradcheck(gen):
    z = torch.randn(9, 6, generator=gen, dtype=torch.float64) * 3
    assert load_balancing_loss(z, 2) == load_balancing_loss((z,), 2)
    mask = torch.tensor([1, 1, 0, 1, 1, 1, 0, 1, 1]).view(3, 3)
    # logits 3 apart at most positions: eps=1e-6 never changes the top-k choice
    z = z.requires_grad_()
    assert torch.autograd.gradcheck(lambda a: load_balancing_loss([a, a * 0.5], 2, attention_mask=mask), (z,))


def test_load_balancing_value_for_uniform_routing():
    # row t puts experts t and t+1 (mod E) equally far above the rest: every expert is picked
    # by k rows and has the same mean probability 1/E, so the loss is E * E * (k/E) * (1/E) = k.
    E, k = 4, 2
    z = torch.full((E, E), -10.0)
    for t in range(E):
        z[t, t] = z[t, (t + 1) % E] = 0.0
    assert torch.allclose(load_balancing_loss(z, k), torch.tensor(float(k)), rtol=1e-5)


@pytest.mark.parametrize("case", ["T0", "all-padding"])
def test_load_balancing_without_tokens_is_zero_not_nan(case):
    if case == "T0":
        z, mask = torch.randn(0, 4, requires_grad=True), None
    else:
        z, mask = torch.randn(6, 4, requires_grad=True), torch.zeros(2, 3, dtype=torch.long)
    loss = load_balancing_loss(z, 2, attention_mask=mask)
    assert float(loss.detach()) == 0.0
    loss.backward()
    assert torch.isfinite(z.grad).all() and (z.grad == 0).all()


def test_load_balancing_bad_input():
    z = torch.randn(6, 4)
    with pytest.raises(ValueError, match="num_experts must equal the logits' width E=4, got 5"):
        load_balancing_loss(z, 2, num_experts=5)
    with pytest.raises(ValueError, match=r"top_k must be an int in \[1, E=4\], got 5"):
        load_balancing_loss(z, 5)
    with pytest.raises(ValueError, match=r"attention_mask must have one entry per token row \(T=6\)"):
        load_balancing_loss(z, 2, attention_mask=torch.ones(2, 4))
    with pytest.raises(TypeError, match="got an empty sequence"):
        load_balancing_loss((), 2)
    with pytest.raises(TypeError, match="got NoneType"):
        load_balancing_loss(None, 2)
    with pytest.raises(ValueError, match=r"every layer's router_logits must have E=4 columns, got 3 in layer 1"):
        load_balancing_loss((z, torch.randn(6, 3)), 2)
    with pytest.raises(ValueError, match=r"router_logits\[0\] must be a 2-D float tensor"):
        load_balancing_loss(torch.randn(2, 3, 4), 2)


# -- router_z_loss -------------------------------------------------------------------------

@pytest.mark.parametrize("masked", [False, True], ids=["no-mask", "padding-mask"])
def test_router_z_loss_matches_loop(masked, gen):
    layers = [torch.randn(10, 7, generator=gen) * 4 for _ in range(2)]
    mask = (torch.rand(2, 5, generator=gen) > 0.4).long() if masked else None
    mask_f = torch.ones(10) if mask is None else mask.reshape(-1).double()
    num = den = 0.0
    for z in layers:
        for t in range(10):
            lse = math.log(sum(math.exp(v) for v in z[t].double().tolist()))
            num += float(mask_f[t]) * lse * lse
            den += float(mask_f[t])
    want = num / den if den else 0.0
    assert math.isclose(float(router_z_loss(layers, attention_mask=mask)), want, rel_tol=1e-5, abs_tol=1e-7)


def test_router_z_loss_gradcheck_fp64_and_empty(gen):
    z = torch.randn(5, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(router_z_loss, (z,))
    assert float(router_z_loss(torch.randn(0, 3))) == 0.0


# -- sequence_balance_loss -----------------------------------------------------------------

@pytest.mark.parametrize("B,S,k", [(1, 1, 1), (3, 5, 2), (2, 6, 4)], ids=["T1-k1", "odd-seq", "k=E"])
@pytest.mark.parametrize("masked", [False, True], ids=["no-mask", "padding-mask"])
def test_sequence_balance_matches_loop(B, S, k, masked, gen):
    E = 4
    z = torch.randn(B * S, E, generator=gen)
    cfg = RoutingConfig(top_k=k, scoring="sigmoid")
    bias = torch.randn(E, generator=gen) * 0.1
    _, ids = route(z, cfg, bias)  # biased selection, as DeepSeek-V3 trains it
    s = torch.sigmoid(z)
    mask = None
    if masked:
        mask = (torch.rand(B, S, generator=gen) > 0.3).long()
        mask[-1] = 0  # one fully padded sequence: left out of the mean
    ours = sequence_balance_loss(s, ids, S, alpha=0.01, attention_mask=mask)
    assert math.isclose(float(ours), loop_sequence_balance(s, ids, S, 0.01, mask), rel_tol=1e-5, abs_tol=1e-9)


def test_sequence_balance_is_alpha_when_balanced_and_gradcheck_fp64(gen):
    # 4 tokens, E=4, k=1, each expert picked once; equal scores -> f_e = 1, P_e = 1/4
    s = torch.full((4, 4), 0.3, dtype=torch.float64)
    ids = torch.arange(4).view(4, 1)
    assert math.isclose(float(sequence_balance_loss(s, ids, 4, alpha=0.5)), 0.5, rel_tol=1e-12)
    s = torch.rand(6, 4, generator=gen, dtype=torch.float64).add(0.1).requires_grad_()
    ids = torch.randint(0, 4, (6, 2), generator=gen)
    assert torch.autograd.gradcheck(lambda a: sequence_balance_loss(a, ids, 3, alpha=1.0), (s,))


def test_sequence_balance_bad_input():
    s, ids = torch.rand(6, 4), torch.zeros(6, 2, dtype=torch.long)
    with pytest.raises(ValueError, match="seq_len must be an int >= 1 dividing T=6, got 4"):
        sequence_balance_loss(s, ids, 4)
    with pytest.raises(ValueError, match=r"topk_ids must be \[T=6, k\]"):
        sequence_balance_loss(s, ids[:5], 3)
    with pytest.raises(ValueError, match=r"topk_ids must lie in \[0, 4\), got values in \[0, 4\]"):
        sequence_balance_loss(s, torch.tensor([[0, 4]] * 6), 3)
    with pytest.raises(TypeError, match="topk_ids must be an integer tensor"):
        sequence_balance_loss(s, ids.float(), 3)
    with pytest.raises(ValueError, match=r"scores must be 2-D \[T, E\], got shape \(6,\)"):
        sequence_balance_loss(s[:, 0], ids, 3)
    with pytest.raises(ValueError, match="alpha must be a number >= 0"):
        sequence_balance_loss(s, ids, 3, alpha=-1.0)


# -- counts and the correction-bias update -------------------------------------------------

def test_expert_counts_match_bincount_and_mask(gen):
    ids = torch.randint(0, 6, (13, 3), generator=gen, dtype=torch.int32)
    assert torch.equal(expert_counts(ids, 6), torch.bincount(ids.reshape(-1).long(), minlength=6))
    mask = torch.rand(13, generator=gen) > 0.5
    want = torch.bincount(ids[mask].reshape(-1).long(), minlength=6)
    assert torch.equal(expert_counts(ids, 6, attention_mask=mask), want)
    assert torch.equal(expert_counts(ids[:0], 6), torch.zeros(6, dtype=torch.int64))
    with pytest.raises(TypeError, match="attention_mask must be a bool or integer"):
        expert_counts(ids, 6, attention_mask=mask.float())


def test_update_correction_bias_one_step_in_place():
    bias = torch.tensor([0.5, 0.0, -0.5, 0.0])
    ptr = bias.data_ptr()
    ids = torch.tensor([[0, 1], [0, 2], [0, 1], [3, 0]], dtype=torch.int32)  # counts [4, 2, 1, 1], mean 2
    out = update_correction_bias(bias, ids, gamma=0.1)
    assert out is bias and bias.data_ptr() == ptr
    assert torch.allclose(bias, torch.tensor([0.4, 0.0, -0.4, 0.1]))  # expert 1 at the mean: unchanged
    # counts give the same step as ids; float counts (an averaged window) too
    b2 = torch.tensor([0.5, 0.0, -0.5, 0.0])
    update_correction_bias(b2, torch.tensor([4.0, 2.0, 1.0, 1.0]), gamma=0.1)
    assert torch.equal(b2, bias)


def test_update_correction_bias_bad_input():
    bias = torch.zeros(4)
    with pytest.raises(ValueError, match=r"load as counts must be a numeric \[E=4\] tensor"):
        update_correction_bias(bias, torch.ones(5))
    with pytest.raises(ValueError, match="gamma must be a finite number > 0, got 0"):
        update_correction_bias(bias, torch.ones(4), gamma=0)
    # an infinite step used to turn the bias into +-inf (and NaN for experts at the mean)
    with pytest.raises(ValueError, match="gamma must be a finite number > 0, got inf"):
        update_correction_bias(bias, torch.tensor([3, 0, 1, 0]), gamma=float("inf"))
    assert torch.equal(bias, torch.zeros(4))
    # a NaN count made every update sign(NaN) = 0: the bias silently stayed where it was
    for bad in ([float("nan"), 1.0, 2.0, 3.0], [-1.0, 1.0, 2.0, 3.0], [float("inf"), 0.0, 0.0, 0.0]):
        with pytest.raises(ValueError, match=r"load as counts must be finite and >= 0"):
            update_correction_bias(bias, torch.tensor(bad))
    assert torch.equal(bias, torch.zeros(4))
    with pytest.raises(TypeError, match=r"bias must be a float tensor \[E\], got torch.int64"):
        update_correction_bias(torch.zeros(4, dtype=torch.long), torch.ones(4))
    with pytest.raises(ValueError, match=r"bias must be 1-D \[E\], got shape \(2, 2\)"):
        update_correction_bias(torch.zeros(2, 2), torch.ones(4))
    with pytest.raises(ValueError, match=r"topk_ids must lie in \[0, 4\)"):
        update_correction_bias(bias, torch.tensor([[1, 7]]))
    with pytest.raises(ValueError, match=r"load must be ids \[T, k\] or counts \[E=4\]"):
        update_correction_bias(bias, torch.ones(2, 2, 2))


def test_bias_update_balances_a_skewed_router(gen):
    # DeepSeek-V3 style router (sigmoid, grouped top-k, bias for selection only) whose logits
    # favour low expert ids strongly; the bias update alone must bring the load to balance.
    E, k, T = 16, 4, 512
    cfg = RoutingConfig(top_k=k, scoring="sigmoid", num_expert_group=4, topk_group=2)
    skew = torch.linspace(2.0, -2.0, E)
    bias = torch.zeros(E)
    imbalance = []
    for _ in range(60):
        z = torch.randn(T, E, generator=gen) + skew
        _, ids = route(z, cfg, bias)
        counts = expert_counts(ids, E).float()
        imbalance.append(float(counts.max() / counts.mean()))
        update_correction_bias(bias, ids, gamma=0.02)
    first, last = sum(imbalance[:5]) / 5, sum(imbalance[-10:]) / 10
    assert first > 2.5, imbalance[:5]  # the skew is real (about 3.2)
    assert last < 1.4 and last < 0.45 * first, (first, last)  # sampling noise alone: about 1.2
    # monotone-ish: every 10-step average is below the first one
    tens = [sum(imbalance[i:i + 10]) / 10 for i in range(0, 60, 10)]
    assert all(t < tens[0] for t in tens[1:]), tens


def test_bias_update_from_eplb_recorder_counts(gen):
    # The recorder counts per physical slot; map to logical experts, then update.
    from moekit.eplb import LoadRecorder, physical_to_logical_load

    E, R = 4, 6
    phy2log = torch.tensor([[0, 1, 2, 3, 0, 0]])  # expert 0 has three replicas
    rec = LoadRecorder(1, R, window_size=2)
    rec.record(0, torch.tensor([[0, 4], [5, 1], [0, 2]], dtype=torch.int32))
    rec.end_step()
    logical = physical_to_logical_load(rec.window.sum(dim=1), phy2log, E)[0]  # [E]
    assert logical.tolist() == [4, 1, 1, 0]
    bias = torch.zeros(E)
    update_correction_bias(bias, logical, gamma=1.0)
    assert bias.tolist() == [-1.0, 1.0, 1.0, 1.0]  # mean 1.5


def test_no_host_sync_on_meta_tensors():
    # Meta tensors hold no values: any .item()/.tolist()/bool() would raise, so passing here
    # shows every function stays on device (as needed inside CUDA graphs).
    z = torch.empty(8, 4, device="meta")
    ids = torch.empty(8, 2, dtype=torch.int64, device="meta")
    mask = torch.empty(2, 4, dtype=torch.long, device="meta")
    assert load_balancing_loss((z, z), 2, attention_mask=mask).device.type == "meta"
    assert router_z_loss(z, attention_mask=mask).device.type == "meta"
    assert sequence_balance_loss(z, ids, 4, attention_mask=mask).device.type == "meta"
    bias = torch.empty(4, device="meta")
    update_correction_bias(bias, ids, gamma=0.1)
    update_correction_bias(bias, torch.empty(4, device="meta"), gamma=0.1)

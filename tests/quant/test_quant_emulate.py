"""The reference emulation against a per-token loop that reads as each scheme's definition."""

import pytest
import torch

from conftest import rel_err
from moekit import fused_experts, quantize_experts
from moekit.activations import apply_activation
from moekit.experts.base import ExpertWeights
from moekit.experts.reference import reference_experts
from moekit.quant import dequantize_weight, emulated_experts, get_scheme, scheme_of


def _fake_quant(v, scheme, s):
    """Round v / s to the activation format and back (v [.., K], s broadcastable)."""
    if scheme.activation_dtype == "int8":
        return torch.round(v / s).clamp(-127, 127) * s
    return (v / s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s


def _fq_rows(rows, scheme, static=None):
    """Quantize-dequantize a list of GEMM input rows [K] per the scheme's activation granularity."""
    if scheme.weight_only:
        return rows
    qmax = 448.0 if scheme.activation_dtype == "fp8_e4m3" else 127.0
    gran = scheme.activation_granularity
    out = []
    if gran == "tensor" and static is None:
        amax = max([float(r.abs().max()) for r in rows] + [0.0])
        s_all = amax / qmax if amax > 0 else 1.0
    for i, r in enumerate(rows):
        if gran == "tensor":
            s = float(static[i]) if static is not None else s_all
            out.append(_fake_quant(r, scheme, s))
        elif gran == "token":
            amax = float(r.abs().max())
            out.append(_fake_quant(r, scheme, amax / qmax if amax > 0 else 1.0))
        else:
            parts = []
            for c in r.split(scheme.activation_group):
                amax = float(c.abs().max())
                parts.append(_fake_quant(c, scheme, amax / qmax if amax > 0 else 1.0))
            out.append(torch.cat(parts))
    return out


def dumb_forward(x, w: ExpertWeights, tw, ids, activation, on_input=False, expert_map=None):
    """out[t] = sum_j w_tj * W2_e q(act(W13_e q(x_t))), one assignment at a time (two passes for
    a dynamic per-tensor scale, which spans every GEMM input row of the call)."""
    scheme = scheme_of(w)
    deq = {n: dequantize_weight(getattr(w, n), w.scales[f"{n}_scale"], w.scales.get(f"{n}_zero"), scheme)
           for n in ("w13", "w2")}
    local = ids.long() if expert_map is None else expert_map.long()[ids.long()]
    assign = [(t, j, int(local[t, j])) for t in range(ids.shape[0]) for j in range(ids.shape[1])
              if int(local[t, j]) >= 0]
    rows = [x[t].float() * (tw[t, j] if on_input else 1.0) for t, j, _ in assign]
    a13 = w.scales.get("a13_scale")
    rows = _fq_rows(rows, scheme, None if a13 is None else [a13[e] for _, _, e in assign])
    acts = []
    for (t, j, e), r in zip(assign, rows):
        h = deq["w13"][e] @ r + (0 if w.b13 is None else w.b13[e].float())
        acts.append(apply_activation(h[None], activation)[0])
    a2 = w.scales.get("a2_scale")
    acts = _fq_rows(acts, scheme, None if a2 is None else [a2[e] for _, _, e in assign])
    out = torch.zeros(x.shape[0], x.shape[1])
    for (t, j, e), a in zip(assign, acts):
        y = deq["w2"][e] @ a + (0 if w.b2 is None else w.b2[e].float())
        out[t] += y if on_input else tw[t, j] * y
    return out


CASES = [
    # scheme, options, E, H, I, k, T, activation, bias, static act scales
    ("fp8_w8a8", {}, 4, 64, 32, 2, 5, "silu", False, False),           # dynamic per-tensor
    ("fp8_w8a8", {}, 4, 64, 32, 2, 5, "gelu", True, True),             # static per-expert scales, biases
    ("fp8_w8a8_channel", {}, 5, 48, 24, 3, 6, "relu2_no_mul", False, False),  # non-gated
    ("fp8_w8a8_block128", {}, 3, 256, 128, 2, 4, "silu", False, False),
    ("int8_w8a8", {}, 4, 40, 24, 2, 7, "silu", True, False),
    ("int8_w8a16", dict(group_size=32, symmetric=False), 4, 64, 32, 2, 5, "silu", False, False),
    ("int4_w4a16", dict(group_size=32), 4, 64, 64, 1, 6, "gelu_tanh", True, False),  # k=1
    ("int4_w4a16", dict(group_size=64, symmetric=False), 3, 128, 64, 3, 1, "silu", False, False),  # T=1, k=E
]


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-{c[7]}-T{c[6]}" for c in CASES])
def test_emulation_matches_the_per_token_definition(case, gen):
    name, opts, E, H, I, k, T, act, bias, static = case
    rows = 2 * I if act in ("silu", "gelu", "gelu_tanh") else I
    w13, w2 = torch.randn(E, rows, H, generator=gen) * H ** -0.5, torch.randn(E, H, I, generator=gen) * I ** -0.5
    extra = {}
    if bias:
        extra.update(b13=torch.randn(E, rows, generator=gen), b2=torch.randn(E, H, generator=gen))
    if static:
        extra.update(a13_scale=torch.rand(E, generator=gen) * 0.02 + 0.005,
                     a2_scale=torch.rand(E, generator=gen) * 0.02 + 0.005)
    w = quantize_experts(w13, w2, name, **opts, **extra)
    x = torch.randn(T, H, generator=gen)
    ids = torch.rand(T, E, generator=gen).argsort(1)[:, :k].to(torch.int32)
    tw = torch.rand(T, k, generator=gen)
    out = emulated_experts(x, w, tw, ids, activation=act)
    # With activation quantization, the batched and the per-row fp32 GEMM1 can differ in the
    # last bit, and a value on a rounding boundary then lands one quantization step apart
    # (seen: 2.4e-4 for fp8 1x128 groups, 2.5e-3 for one per-tensor fp8 scale over 5 tokens: a
    # step near the top binade of e4m3 is 1/14 of the value). Weight-only schemes stay within fp32
    # rounding.
    tol = 1e-5 if get_scheme(name).activation_dtype is None else 5e-3
    assert rel_err(out, dumb_forward(x, w, tw, ids, act)) <= tol


def test_emulation_with_expert_map_and_weight_on_input(gen):
    # Integer weights (per-channel int8 scales of exactly 1), integer x with a row maximum of
    # 127 and power-of-two routed weights: x's quantization and GEMM1 are exact in any order,
    # so no value can land on the other side of a quantization step than in the per-token
    # definition, and the two agree to fp32 rounding.
    E_global, E, H, I = 6, 3, 64, 32
    w = quantize_experts(_integer_weights(E, 2 * I, H, gen), _integer_weights(E, H, I, gen), "int8_w8a8")
    emap = torch.tensor([-1, 0, -1, 1, 2, -1], dtype=torch.int32)
    x = torch.randint(-127, 128, (9, H), generator=gen).float()
    x[:, 0] = 127.0
    ids = torch.randint(0, E_global, (9, 1), generator=gen, dtype=torch.int32)
    ids[0, 0], ids[1, 0] = 0, 1  # one remote token, one local
    tw = 2.0 ** -torch.randint(0, 4, (9, 1), generator=gen).float()
    out = emulated_experts(x, w, tw, ids, activation="silu", apply_router_weight_on_input=True, expert_map=emap)
    ref = dumb_forward(x, w, tw, ids, "silu", on_input=True, expert_map=emap)
    assert rel_err(out, ref) <= 1e-5
    remote = (emap.long()[ids.long()] < 0).squeeze(1)
    assert remote.any() and (out[remote] == 0).all() and (out[~remote] != 0).any()


def test_weight_only_emulation_is_the_float_reference_on_dequantized_weights(gen):
    w = quantize_experts(torch.randn(4, 128, 64, generator=gen), torch.randn(4, 64, 64, generator=gen),
                         "int4_w4a16", group_size=32)
    s = get_scheme("int4_w4a16", group_size=32)
    plain = ExpertWeights(dequantize_weight(w.w13, w.scales["w13_scale"], None, s),
                          dequantize_weight(w.w2, w.scales["w2_scale"], None, s))
    x, ids, tw = torch.randn(5, 64, generator=gen), torch.randint(0, 4, (5, 2), generator=gen).int(), torch.rand(5, 2)
    assert rel_err(emulated_experts(x, w, tw, ids), reference_experts(x, plain, tw, ids)) <= 1e-6


def test_reference_backend_serves_every_scheme_and_t0(gen):
    for name in ("fp8_w8a8", "fp8_w8a8_channel", "int8_w8a8", "int8_w8a16", "int4_w4a16"):
        w = quantize_experts(torch.randn(2, 256, 128, generator=gen), torch.randn(2, 128, 128, generator=gen), name)
        for T in (0, 3):
            x = torch.randn(T, 128, generator=gen, dtype=torch.bfloat16)
            out = fused_experts(x, w, None, torch.rand(T, 1), torch.zeros(T, 1, dtype=torch.int32), backend="reference")
            assert out.shape == (T, 128) and out.dtype == torch.bfloat16 and torch.isfinite(out).all()


def test_gradients_through_quantized_experts(gen):
    """Weight-only emulation is differentiable in x; w8a8 rounds x, so autograd is refused, not zeroed."""
    x = torch.randn(3, 128, generator=gen, requires_grad=True)
    ids, tw = torch.tensor([[0], [1], [0]], dtype=torch.int32), torch.rand(3, 1, generator=gen)
    w = quantize_experts(torch.randn(2, 256, 128, generator=gen), torch.randn(2, 128, 128, generator=gen), "int8_w8a16")
    fused_experts(x, w, None, tw, ids).sum().backward()  # the oracle skips cpu_wo (forward only)
    assert x.grad is not None and x.grad.abs().sum() > 0
    w = quantize_experts(torch.randn(2, 256, 128, generator=gen), torch.randn(2, 128, 128, generator=gen), "int8_w8a8")
    with pytest.raises(ValueError, match="rounds the activations, so no gradient flows"):
        fused_experts(x, w, None, tw, ids)


def _integer_weights(E, N, K, gen):
    """[E, N, K] integers in [-127, 127] with 127 in every 128-column group: int8 group-128
    scales of exactly 1, so the dequantized weights are these integers."""
    w = torch.randint(-127, 128, (E, N, K), generator=gen).float()
    w[..., ::128] = 127.0
    return w


def test_act_dtype_rounds_gemm1_output_before_gemm2(gen):
    # Weight-only int8 with integer weights and x: GEMM1 is exact in fp32 in any order, so
    # act_dtype=bf16 must give exactly the activation rounded to bf16 before GEMM2 (which
    # adds only fp32 rounding), and fp32 must change nothing.
    H, I = 128, 128
    w13, w2 = _integer_weights(4, 2 * I, H, gen), _integer_weights(4, H, I, gen)
    w = quantize_experts(w13, w2, "int8_w8a16")
    s = get_scheme("int8_w8a16")
    assert torch.equal(dequantize_weight(w.w13, w.scales["w13_scale"], None, s), w13)
    x = torch.randint(-3, 4, (5, H), generator=gen).float()
    ids, tw = torch.randint(0, 4, (5, 2), generator=gen).int(), torch.rand(5, 2, generator=gen)
    base = emulated_experts(x, w, tw, ids)
    assert torch.equal(emulated_experts(x, w, tw, ids, act_dtype=torch.float32), base)
    rounded = emulated_experts(x, w, tw, ids, act_dtype=torch.bfloat16)
    want = torch.zeros(5, H)
    for t in range(5):
        for j in range(2):
            e = int(ids[t, j])
            h = w13[e] @ x[t]
            a = (torch.nn.functional.silu(h[:I]) * h[I:]).to(torch.bfloat16).float()
            want[t] += tw[t, j] * (w2[e] @ a)
    assert rel_err(rounded, want) <= 1e-6
    assert 1e-4 < rel_err(rounded, base) <= 1e-2


@pytest.mark.parametrize("groups, H", [(1, 256), (3, 128)], ids=["group-of-256", "groups-not-dividing-H"])
def test_weight_only_scales_whose_group_size_is_not_supported_name_the_tensor(groups, H, gen):
    """Regression: a w13_scale with one group over H=256 (g=256) failed with get_scheme's
    "group_size must be one of ..., got 256", naming neither the tensor nor H."""
    q = quantize_experts(torch.randn(2, 256, H, generator=gen), torch.randn(2, H, 128, generator=gen), "int4_w4a16",
                         group_size=32)
    scales = dict(q.scales, w13_scale=torch.ones(2, 256, groups))
    with pytest.raises(ValueError, match=rf"scales\['w13_scale'\] has {groups} groups over H={H}: "
                                         r"quant='int4_w4a16' needs groups of \[32, 64, 128\] columns"):
        scheme_of(ExpertWeights(q.w13, q.w2, scales=scales, quant=q.quant))

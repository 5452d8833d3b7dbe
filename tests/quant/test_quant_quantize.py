"""quantize/dequantize round trips within each scheme's bound, the stored layout, and rejections."""

import pytest
import torch

from moekit import fused_experts, quantize_experts
from moekit.quant import (
    dequantize_activation,
    dequantize_weight,
    get_scheme,
    pack_int4,
    quantize_activation,
    quantize_weight,
    unpack_int4,
)

FP8_MAX = 448.0
W_SCHEMES = [
    ("fp8_w8a8", {}), ("fp8_w8a8_channel", {}), ("fp8_w8a8_block128", {}), ("int8_w8a8", {}),
    ("int8_w8a16", {}), ("int8_w8a16", dict(group_size=32, symmetric=False)),
    ("int4_w4a16", {}), ("int4_w4a16", dict(group_size=64)), ("int4_w4a16", dict(group_size=32, symmetric=False)),
]


def _ids(case):
    name, opts = case
    return name + "".join(f"-{k}={v}" for k, v in opts.items())


def _fp8_bound(v, s):
    """e4m3: 3 mantissa bits (half-spacing 2^-4 relative), subnormal spacing 2^-9 (in units of s)."""
    return torch.maximum(v.abs() * 2.0 ** -4, s * 2.0 ** -10) * (1 + 1e-5) + 1e-12


def _expand_scale(scheme, scale, N, K):
    """Per-element dequantization scale [E, N, K] from the stored scale, by the documented layout."""
    g = scheme.weight_granularity
    if g == "tensor":
        return scale[:, None, None].expand(-1, N, K)
    if g == "channel":
        return scale[:, :, None].expand(-1, -1, K)
    if g == "block":
        return scale.repeat_interleave(128, 1).repeat_interleave(128, 2)
    return scale.repeat_interleave(scheme.group_size, 2)


@pytest.mark.parametrize("case", W_SCHEMES, ids=_ids)
def test_weight_round_trip_within_the_scheme_bound(case, gen):
    scheme = get_scheme(case[0], **case[1])
    E, N, K = 3, 256, 384
    w = torch.randn(E, N, K, generator=gen) * torch.rand(E, N, 1, generator=gen) * 3  # rows of varied size
    w[0, :128, :128] = 0.0  # an all-zero block / group / channel prefix
    q = quantize_weight(w, scheme)
    assert q.q.dtype == scheme.storage_dtype()
    assert q.q.shape == (E, N, K // scheme.pack)
    deq = dequantize_weight(q.q, q.scale, q.zero, scheme)
    assert deq.dtype == torch.float32 and deq.shape == w.shape
    s = _expand_scale(scheme, q.scale, N, K)
    err = (deq - w).abs()
    if scheme.weight_dtype == "fp8_e4m3":
        assert (err <= _fp8_bound(w, s)).all()
        # scale = amax / 448 over each tensor / channel / block
        amax_over = {"tensor": w.abs().amax(dim=(1, 2))[:, None, None], "channel": w.abs().amax(2, keepdim=True)}
        if scheme.weight_granularity in amax_over:
            ref = amax_over[scheme.weight_granularity] / FP8_MAX
            ref = torch.where(ref > 0, ref, torch.ones_like(ref)).expand_as(s)
            torch.testing.assert_close(s, ref)
    else:
        assert (err <= s * 0.5 * (1 + 1e-4) + 1e-6 * w.abs()).all()
    assert (deq[0, :128, :128] == 0).all()  # zeros come back exactly


@pytest.mark.parametrize("case", W_SCHEMES, ids=_ids)
def test_huge_weights_get_finite_scales(case, gen):
    """Weights of both signs near the fp32 maximum: with zero points the range hi - lo overflowed
    to inf, giving scale inf and NaN weights (0 * inf) on dequantization."""
    scheme = get_scheme(case[0], **case[1])
    E, N, K = 2, 128, 256
    sign = torch.randint(0, 2, (E, N, K), generator=gen).float() * 2 - 1
    w = sign * (1 + torch.rand(E, N, K, generator=gen)) * 1e38  # |w| in [1e38, 2e38]
    w[0, :128, :128] = 0.0  # an all-zero block / group / channel beside them
    q = quantize_weight(w, scheme)
    assert torch.isfinite(q.scale).all() and (q.scale > 0).all()
    deq = dequantize_weight(q.q, q.scale, q.zero, scheme)
    assert torch.isfinite(deq).all()
    s = _expand_scale(scheme, q.scale, N, K)
    if scheme.weight_dtype == "fp8_e4m3":
        assert ((deq - w).abs() <= _fp8_bound(w, s)).all()
    else:
        assert ((deq - w).abs() <= s * 0.5 * (1 + 1e-4) + 1e-6 * w.abs()).all()
    assert (deq[0, :128, :128] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", W_SCHEMES, ids=_ids)
def test_transposed_float_weights_quantize_to_contiguous_storage(case, dtype, gen):
    """Regression: quantized storage followed the float weights' layout, so weights stored [E, H, 2I]
    and [E, I, H] and passed transposed (gpt-oss) gave strided q and scales, which the native CPU
    kernels skip and the Triton launchers refuse."""
    E, H, I = 2, 256, 128
    w13_t = torch.randn(E, H, 2 * I, generator=gen).to(dtype)  # [E, H, 2I] as stored
    w2_t = torch.randn(E, I, H, generator=gen).to(dtype)
    w = quantize_experts(w13_t.transpose(1, 2), w2_t.transpose(1, 2), case[0], **case[1])
    ref = quantize_experts(w13_t.transpose(1, 2).contiguous(), w2_t.transpose(1, 2).contiguous(), case[0], **case[1])
    for name in ("w13", "w2"):
        got, want = getattr(w, name), getattr(ref, name)
        assert got.is_contiguous(), name
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), name
    for name, t in w.scales.items():
        assert t.is_contiguous() and torch.equal(t, ref.scales[name]), name


def test_int4_symmetric_scale_is_amax_over_7(gen):
    scheme = get_scheme("int4_w4a16", group_size=32)
    w = torch.randn(2, 16, 64, generator=gen)
    q = quantize_weight(w, scheme)
    torch.testing.assert_close(q.scale, w.view(2, 16, 2, 32).abs().amax(-1) / 7)
    assert q.zero is None


def test_dequantize_matches_the_documented_formula_elementwise(gen):
    """w[e, n, k] = (u - z) * s[e, n, k // g] with u unpacked by hand (low nibble = even column)."""
    scheme = get_scheme("int4_w4a16", group_size=32, symmetric=False)
    w = torch.randn(2, 4, 64, generator=gen)
    q = quantize_weight(w, scheme)
    deq = dequantize_weight(q.q, q.scale, q.zero, scheme)
    for e in range(2):
        for n in range(4):
            for k in range(0, 64, 7):
                byte = int(q.q[e, n, k // 2])
                u = byte & 15 if k % 2 == 0 else byte >> 4
                ref = (u - int(q.zero[e, n, k // 32])) * float(q.scale[e, n, k // 32])
                assert abs(float(deq[e, n, k]) - ref) <= 1e-6 * max(1.0, abs(ref))


def test_pack_int4_layout_and_round_trip(gen):
    u = torch.randint(0, 16, (3, 5, 8), generator=gen, dtype=torch.uint8)
    p = pack_int4(u)
    assert p.shape == (3, 5, 4)
    assert int(p[1, 2, 3]) == int(u[1, 2, 6]) + 16 * int(u[1, 2, 7])
    assert torch.equal(unpack_int4(p), u)
    with pytest.raises(ValueError, match="must be even"):
        pack_int4(u[..., :7])
    with pytest.raises(TypeError, match="uint8"):
        pack_int4(u.to(torch.int32))
    bad = u.clone()
    bad[2, 1, 4] = 16  # packed into a low nibble, it set the next value's low bit
    with pytest.raises(ValueError, match=r"4-bit values in \[0, 15\], got a maximum of 16"):
        pack_int4(bad)


@pytest.mark.parametrize("name", ["fp8_w8a8", "fp8_w8a8_channel", "fp8_w8a8_block128", "int8_w8a8"])
def test_activation_round_trip_within_the_scheme_bound(name, gen):
    scheme = get_scheme(name)
    x = torch.randn(7, 256, generator=gen) * torch.rand(7, 1, generator=gen) * 10
    x[3] = 0.0  # an all-zero row (padding)
    q, s = quantize_activation(x, scheme)
    shapes = {"tensor": (1, 1), "token": (7, 1), "group": (7, 2)}
    assert tuple(s.shape) == shapes[scheme.activation_granularity]
    deq = dequantize_activation(q, s, scheme)
    s_el = s.repeat_interleave(128, 1) if scheme.activation_granularity == "group" else s.expand_as(x)
    if scheme.activation_dtype == "fp8_e4m3":
        assert q.dtype == torch.float8_e4m3fn
        assert ((deq - x).abs() <= _fp8_bound(x, s_el)).all()
        amax = {"tensor": x.abs().amax(), "token": x.abs().amax(1, keepdim=True),
                "group": x.view(7, 2, 128).abs().amax(-1)}[scheme.activation_granularity]
        ref = (amax / FP8_MAX).reshape(s.shape)
        torch.testing.assert_close(s[ref > 0], ref[ref > 0])
        assert (s[ref == 0] == 1).all()  # an all-zero slice gets scale 1
    else:
        assert q.dtype == torch.int8 and int(q.abs().max()) <= 127
        assert ((deq - x).abs() <= s_el * 0.5 * (1 + 1e-5) + 1e-7).all()
    assert (deq[3] == 0).all()


def test_static_activation_scale_saturates_at_the_fp8_range():
    scheme = get_scheme("fp8_w8a8")
    x = torch.tensor([[1.0, -1000.0, 2.0]])
    q, s = quantize_activation(x, scheme, torch.tensor(0.5))
    assert float(s) == 0.5
    assert dequantize_activation(q, s, scheme).tolist() == [[1.0, -224.0, 2.0]]
    with pytest.raises(ValueError, match="static activation scale"):
        quantize_activation(x, get_scheme("int8_w8a8"), torch.tensor(0.5))


def test_weight_only_schemes_do_not_quantize_activations():
    with pytest.raises(ValueError, match="weight-only"):
        quantize_activation(torch.randn(2, 128), get_scheme("int4_w4a16"))


@pytest.mark.parametrize("case", W_SCHEMES, ids=_ids)
def test_quantize_experts_layout_has_E_first_everywhere(case, gen):
    name, opts = case
    E, H, I = 4, 256, 128
    w13, w2 = torch.randn(E, 2 * I, H, generator=gen), torch.randn(E, H, I, generator=gen)
    b13, b2 = torch.randn(E, 2 * I, generator=gen), torch.randn(E, H, generator=gen)
    w = quantize_experts(w13, w2, name, b13=b13, b2=b2, **opts)
    scheme = get_scheme(name, **opts)
    assert w.quant == name
    assert w.w13.shape == (E, 2 * I, H // scheme.pack) and w.w2.shape == (E, H, I // scheme.pack)
    assert w.b13 is b13 and w.b2 is b2
    expected = {"w13_scale", "w2_scale"} | (set() if scheme.symmetric else {"w13_zero", "w2_zero"})
    assert set(w.scales) == expected
    names = dict(w.per_expert_tensors())
    assert expected <= set(names)  # EPLB moves scales and zero points with the weights
    assert all(t.shape[0] == E for t in names.values())


def test_static_activation_scales_are_kept_and_checked(gen):
    w13, w2 = torch.randn(2, 64, 32, generator=gen), torch.randn(2, 32, 32, generator=gen)
    w = quantize_experts(w13, w2, "fp8_w8a8", a13_scale=torch.full((2,), 0.1), a2_scale=torch.full((2,), 0.2))
    assert w.scales["a13_scale"].tolist() == pytest.approx([0.1, 0.1])
    with pytest.raises(ValueError, match=r"a13_scale must be a float tensor \[E=2\]"):
        quantize_experts(w13, w2, "fp8_w8a8", a13_scale=torch.ones(3))
    with pytest.raises(ValueError, match="finite and > 0"):
        quantize_experts(w13, w2, "fp8_w8a8", a2_scale=torch.zeros(2))
    with pytest.raises(ValueError, match="per-tensor fp8 schemes"):
        quantize_experts(w13, w2, "fp8_w8a8_channel", a13_scale=torch.ones(2))


@pytest.mark.parametrize("name, opts, H, I, needs", [
    ("int4_w4a16", {}, 192, 128, 128),                 # H not a multiple of the group
    ("int4_w4a16", dict(group_size=32), 64, 48, 32),    # I not a multiple of the group
    ("int8_w8a16", dict(group_size=64), 96, 64, 64),
    ("fp8_w8a8_block128", {}, 256, 64, 128),           # I not a multiple of the 128x128 blocks
])
def test_shapes_that_do_not_fit_are_rejected(name, opts, H, I, needs):
    w13, w2 = torch.randn(2, 2 * I, H), torch.randn(2, H, I)
    with pytest.raises(ValueError, match=rf"quant='{name}' needs hidden_size and intermediate_size to be multiples "
                                         rf"of {needs} .*got H={H}, I={I}"):
        quantize_experts(w13, w2, name, **opts)


def test_per_tensor_and_channel_schemes_take_any_shape(gen):
    for name in ("fp8_w8a8", "fp8_w8a8_channel", "int8_w8a8"):
        w = quantize_experts(torch.randn(2, 14, 9, generator=gen), torch.randn(2, 9, 7, generator=gen), name)
        assert w.w13.shape == (2, 14, 9)


def test_bad_weights_are_errors():
    w13, w2 = torch.randn(2, 64, 32), torch.randn(2, 32, 32)
    with pytest.raises(TypeError, match="w13 must be a float32/bfloat16/float16 tensor"):
        quantize_experts(w13.to(torch.int32), w2, "int8_w8a8")
    bad = w2.clone()
    bad[1, 2, 3] = float("nan")
    with pytest.raises(ValueError, match="w2 contains non-finite values"):
        quantize_experts(w13, bad, "int8_w8a8")
    with pytest.raises(ValueError, match=r"w13 must be \[E=2, 2I=64 or I=32, H=32\]"):
        quantize_experts(torch.randn(2, 48, 32), w2, "int8_w8a8")
    with pytest.raises(ValueError, match="quant must be one of"):
        quantize_experts(w13, w2, "int2")
    for name in ("fp8_w8a8", "int8_w8a8", "int4_w4a16"):  # H = 0 or I = 0: an IndexError from amax, or accepted
        with pytest.raises(ValueError, match=r"w2 must be \[E, H, I\] with H >= 1 and I >= 1, got \(2, 0, 128\)"):
            quantize_experts(torch.randn(2, 256, 0), torch.randn(2, 0, 128), name)
        with pytest.raises(ValueError, match=r"H >= 1 and I >= 1, got \(2, 128, 0\)"):
            quantize_experts(torch.randn(2, 0, 128), torch.randn(2, 128, 0), name)


@pytest.mark.parametrize("bias, error, match", [
    (dict(b13=torch.zeros(2, 3)), ValueError, r"b13 must have shape \[2, 64\], got \[2, 3\]"),
    (dict(b13=torch.zeros(2, 32)), ValueError, r"b13 must have shape \[2, 64\], got \[2, 32\]"),
    (dict(b2=torch.zeros(2, 32, dtype=torch.int64)), TypeError, r"b2 must be a float tensor, got torch.int64"),
    (dict(b2=[0.0] * 32), TypeError, r"b2 must be a torch.Tensor, got list"),
], ids=["b13-wrong-shape", "b13-I-rows-for-gated-w13", "b2-int64", "b2-not-a-tensor"])
def test_bad_biases_are_errors_before_quantizing(bias, error, match):
    """Regression: biases were kept unchecked and refused only at the first call."""
    with pytest.raises(error, match=match):
        quantize_experts(torch.randn(2, 64, 32), torch.randn(2, 32, 32), "int8_w8a8", **bias)


def test_weight_and_activation_shapes_that_do_not_fit_are_errors():
    """Regression: quantize_weight / quantize_activation failed inside a view (or, for 3-D x,
    took per-token scales over the wrong dim) instead of naming the shape."""
    with pytest.raises(ValueError, match=r"w must be 3-D \[E, N, K\], got shape \(128, 128\)"):
        quantize_weight(torch.randn(128, 128), get_scheme("int8_w8a8"))
    with pytest.raises(ValueError, match=r"N a multiple of 1 and K of 128, got \(2, 128, 96\)"):
        quantize_weight(torch.randn(2, 128, 96), get_scheme("int4_w4a16"))
    with pytest.raises(ValueError, match=r"N a multiple of 128 and K of 128, got \(2, 96, 128\)"):
        quantize_weight(torch.randn(2, 96, 128), get_scheme("fp8_w8a8_block128"))
    with pytest.raises(ValueError, match=r"K a multiple of 128 .*got shape \(3, 96\)"):
        quantize_activation(torch.randn(3, 96), get_scheme("fp8_w8a8_block128"))
    with pytest.raises(ValueError, match=r"x must be 2-D \[n, K\].*got shape \(2, 3, 64\)"):
        quantize_activation(torch.randn(2, 3, 64), get_scheme("int8_w8a8"))


@pytest.mark.parametrize("case", W_SCHEMES, ids=_ids)
def test_quantizing_parameters_gives_tensors_outside_autograd(case, gen):
    """Regression: quantizing nn.Parameters gave scales (and fp8 weights) that required grad, so
    every w8a8 backend refused the weights ("inputs require grad") and weight-only ones fell
    back to the autograd reference."""
    w13 = torch.nn.Parameter(torch.randn(2, 256, 128, generator=gen))
    w2 = torch.nn.Parameter(torch.randn(2, 128, 128, generator=gen))
    extra = dict(a13_scale=torch.ones(2, requires_grad=True)) if case[0] == "fp8_w8a8" else {}
    w = quantize_experts(w13, w2, case[0], **case[1], **extra)
    assert not any(t.requires_grad for _, t in w.per_expert_tensors())
    x, logits = torch.randn(3, 128, generator=gen), torch.randn(3, 2, generator=gen)
    weights, ids = torch.topk(logits.softmax(-1), 1)
    fused_experts(x, w, None, weights, ids.to(torch.int32))  # an oracle pick, not "no backend can run"

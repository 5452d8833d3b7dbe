"""Every CPU-capable backend against the fp32 `reference` on fresh random inputs (PERF.md tolerances)."""

import pytest
import torch

from moekit import ActivationParams, ExpertWeights, RoutingConfig, fused_experts, route
from moekit.activations import ACTIVATIONS, is_gated
from moekit.experts.reference import reference_experts

from conftest import TOL, rel_err
from hypothesis_or_skip import given, settings, st

BACKENDS = ["grouped_mm", "cpu"]


def make_problem(T, E, H, I, k, dtype, gen, activation="silu", bias=False, starve=True):
    """Random inputs; with starve, expert E-1 never receives a token (k < E)."""
    rows = 2 * I if is_gated(activation) else I
    x = torch.randn(T, H, generator=gen).to(dtype)
    w13 = (torch.randn(E, rows, H, generator=gen) * H ** -0.5).to(dtype)
    w2 = (torch.randn(E, H, I, generator=gen) * I ** -0.5).to(dtype)
    b13 = (torch.randn(E, rows, generator=gen) * 0.1).to(dtype) if bias else None
    b2 = (torch.randn(E, H, generator=gen) * 0.1).to(dtype) if bias else None
    logits = torch.randn(T, E, generator=gen)
    if starve and k < E:
        logits[:, E - 1] = float("-inf")
    w, ids = route(logits, RoutingConfig(top_k=k))
    return x, ExpertWeights(w13, w2, b13, b2), w, ids


def check(backend, x, weights, w, ids, dtype, **kw):
    out = fused_experts(x, weights, None, w, ids, backend=backend, **kw)
    ref = reference_experts(x, weights, w, ids, **kw)
    assert out.dtype == x.dtype and out.shape == x.shape
    assert rel_err(out, ref) <= TOL[dtype], f"{backend}: rel err {rel_err(out, ref):.3g}"
    return out


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("T", [0, 1, 2, 33, 257], ids=["T0", "T1", "T2", "T33", "T257"])
@pytest.mark.parametrize("k", [1, 2, 6], ids=["k1", "k2", "k=E"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_backend_matches_reference(backend, T, k, dtype, gen):
    # odd H and I (grouped_mm needs 16-byte rows: it gets the nearest aligned sizes);
    # E=6 so k=6 is k == E; expert 5 starves when k < E
    H, I = (45, 19) if backend != "grouped_mm" else (48, 24)
    x, weights, w, ids = make_problem(T, 6, H, I, k, dtype, gen)
    check(backend, x, weights, w, ids, dtype)


def test_grouped_mm_refuses_unaligned_rows_with_reason(gen):
    x, weights, w, ids = make_problem(3, 4, 45, 19, 2, torch.float32, gen)
    with pytest.raises(ValueError, match="multiples of 4"):
        fused_experts(x, weights, None, w, ids, backend="grouped_mm")
    # auto picks a backend that can serve it
    assert fused_experts(x, weights, None, w, ids).shape == x.shape


@pytest.mark.parametrize("backend", ["cpu", "grouped_mm"])
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_every_activation_with_bias(backend, activation, gen):
    x, weights, w, ids = make_problem(17, 5, 24, 12, 2, torch.float32, gen, activation=activation, bias=True)
    check(backend, x, weights, w, ids, torch.float32, activation=activation,
          activation_params=ActivationParams(alpha=1.5, limit=0.8))


def test_fp16_on_cpu_backend(gen):
    x, weights, w, ids = make_problem(40, 8, 32, 16, 2, torch.float16, gen)
    check("cpu", x, weights, w, ids, torch.float16)


def test_cpu_backend_under_inference_mode_then_outside(gen, monkeypatch):
    # its reused weight-block buffers, first made under torch.inference_mode, must not be
    # written in place outside it (an inference tensor cannot be)
    from moekit.experts import cpu  # noqa: PLC0415

    monkeypatch.setattr(cpu, "_BUFFERS", cpu._BlockBuffers())  # none made yet
    x, weights, w, ids = make_problem(40, 8, 32, 16, 2, torch.bfloat16, gen)
    with torch.inference_mode():
        inside = fused_experts(x, weights, None, w, ids, backend="cpu")
    with torch.no_grad():
        outside = fused_experts(x, weights, None, w, ids, backend="cpu")
    assert torch.equal(inside, outside)
    check("cpu", x, weights, w, ids, torch.bfloat16)


def test_grouped_mm_refuses_fp16_on_cpu(gen):
    x, weights, w, ids = make_problem(4, 4, 16, 8, 1, torch.float16, gen)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        fused_experts(x, weights, None, w, ids, backend="grouped_mm")


@pytest.mark.parametrize("T", [2, 31], ids=["decode-path", "sorted-path"])
@pytest.mark.parametrize("backend", BACKENDS + ["reference"])
def test_expert_map_with_non_local_experts(backend, T, gen):
    # 10 global experts, this rank holds 4 of them; the rest contribute zero
    E_g, H, I, k = 10, 20, 12, 3
    x = torch.randn(T, H, generator=gen)
    w13_g = torch.randn(E_g, 2 * I, H, generator=gen) * 0.2
    w2_g = torch.randn(E_g, H, I, generator=gen) * 0.2
    w, ids = route(torch.randn(T, E_g, generator=gen), RoutingConfig(top_k=k))
    local = torch.tensor([1, 4, 5, 9])
    expert_map = torch.full((E_g,), -1, dtype=torch.int32)
    expert_map[local] = torch.arange(4, dtype=torch.int32)
    out = fused_experts(x, w13_g[local], w2_g[local], w, ids, expert_map=expert_map, backend=backend)
    # the same result from the full layer with the non-local experts' weights zeroed out
    keep = torch.isin(ids.long(), local)
    ref = reference_experts(x, ExpertWeights(w13_g, w2_g), w * keep, ids)
    assert rel_err(out, ref) <= 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
def test_router_weight_on_input(backend, gen):
    x, weights, _, _ = make_problem(23, 6, 16, 8, 1, torch.float32, gen)
    w, ids = route(torch.randn(23, 6, generator=gen),
                   RoutingConfig(top_k=1, order="topk_then_sigmoid", apply_router_weight_on_input=True))
    out = check(backend, x, weights, w, ids, torch.float32, apply_router_weight_on_input=True)
    # differs from weighting the output (the activation is non-linear)
    assert rel_err(fused_experts(x, weights, None, w, ids, backend=backend), out) > 1e-3


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_contiguous_inputs(backend, gen):
    x, weights, w, ids = make_problem(12, 4, 16, 8, 2, torch.float32, gen)
    x_nc = torch.stack((x, x), -1)[..., 0]  # strided view with x's values
    assert not x_nc.is_contiguous()
    out = fused_experts(x_nc, weights, None, w.t().contiguous().t(), ids, backend=backend)
    ref = reference_experts(x, weights, w, ids)
    assert rel_err(out, ref) <= 1e-5


def test_reference_reads_as_the_math(gen):
    # one token, k=2: the reference equals the formula written out by hand
    x, weights, w, ids = make_problem(1, 4, 6, 3, 2, torch.float64, gen, starve=False)
    out = reference_experts(x, weights, w, ids)
    want = torch.zeros(6, dtype=torch.float64)
    for j in range(2):
        e = int(ids[0, j])
        h = weights.w13[e] @ x[0]
        a = torch.nn.functional.silu(h[:3]) * h[3:]
        want += w[0, j].double() * (weights.w2[e] @ a)
    # The reference computes in fp32: within fp32 rounding of the whole row (an element that
    # cancels to near zero carries the rounding of the terms that cancelled, so no per-element
    # bound). Cancellation in h before the activation reaches the row too: over 20000 seeds the
    # row's error was at most 2.4e-6 (above 1e-6 in 0.015 % of them), so 1e-5; a wrong formula
    # is off by far more.
    assert rel_err(out[0], want) <= 1e-5


@settings(max_examples=25, deadline=None)
@given(
    T=st.integers(0, 40), E=st.integers(1, 9), H=st.integers(1, 40), I=st.integers(1, 24),
    kf=st.floats(0.0, 1.0), backend=st.sampled_from(BACKENDS), seed=st.integers(0, 2**31 - 1),
)
def test_property_random_shapes(T, E, H, I, kf, backend, seed):
    k = 1 + int(kf * (E - 1))
    if backend == "grouped_mm":  # 16-byte rows
        H, I = 4 * ((H + 3) // 4), 4 * ((I + 3) // 4)
    g = torch.Generator().manual_seed(seed)
    x, weights, w, ids = make_problem(T, E, H, I, k, torch.float32, g, starve=False)
    check(backend, x, weights, w, ids, torch.float32)


def test_deterministic_run_to_run(gen):
    x, weights, w, ids = make_problem(300, 8, 64, 32, 2, torch.float32, gen)
    for backend in BACKENDS:
        a = fused_experts(x, weights, None, w, ids, backend=backend)
        b = fused_experts(x, weights, None, w, ids, backend=backend)
        assert torch.equal(a, b)


@pytest.mark.parametrize("aligned", [False, True], ids=["odd-sizes", "aligned"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_cpu_blocked_fp32_path(monkeypatch, dtype, aligned, gen):
    # The path AVX2-only CPUs take: fp32 GEMMs from weights converted block by block over I.
    from moekit.experts import cpu

    monkeypatch.setattr(cpu.CPUBackend, "native_products", False)  # torch's paths (native: tests/test_native.py)
    monkeypatch.setattr(cpu, "native_dtypes", lambda: frozenset({torch.float32}))
    monkeypatch.setattr(cpu, "BLOCK_BYTES", 16 * 3 * 48 * 4)  # 16-wide blocks: I=40 -> 3 blocks
    H, I = (48, 40) if aligned else (45, 37)
    for activation in ("silu", "relu2_no_mul"):
        x, weights, w, ids = make_problem(29, 5, H, I, 2, dtype, gen, activation=activation, bias=True)
        check("cpu", x, weights, w, ids, dtype, activation=activation)


@pytest.mark.parametrize("env", ["ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA"])
def test_isa_cap_disables_native_bf16(monkeypatch, env):
    # A user capping the ISA at AVX2 gets the blocked fp32 path (bf16 GEMMs are emulated there).
    from moekit.experts import cpu

    monkeypatch.setenv(env, "AVX2")
    cpu.native_dtypes.cache_clear()
    try:
        assert cpu.native_dtypes() == frozenset({torch.float32})
    finally:
        monkeypatch.delenv(env)
        cpu.native_dtypes.cache_clear()


@pytest.mark.parametrize("rows", [1, 2, 37, 200, 300], ids=["mv", "swap2", "swap37", "swap-or-not200", "xWt300"])
@pytest.mark.parametrize("wide", [False, True], ids=["K>N", "K<=N"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_cpu_native_bf16_products_by_rows_per_expert(monkeypatch, rows, wide, bias, gen):
    # bf16 on CPUs that multiply it natively: torch.mv for one row, (w x^T)^T for a few rows
    # of an expert (up to 2 SWAP_ROWS where K <= N), x w^T beyond; every form against the reference.
    from moekit.experts import cpu

    monkeypatch.setattr(cpu, "native_dtypes", lambda: frozenset({torch.float32, torch.bfloat16}))
    # GEMM1 w13 [2I, H], GEMM2 w2 [H, I]: K > N in one of them unless wide. Sizes large enough
    # that one bf16 row stays inside the bf16 bound (at H = 24 it reached 1.03e-2 in 1 of 3000 seeds).
    H, I = (256, 128) if wide else (128, 256)
    x, weights, w, ids = make_problem(rows, 3, H, I, 1, torch.bfloat16, gen, bias=bias)
    ids = torch.ones_like(ids)  # every row on expert 1: `rows` rows for one expert
    out = check("cpu", x, weights, w, ids, torch.bfloat16)
    # Rows of an expert do not see each other: each row's output matches the same row alone
    # (two bf16 results of different product forms: twice the bound against fp32).
    alone = fused_experts(x[-1:], weights, None, w[-1:], ids[-1:], backend="cpu")
    assert rel_err(out[-1:], alone) <= 2 * TOL[torch.bfloat16]


def test_cpu_swap_rule():
    from moekit.experts.cpu import SWAP_ROWS, _swapped

    square, tall, wide = torch.empty(64, 64), torch.empty(256, 64), torch.empty(64, 256)
    assert _swapped(SWAP_ROWS, wide) and not _swapped(SWAP_ROWS + 1, wide)
    assert _swapped(2 * SWAP_ROWS, square) and _swapped(2 * SWAP_ROWS, tall)
    assert not _swapped(2 * SWAP_ROWS + 1, tall)


@pytest.mark.parametrize("T", [1, 2])
def test_cpu_decode_path_where_bf16_is_emulated(monkeypatch, T, gen):
    # A few assignments multiply one row in bf16 even where bf16 GEMMs are emulated (cheaper
    # than converting the expert's weights at one row); more take the fp32 block path.
    from moekit.experts import cpu

    monkeypatch.setattr(cpu.CPUBackend, "native_products", False)  # torch's paths (native: tests/test_native.py)
    monkeypatch.setattr(cpu, "native_dtypes", lambda: frozenset({torch.float32}))
    blocks = []
    real = cpu._block_size
    monkeypatch.setattr(cpu, "_block_size", lambda *a: blocks.append(real(*a)) or blocks[-1])
    x, weights, w, ids = make_problem(T, 5, 128, 96, 3, torch.bfloat16, gen, bias=True)
    check("cpu", x, weights, w, ids, torch.bfloat16)
    assert blocks == []  # the decode path: no weights converted
    x, weights, w, ids = make_problem(9, 5, 48, 40, 2, torch.bfloat16, gen, bias=True)
    check("cpu", x, weights, w, ids, torch.bfloat16)
    assert blocks  # 18 assignments: the block path


def test_triton_backend_without_triton_names_the_extra(monkeypatch):
    """Where Triton is not installed, backend='triton' was refused as an unknown name."""
    import moekit  # noqa: PLC0415
    from moekit.experts import base  # noqa: PLC0415

    monkeypatch.delitem(base.BACKENDS, "triton", raising=False)
    with pytest.raises(ValueError, match=r"backend 'triton' needs Triton: pip install 'moekit\[gpu\]'"):
        moekit.FusedMoE(4, 16, 8, moekit.RoutingConfig(top_k=2), backend="triton")
    with pytest.raises(ValueError, match="backend must be 'auto' or one of"):
        base.get_backend("no_such_backend")

"""`cpu_int8` and `cpu_wo` against the emulated reference (PERF.md tolerances, plus the tighter
bound each exact path must meet), on many shapes and edges; refusals name their reason."""

import pytest
import torch

from conftest import rel_err
from moekit import fused_experts, native, quantize_experts
from moekit.config import ActivationParams
from moekit.experts.base import BACKENDS
from moekit.experts import cpu_weight_only
from moekit.experts.cpu_int8 import CPUInt8Backend
from moekit.experts.cpu_weight_only import CPUWeightOnlyBackend, int4_kernel_available
from moekit.quant import TOLERANCE, get_scheme

GATED = ("silu", "gelu", "gelu_tanh", "swigluoai")

# Exact paths: the int8 GEMM is exact and the fp32 block path dequantizes to the same values
# as the emulation; only summation order (and, for int8, a rare rounding flip of a GEMM2
# input to the neighbouring int8 step: up to 2e-4 seen at 150 rows an expert, in one of about
# 25 runs of the suite with fresh seeds) differs. The int4 kernel path rounds its inputs and group scales to
# bf16 (~2^-9). The native decode products (moekit.native) compute in fp32 from fp32 scales,
# with VNNI (and for int4 on any AVX2 CPU) against x rounded to 16-bit fixed point per group (at
# most 2^-14 of the group's max |x| an element, under 7e-4 of the group's norm; 1e-5 to 2e-4
# seen on these shapes).
TIGHT = {"cpu_int8": 1e-3, "cpu_wo blocks": 1e-5, "cpu_wo native": 1e-3, "cpu_wo int4 kernel": 1e-2,
         "cpu_wo bf16": 1e-2}

CASES = [
    # id, scheme, options, dtype, E, H, I, k, T, activation, bias, on_input, expert_map
    ("int8-fp32", "int8_w8a8", {}, torch.float32, 8, 64, 32, 2, 9, "silu", False, False, False),
    ("int8-bf16-bias", "int8_w8a8", {}, torch.bfloat16, 6, 48, 40, 3, 5, "swigluoai", True, False, False),
    ("int8-odd-H-I", "int8_w8a8", {}, torch.float16, 5, 33, 17, 2, 4, "gelu", False, False, False),
    ("int8-T1", "int8_w8a8", {}, torch.float32, 8, 64, 32, 2, 1, "silu", False, False, False),
    ("int8-k1-on-input", "int8_w8a8", {}, torch.float32, 4, 32, 16, 1, 6, "silu", False, True, False),
    ("int8-k=E-non-gated", "int8_w8a8", {}, torch.float32, 3, 32, 16, 3, 4, "relu2_no_mul", True, False, False),
    ("int8-expert-map", "int8_w8a8", {}, torch.float32, 4, 32, 16, 2, 7, "silu", False, False, True),
    ("int8-empty-experts", "int8_w8a8", {}, torch.float32, 16, 32, 16, 1, 2, "silu", False, False, False),
    # 150 rows an expert: past cpu_int8.SWAP_ROWS, the products take x as the left operand
    ("int8-150-rows-an-expert", "int8_w8a8", {}, torch.float32, 2, 32, 16, 2, 150, "silu", True, False, False),
    ("w8a16-fp32", "int8_w8a16", {}, torch.float32, 4, 128, 128, 2, 6, "silu", False, False, False),
    ("w8a16-g32-zp-bias", "int8_w8a16", dict(group_size=32, symmetric=False), torch.bfloat16, 5, 96, 64, 2, 5,
     "gelu", True, False, False),
    ("w4a16-fp32", "int4_w4a16", {}, torch.float32, 4, 128, 128, 2, 6, "silu", False, False, False),
    ("w4a16-bf16", "int4_w4a16", {}, torch.bfloat16, 6, 128, 128, 2, 7, "silu", False, False, False),
    ("w4a16-bf16-g32-zp-bias", "int4_w4a16", dict(group_size=32, symmetric=False), torch.bfloat16, 5, 96, 64, 3, 5,
     "swigluoai", True, False, False),
    ("w4a16-bf16-g64-T1-map", "int4_w4a16", dict(group_size=64), torch.bfloat16, 4, 64, 64, 2, 1,
     "silu", False, False, True),
    ("w4a16-fp16-g64-on-input", "int4_w4a16", dict(group_size=64), torch.float16, 4, 64, 64, 1, 5,
     "gelu_tanh", False, True, False),
    ("w4a16-bf16-non-gated-k1", "int4_w4a16", dict(group_size=32), torch.bfloat16, 8, 64, 32, 1, 3,
     "silu_no_mul", False, False, False),
    # the int4 kernel's decode path (T k <= 16) with weights on the input, and its sorted path
    ("w4a16-bf16-on-input", "int4_w4a16", dict(group_size=64), torch.bfloat16, 4, 64, 64, 2, 5,
     "silu", True, True, False),
    ("w4a16-bf16-sorted-bias", "int4_w4a16", dict(group_size=64), torch.bfloat16, 4, 64, 64, 2, 12,
     "silu", True, False, False),
    ("int8-on-input-bias", "int8_w8a8", {}, torch.bfloat16, 4, 32, 16, 2, 5, "silu", True, True, False),
]


def _problem(case, gen):
    _, name, opts, dtype, E, H, I, k, T, act, bias, on_input, use_map = case
    rows = 2 * I if act in GATED else I
    extra = {}
    if bias:
        extra = dict(b13=torch.randn(E, rows, generator=gen).to(dtype), b2=torch.randn(E, H, generator=gen).to(dtype))
    w = quantize_experts(torch.randn(E, rows, H, generator=gen) * H ** -0.5,
                         torch.randn(E, H, I, generator=gen) * I ** -0.5, name, **opts, **extra)
    emap = None
    E_ids = E
    if use_map:  # twice as many global experts, half of them elsewhere
        E_ids = 2 * E
        emap = torch.full((E_ids,), -1, dtype=torch.int32)
        emap[torch.randperm(E_ids, generator=gen)[:E]] = torch.arange(E, dtype=torch.int32)
    x = torch.randn(T, H, generator=gen).to(dtype)
    ids = torch.rand(T, E_ids, generator=gen).argsort(1)[:, :k].to(torch.int32)
    if use_map:  # the last row all remote, every other row with a local expert first
        local, remote = (emap >= 0).nonzero()[:, 0], (emap < 0).nonzero()[:, 0]
        for t in range(T):
            pool = remote if t == T - 1 and T > 1 else local
            first = pool[torch.randint(len(pool), (1,), generator=gen)]
            rest = torch.tensor([i for i in torch.randperm(E_ids, generator=gen).tolist() if i != int(first)])
            rest = rest[emap[rest] < 0] if t == T - 1 and T > 1 else rest
            ids[t] = torch.cat((first, rest[:k - 1])).to(torch.int32)
    tw = torch.rand(T, k, generator=gen)
    kwargs = dict(activation=act, activation_params=ActivationParams(), apply_router_weight_on_input=on_input,
                  expert_map=emap)
    return w, x, tw, ids, kwargs


def _path(backend, x, w, ids, name, opts):
    if backend == "cpu_int8":
        return "cpu_int8"
    scheme = get_scheme(name, **opts)
    decode = ids.numel() <= cpu_weight_only.DIRECT_ASSIGNMENTS
    if decode and BACKENDS["cpu_wo"].native_library(w, scheme) is not None:
        return "cpu_wo native"
    kernel = CPUWeightOnlyBackend.uses_int4_kernel(x.dtype, scheme)
    return "cpu_wo int4 kernel" if kernel else "cpu_wo blocks"


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_backend_matches_the_emulated_reference(case, gen):
    w, x, tw, ids, kwargs = _problem(case, gen)
    name, opts = case[1], case[2]
    backend = "cpu_int8" if name == "int8_w8a8" else "cpu_wo"
    out = BACKENDS[backend].apply(x, w, tw, ids, **kwargs)
    ref = BACKENDS["reference"].apply(x, w, tw, ids, **kwargs)
    assert out.dtype == torch.float32 and out.shape == ref.shape
    assert torch.isfinite(out).all()
    err = rel_err(out, ref)
    assert err <= TOLERANCE[get_scheme(name).precision]  # PERF.md
    assert err <= TIGHT[_path(backend, x, w, ids, name, opts)]


@pytest.mark.parametrize("H, I, activation", [
    (1, 16, "silu"),  # GEMM1 with K = H = 1
    (16, 1, "silu"),  # GEMM2 with K = I = 1
    (8, 1, "silu_no_mul"),  # GEMM1 with N = I = 1 (torch._int_mm swapped) and GEMM2 with K = 1
    (1, 1, "silu_no_mul"),  # every dim of both GEMMs 1
])
@pytest.mark.parametrize("T", [40, 150])  # up to and past cpu_int8.SWAP_ROWS rows an expert
def test_int8_products_with_a_size_one_dim_are_exact(H, I, activation, T, gen):
    """Regression: torch._int_mm gave garbage (errors of 1e4 and more) for H = 1 or I = 1 from
    about 32 rows an expert; the torch path (native products off) must match the reference."""
    rows = 2 * I if activation in GATED else I
    w = quantize_experts(torch.randn(2, rows, H, generator=gen), torch.randn(2, H, I, generator=gen), "int8_w8a8")
    x = torch.randn(T, H, generator=gen)
    ids = (torch.arange(T) % 2).to(torch.int32)[:, None]  # T / 2 rows for each expert
    tw = torch.rand(T, 1, generator=gen)
    kw = dict(activation=activation, activation_params=ActivationParams(), apply_router_weight_on_input=False,
              expert_map=None)
    plain = CPUInt8Backend()
    plain.native_products = False
    ref = BACKENDS["reference"].apply(x, w, tw, ids, **kw)
    assert rel_err(plain.apply(x, w, tw, ids, **kw), ref) <= TIGHT["cpu_int8"]


def test_rows_of_remote_experts_and_empty_experts_are_zero(gen):
    case = next(c for c in CASES if c[0] == "int8-expert-map")
    w, x, tw, ids, kwargs = _problem(case, gen)
    out = BACKENDS["cpu_int8"].apply(x, w, tw, ids, **kwargs)
    all_remote = (kwargs["expert_map"].long()[ids.long()] < 0).all(dim=1)
    assert all_remote.tolist() == [False] * (len(ids) - 1) + [True]
    assert (out[-1] == 0).all() and (out[:-1] != 0).any(dim=1).all()


@pytest.mark.parametrize("name, backend", [("int8_w8a8", "cpu_int8"), ("int4_w4a16", "cpu_wo"),
                                           ("int8_w8a16", "cpu_wo")])
@pytest.mark.parametrize("T", [0, 1])
def test_fused_experts_explicit_backend_at_t0_t1(name, backend, T, gen):
    w = quantize_experts(torch.randn(4, 256, 128, generator=gen), torch.randn(4, 128, 128, generator=gen), name)
    x = torch.randn(T, 128, generator=gen, dtype=torch.bfloat16)
    ids = torch.randint(0, 4, (T, 2), generator=gen, dtype=torch.int32)
    tw = torch.rand(T, 2, generator=gen)
    out = fused_experts(x, w, None, tw, ids, backend=backend)
    ref = fused_experts(x, w, None, tw, ids, backend="reference")
    assert out.shape == (T, 128) and out.dtype == torch.bfloat16
    assert rel_err(out.float(), ref.float()) <= TOLERANCE[get_scheme(name).precision]


def test_oracle_picks_the_quantized_cpu_backends(gen):
    from moekit.experts.api import problem_of
    from moekit.oracle import choose_backend

    for name, expected in (("int8_w8a8", "cpu_int8"), ("int8_w8a16", "cpu_wo"), ("int4_w4a16", "cpu_wo"),
                           ("fp8_w8a8_block128", "reference")):
        w = quantize_experts(torch.randn(2, 256, 128), torch.randn(2, 128, 128), name)
        p = problem_of(torch.randn(1, 128), w, 1, "silu", False, False)
        assert choose_backend(p, owner="test").backend.name == expected


@pytest.mark.parametrize("backend, name, match", [
    ("cpu_int8", "int4_w4a16", r"runs quant='int8_w8a8' only, got quant='int4_w4a16'"),
    ("cpu_wo", "int8_w8a8", r"runs weight-only schemes .* got quant='int8_w8a8'"),
    ("cpu", "int8_w8a8", r"unquantized weights only"),
])
def test_explicit_backend_that_cannot_serve_raises_its_reason(backend, name, match):
    w = quantize_experts(torch.randn(2, 256, 128), torch.randn(2, 128, 128), name)
    with pytest.raises(ValueError, match=match):
        fused_experts(torch.randn(2, 128), w, None, torch.rand(2, 1), torch.zeros(2, 1, dtype=torch.int32),
                      backend=backend)


def test_malformed_quantized_weights_are_rejected_by_name():
    w = quantize_experts(torch.randn(2, 256, 128), torch.randn(2, 128, 128), "int4_w4a16", group_size=64)
    x, tw, ids = torch.randn(2, 128), torch.rand(2, 1), torch.zeros(2, 1, dtype=torch.int32)
    bad = type(w)(w.w13, w.w2, scales={**w.scales, "w2_scale": w.scales["w2_scale"][:, :, :1]}, quant=w.quant)
    with pytest.raises(ValueError, match=r"scales\['w2_scale'\] must be \[2, 128, 2\]"):
        fused_experts(x, bad, None, tw, ids)
    bad = type(w)(w.w13.to(torch.int8), w.w2, scales=w.scales, quant=w.quant)
    with pytest.raises(TypeError, match="w13 must be stored as torch.uint8"):
        fused_experts(x, bad, None, tw, ids)
    bad = type(w)(w.w13, w.w2, scales={**w.scales, "a13_scale": torch.ones(2)}, quant=w.quant)
    with pytest.raises(ValueError, match=r"scales\['a13_scale'\] is not part of quant='int4_w4a16'"):
        fused_experts(x, bad, None, tw, ids)
    with pytest.raises(ValueError, match=r"w13 must be \[E=2, 128, 64\]"):
        fused_experts(x, w, None, tw, ids, activation="silu_no_mul")


@pytest.mark.skipif(not int4_kernel_available(), reason="this torch has no CPU int4 kernel")
def test_int4_kernel_repacks_after_an_in_place_weight_change(gen):
    """Regression: the repacked-weight cache must follow in-place writes (EPLB commits rows in place)."""
    w = quantize_experts(torch.randn(4, 256, 128, generator=gen), torch.randn(4, 128, 128, generator=gen), "int4_w4a16")
    x = torch.randn(3, 128, generator=gen, dtype=torch.bfloat16)
    ids, tw = torch.tensor([[0, 1], [2, 3], [1, 2]], dtype=torch.int32), torch.rand(3, 2, generator=gen)
    kw = dict(activation="silu", activation_params=ActivationParams(), apply_router_weight_on_input=False,
              expert_map=None)
    assert CPUWeightOnlyBackend.uses_int4_kernel(x.dtype, get_scheme("int4_w4a16"))
    before = BACKENDS["cpu_wo"].apply(x, w, tw, ids, **kw)
    with torch.no_grad():
        w.w13[1].copy_(w.w13[0])
        w.scales["w13_scale"][1].mul_(2)
    after = BACKENDS["cpu_wo"].apply(x, w, tw, ids, **kw)
    ref = BACKENDS["reference"].apply(x, w, tw, ids, **kw)
    assert rel_err(after, ref) <= TIGHT["cpu_wo int4 kernel"]
    assert rel_err(before, ref) > 0.1


@pytest.mark.parametrize("name, opts, dtype", [
    ("int4_w4a16", {}, torch.bfloat16), ("int4_w4a16", dict(group_size=32, symmetric=False), torch.float32),
    ("int8_w8a16", {}, torch.float16), ("int8_w8a16", dict(group_size=64, symmetric=False), torch.bfloat16),
])
@pytest.mark.parametrize("T, k, on_input, bias", [(1, 8, False, True), (2, 4, True, False), (3, 1, False, False),
                                                   (6, 4, False, True), (7, 3, True, False)])  # the last two sorted
def test_weight_only_with_and_without_native_products(name, opts, dtype, T, k, on_input, bias, gen):
    """The native products (fp32; decode, and sorted calls of a few rows an expert that would
    take the fp32 blocks) and the paths without them (torch's int4 kernel, fp32 blocks) against
    the emulation; H and I a few groups each."""
    fast = CPUWeightOnlyBackend()
    g = get_scheme(name, **opts).group_size
    E, H, I = 12, 3 * g, 2 * g
    extra = dict(b13=torch.randn(E, 2 * I, generator=gen), b2=torch.randn(E, H, generator=gen)) if bias else {}
    w = quantize_experts(torch.randn(E, 2 * I, H, generator=gen) * H ** -0.5,
                         torch.randn(E, H, I, generator=gen) * I ** -0.5, name, **opts, **extra)
    if fast.native_library(w, get_scheme(name, **opts)) is None:
        pytest.skip("moekit's native kernels are not available here")
    plain = CPUWeightOnlyBackend()
    plain.native_products = False
    x = torch.randn(T, H, generator=gen).to(dtype)
    ids = torch.rand(T, E, generator=gen).argsort(1)[:, :k].to(torch.int32)
    tw = torch.rand(T, k, generator=gen)
    kw = dict(activation="silu", activation_params=ActivationParams(), apply_router_weight_on_input=on_input,
              expert_map=None)
    ref = BACKENDS["reference"].apply(x, w, tw, ids, **kw)
    slow_path = "cpu_wo int4 kernel" if CPUWeightOnlyBackend.uses_int4_kernel(dtype, get_scheme(name, **opts)) \
        else "cpu_wo blocks"
    # sorted calls (a few rows an expert here) keep torch's int4 kernel, else take the native products
    sorted_kernel = T * k > cpu_weight_only.DIRECT_ASSIGNMENTS and slow_path == "cpu_wo int4 kernel"
    fast_path = slow_path if sorted_kernel else "cpu_wo native"
    per_gemm = CPUWeightOnlyBackend()
    per_gemm.native_decode = False  # decode: one native call a GEMM instead of the fused FFN
    assert rel_err(fast.apply(x, w, tw, ids, **kw), ref) <= TIGHT[fast_path]
    assert rel_err(per_gemm.apply(x, w, tw, ids, **kw), ref) <= TIGHT[fast_path]
    assert rel_err(plain.apply(x, w, tw, ids, **kw), ref) <= TIGHT[slow_path]


def _sorted_bf16_int4_call(monkeypatch, T: int, gen):
    """A sorted bf16 int4 call of T tokens (E=8, k=4) on cpu_wo, recording the paths it takes
    ("native", "kernel": torch's int4 kernel, "bf16": the vdpbf16ps kernels): (taken, the
    native library, output, reference output)."""
    backend = CPUWeightOnlyBackend()
    w = quantize_experts(torch.randn(8, 256, 128, generator=gen), torch.randn(8, 128, 128, generator=gen),
                         "int4_w4a16")
    lib = backend.native_library(w, get_scheme("int4_w4a16"))
    taken = []
    native_linear, kernel_linear, bf16 = backend._native_linear, backend._int4_kernel_linear, cpu_weight_only.bf16_sorted
    monkeypatch.setattr(backend, "_native_linear", lambda *a: taken.append("native") or native_linear(*a))
    monkeypatch.setattr(backend, "_int4_kernel_linear", lambda *a: taken.append("kernel") or kernel_linear(*a))
    monkeypatch.setattr(cpu_weight_only, "bf16_sorted", lambda *a: taken.append("bf16") or bf16(*a))
    x = torch.randn(T, 128, generator=gen, dtype=torch.bfloat16)
    ids = torch.stack([torch.randperm(8, generator=gen)[:4] for _ in range(T)]).to(torch.int32)
    tw = torch.rand(T, 4, generator=gen)
    kw = dict(activation="silu", activation_params=ActivationParams(), apply_router_weight_on_input=False,
              expert_map=None)
    out = backend.apply(x, w, tw, ids, **kw)
    return taken, lib, out, BACKENDS["reference"].apply(x, w, tw, ids, **kw)


@pytest.mark.parametrize("T", [5, 40, 128, 160])  # 2.5, 20, 64 and 80 rows an expert
def test_sorted_bf16_int4_takes_integer_products_up_to_the_measured_rows(monkeypatch, T, gen):
    """cpu_weight_only.NATIVE_ROWS_INT4_INTEGER: sorted bf16 int4 calls of up to the build's
    measured number of rows an expert (on average over the experts with rows) take the native
    integer products, more rows torch's int4 kernel; both against the reference."""
    from moekit.experts.cpu_weight_only import NATIVE_ROWS_INT4_INTEGER
    monkeypatch.setattr(cpu_weight_only, "bf16_without_amx", lambda: False)  # the rule of the AMX / AVX2 hosts
    lib = native.load()
    if lib is None or not NATIVE_ROWS_INT4_INTEGER.get(lib.isa) or not CPUWeightOnlyBackend.uses_int4_kernel(
            torch.bfloat16, get_scheme("int4_w4a16")):
        pytest.skip("needs a native build with integer int4 products and torch's int4 kernel")
    taken, lib, out, ref = _sorted_bf16_int4_call(monkeypatch, T, gen)
    expected = "native" if T * 4 / 8 <= NATIVE_ROWS_INT4_INTEGER[lib.isa] else "kernel"
    assert taken == [expected]
    assert rel_err(out, ref) <= TIGHT[f"cpu_wo {'int4 kernel' if expected == 'kernel' else 'native'}"]


@pytest.mark.parametrize("T", [5, 20, 40])  # 2.5, 10 and 20 rows an expert
def test_sorted_bf16_int4_without_amx_takes_integer_products_up_to_the_bf16_kernels(monkeypatch, T, gen):
    """On AVX-512 BF16 CPUs without AMX, sorted bf16 int4 calls take the native integer products
    up to BF16_ROWS["int4"] rows an expert and the vdpbf16ps kernels past it, never torch's int4
    kernel; both against the reference."""
    monkeypatch.setattr(cpu_weight_only, "bf16_without_amx", lambda: True)
    monkeypatch.setitem(cpu_weight_only.BF16_ROWS, "int4", 16)
    lib = native.load()
    if lib is None or not lib.bf16_dot:
        pytest.skip("needs a native build with AVX-512 BF16 products")
    taken, _, out, ref = _sorted_bf16_int4_call(monkeypatch, T, gen)
    expected = "native" if T * 4 / 8 <= 16 else "bf16"
    assert taken == [expected]
    assert rel_err(out, ref) <= TIGHT[f"cpu_wo {expected}"]


@pytest.mark.parametrize("name, opts, activation, bias, on_input, rows", [
    ("int4_w4a16", {}, "silu", False, False, 12), ("int4_w4a16", dict(group_size=32, symmetric=False), "swigluoai",
                                                       True, False, 20),
    ("int8_w8a16", {}, "gelu", True, True, 12), ("int8_w8a16", dict(group_size=64, symmetric=False), "relu2_no_mul",
                                                 False, False, 16),
    ("int4_w4a16", {}, "silu", False, False, 4),
])
def test_weight_only_bf16_kernels_past_their_rows_without_amx(monkeypatch, name, opts, activation, bias, on_input,
                                                              rows, gen):
    """cpu_wo on AVX-512 BF16 without AMX: sorted calls of more than BF16_ROWS rows an expert
    on the vdpbf16ps kernels (weights dequantized to bf16), fewer on the other paths; every
    gated or not activation, biases, zero points, weights on the input, against the emulation."""
    from moekit import native
    from moekit.experts import cpu_weight_only

    lib = native.load()
    if lib is None or not lib.bf16_dot:
        pytest.skip("needs a native build with AVX-512 BF16 products")
    monkeypatch.setattr(cpu_weight_only, "bf16_without_amx", lambda: True)
    taken = []
    real = cpu_weight_only.bf16_sorted
    monkeypatch.setattr(cpu_weight_only, "bf16_sorted", lambda *a: taken.append(1) or real(*a))
    E, H, I, k = 6, 128, 128, 2
    gated = activation != "relu2_no_mul"
    scheme = get_scheme(name, **opts)
    N1 = 2 * I if gated else I
    b13, b2 = (torch.randn(E, N1, generator=gen), torch.randn(E, H, generator=gen)) if bias else (None, None)
    w = quantize_experts(torch.randn(E, N1, H, generator=gen) * H ** -0.5, torch.randn(E, H, I, generator=gen) * I ** -0.5,
                         scheme.name, b13=b13, b2=b2, **opts)
    T = rows * E // k
    x = torch.randn(T, H, generator=gen, dtype=torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)]).to(torch.int32)
    tw = torch.rand(T, k, generator=gen)
    kw = dict(activation=activation, activation_params=ActivationParams(), apply_router_weight_on_input=on_input,
              expert_map=None)
    out = cpu_weight_only.CPUWeightOnlyBackend().apply(x, w, tw, ids, **kw)
    assert bool(taken) is (rows > cpu_weight_only.BF16_ROWS[scheme.weight_dtype])
    assert rel_err(out, BACKENDS["reference"].apply(x, w, tw, ids, **kw)) <= TIGHT["cpu_wo bf16"]


@pytest.mark.parametrize("quant", [None, "int8_w8a8", "int8_w8a16", "int4_w4a16"])
def test_layers_built_under_inference_mode_run_and_follow_in_place_writes(quant, gen):
    """Regression: caches keyed on tensor versions (the decode path's fp32 biases, the int4
    kernel's repacked weights) read `_version`, which inference tensors lack, so a layer built
    under torch.inference_mode failed at decode (with biases) and in bf16 int4 prefill calls."""
    from moekit import FusedMoE, RoutingConfig

    E, H, I = 4, 128, 128
    tensors = (torch.randn(E, 2 * I, H, generator=gen) / 11, torch.randn(E, H, I, generator=gen) / 11,
               torch.randn(E, 2 * I, generator=gen), torch.randn(E, H, generator=gen))
    twin = FusedMoE(E, H, I, RoutingConfig(top_k=2), bias=True, quant=quant, dtype=torch.bfloat16)
    twin.load_weights(*tensors)
    with torch.inference_mode():
        layer = FusedMoE(E, H, I, RoutingConfig(top_k=2), bias=True, quant=quant, dtype=torch.bfloat16)
        layer.load_weights(*tensors)
        for T in (1, 3, 64):  # decode, and sorted calls (torch's int4 kernel for bf16 int4 at 64)
            x, logits = torch.randn(T, H, generator=gen).to(torch.bfloat16), torch.randn(T, E, generator=gen)
            assert torch.equal(layer(x, logits), twin(x, logits))
            layer.experts.b13.add_(1.0)  # an in-place write the next call must see
            with torch.no_grad():
                twin.experts.b13.add_(1.0)

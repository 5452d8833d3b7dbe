"""moekit.native: the C kernels compiled on first use, against torch (int8: exact int32
products; weight-only: x @ dequantized w^T) on random shapes for every instruction-set build
this CPU can run; how they refuse; the cpu_int8 decode path with and without them (the
weight-only decode paths: tests/quant/test_quant_cpu_backends.py)."""

import platform
import sys

import pytest
import torch

from conftest import random_expert_map, rel_err
from hypothesis_or_skip import given, settings, st
from moekit import native, quantize_experts
from moekit.activations import apply_activation
from moekit.config import ActivationParams
from moekit.experts.base import BACKENDS
from moekit.experts.cpu_int8 import CPUInt8Backend
from moekit.quant import get_scheme
from moekit.quant.quantize import dequantize_weight, quantize_activation, quantize_weight

pytestmark = pytest.mark.skipif(
    sys.platform != "linux" or platform.machine() != "x86_64" or native._compiler() is None,
    reason="native kernels build on x86-64 Linux with a C compiler")


def _cpu_flags() -> set:
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    return set()


ISAS = (["native", "scalar"] + (["avx2", "avx2_rows4"] if "avx2" in _cpu_flags() else [])
        + (["avx2_vnni"] if {"avx2", "avx_vnni"} <= _cpu_flags() else [])
        + (["avx512", "native_rows1", "native_rows4"] if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= _cpu_flags()
           else []))


@pytest.fixture(scope="module")
def libs(tmp_path_factory):
    """Each build compiled afresh into an empty cache folder."""
    cache = tmp_path_factory.mktemp("moekit-native")
    return {isa: native.build(isa, cache_dir=cache) for isa in ISAS}


def _segments(sizes, n, E, gen):
    """experts [S], starts [S + 1] and the expert of each row for segments of `sizes` rows (0
    allowed); sizes None: n one-row segments and starts None (a decode token's slots)."""
    if sizes is None:
        experts = torch.randint(0, E, (n,), generator=gen)
        return experts, None, experts
    experts = torch.randint(0, E, (len(sizes),), generator=gen)
    starts = torch.tensor([0] + sizes, dtype=torch.long).cumsum(0)
    return experts, starts, torch.repeat_interleave(experts, starts.diff())


segment_sizes = st.lists(st.integers(0, 4), min_size=0, max_size=6)


@pytest.mark.parametrize("isa", ISAS)
@settings(max_examples=25, deadline=None)
@given(E=st.integers(1, 6), N=st.integers(1, 70), K=st.integers(1, 300), sizes=st.one_of(st.none(), segment_sizes),
       n=st.integers(0, 9), shared=st.booleans(), seed=st.integers(0, 2 ** 31 - 1))
def test_int8_gemm_is_exact(libs, isa, E, N, K, sizes, n, shared, seed):
    """Any N and K (vector loops, 4-row groups and their tails), one row a segment (sizes None:
    n slots) or segments of 0-4 rows, repeated experts, one shared x row or one a row."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randint(-127, 128, (E, N, K), generator=g, dtype=torch.int8)
    experts, starts, row_expert = _segments(sizes, n, E, g)
    R = len(row_expert)
    x = torch.randint(-127, 128, (1 if shared else R, K), generator=g, dtype=torch.int8)
    out = torch.full((R, N), 7, dtype=torch.int32)
    libs[isa].int8_gemm(w, experts, x, out, starts)
    rows = [w[e].int() @ x[j if x.shape[0] > 1 else 0].int() for j, e in enumerate(row_expert.tolist())]
    assert torch.equal(out, torch.stack(rows) if rows else torch.empty(0, N, dtype=torch.int32))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("K", [7168, 100_003])
def test_int8_gemm_extremes_and_long_rows_stay_exact(libs, isa, K):
    """-127 * -127 in every lane over long rows, and mixed signs; at K = 100003 the VNNI builds'
    unsigned-weight sums (w + 128) x pass 2^31 before the offset comes off (modulo 2^32, as the
    lanes wrap), while the products themselves fit int32; x = -128 (int8 inputs) too."""
    w = torch.full((2, 9, K), -127, dtype=torch.int8)
    w[1, ::2] = 127
    x = torch.full((1, K), -127, dtype=torch.int8)
    out = torch.empty(2, 9, dtype=torch.int32)
    libs[isa].int8_gemm(w, torch.tensor([0, 1]), x, out)
    assert out[0].tolist() == [127 * 127 * K] * 9
    assert out[1].tolist() == [-127 * 127 * K if r % 2 == 0 else 127 * 127 * K for r in range(9)]
    x[0, :1000] = -128
    libs[isa].int8_gemm(w, torch.tensor([0, 1]), x, out)
    assert out[0, 0].item() == 127 * 127 * (K - 1000) + 127 * 128 * 1000


@pytest.mark.parametrize("isa", ISAS)
@settings(max_examples=25, deadline=None)
@given(N=st.integers(1, 40), K=st.integers(1, 200), sizes=st.one_of(st.none(), segment_sizes), n=st.integers(0, 6),
       shared=st.booleans(), seed=st.integers(0, 2 ** 31 - 1))
def test_int8_gemm_quantizes_fp32_rows_as_quantize_activation(libs, isa, N, K, sizes, n, shared, seed):
    """fp32 rows quantized in the kernel: the same scales and the same products as
    quantize_activation's int8 per-token rows, bit for bit, on rows that are zero, subnormal,
    huge, or sit on rounding ties."""
    g = torch.Generator().manual_seed(seed)
    E = 3
    w = torch.randint(-127, 128, (E, N, K), generator=g, dtype=torch.int8)
    experts, starts, row_expert = _segments(sizes, n, E, g)
    R = 1 if shared else len(row_expert)
    x = torch.randn(R, K, generator=g) * torch.tensor([1.0, 0.0, 1e-42, 3e37, 1e-3])[torch.arange(R) % 5, None]
    if R and K > 1:  # ties: amax 127 puts every integer + 0.5 exactly on a rounding tie
        x[0, 0], x[0, 1] = 127.0, 2.5
    out = torch.empty(len(row_expert), N, dtype=torch.int32)
    scales = torch.empty(R, 1)
    libs[isa].int8_gemm(w, experts, x, out, starts, scales=scales)
    q, s = quantize_activation(x, get_scheme("int8_w8a8"))
    expected = torch.empty_like(out)
    libs[isa].int8_gemm(w, experts, q, expected, starts)
    assert torch.equal(scales, s) and torch.equal(out, expected)
    # rescaled in the kernel: (float(acc) * s_x) * s_w, as the backends do it in torch
    w_scale = torch.rand(E, N, generator=g) + 0.5
    rescaled = torch.empty(out.shape)
    libs[isa].int8_gemm(w, experts, x, rescaled, starts, scales=torch.empty(R, 1), w_scale=w_scale)
    s_rows = s if R == 1 else s.index_select(0, torch.arange(len(row_expert)))
    assert torch.equal(rescaled, torch.mul(expected, s_rows).mul_(w_scale.index_select(0, row_expert)))


@pytest.mark.parametrize("isa", ISAS)
@settings(max_examples=25, deadline=None)
@given(name=st.sampled_from(["int4_w4a16", "int8_w8a16"]), g=st.sampled_from([32, 64, 128]),
       symmetric=st.booleans(), E=st.integers(1, 5), N=st.integers(1, 45), groups=st.integers(1, 4),
       sizes=st.one_of(st.none(), segment_sizes), n=st.integers(0, 9), shared=st.booleans(),
       seed=st.integers(0, 2 ** 31 - 1))
def test_wo_gemm_matches_the_dequantized_weights(libs, isa, name, g, symmetric, E, N, groups, sizes, n, shared, seed):
    """Products from int4 / int8 group-quantized weights (with or without zero points) equal
    x @ dequantized w^T up to fp32 summation order: within K * 2^-23 of the sum of the
    magnitudes the kernel adds (s |q| |x| and s |z| |x|, q = (q - z) + z); where the VNNI
    products run, plus x's rounding to 16-bit fixed point: 2^-14 max|x| of each group times
    the group's sum |w|."""
    gen = torch.Generator().manual_seed(seed)
    scheme = get_scheme(name, group_size=g, symmetric=symmetric)
    K = g * groups
    q = quantize_weight(torch.randn(E, N, K, generator=gen), scheme)
    w = dequantize_weight(q.q, q.scale, q.zero, scheme)
    experts, starts, row_expert = _segments(sizes, n, E, gen)
    R = len(row_expert)
    x = torch.randn(1 if shared else R, K, generator=gen)
    out = torch.full((R, N), float("nan"))
    int4 = name.startswith("int4")
    libs[isa].wo_gemm(q.q, q.scale, q.zero, experts, x, out, int4=int4, group_size=g, starts=starts)
    vnni = _vnni_products(libs[isa], int4, K, g)
    z = q.zero.float() if q.zero is not None else torch.full_like(q.scale, 8.0 if int4 else (128.0 if vnni else 0.0))
    sz = (q.scale * z).repeat_interleave(g, dim=2)  # [E, N, K]
    for j, e in enumerate(row_expert.tolist()):
        xj = x[j if x.shape[0] > 1 else 0].double()
        ref = w[e].double() @ xj
        bound = K * 2.0 ** -23 * ((w[e].double().abs() + 2 * sz[e].double()) @ xj.abs())
        if vnni:
            amax = xj.abs().view(-1, g).amax(dim=1).repeat_interleave(g)
            bound += w[e].double().abs() @ (amax * 2.0 ** -14)
        assert ((out[j].double() - ref).abs() <= bound + 1e-30).all()


def _vnni_products(lib, int4: bool, K: int, g: int) -> bool:
    """Whether wo_gemm takes its integer products (x in fixed point) for this build and shape:
    chunks of 8 (int4) or 4 columns a lane, 16 lanes with AVX-512 VNNI, 8 with AVX2 (AVX-VNNI,
    or int4 alone on plain AVX2)."""
    lanes = {"avx512_vnni": 16, "avx2_vnni": 8, "avx2": 8 if int4 else None}.get(lib.isa)
    C = lanes and (8 if int4 else 4) * lanes
    return bool(lanes) and K % C == 0 and (g % C == 0 or C % g == 0)


def _fixed_point(x: torch.Tensor, g: int) -> torch.Tensor:
    """x rounded as the VNNI products round it: per group of g columns, to the step 2^e with
    e = E - 14, max|x| < 2^E (frexp), half to even."""
    amax = x.abs().view(x.shape[0], -1, g).amax(dim=2, keepdim=True)
    step = torch.ldexp(torch.ones_like(amax), torch.frexp(amax).exponent - 14)
    step = torch.where(amax > 0, step, torch.ones_like(step))
    return (torch.round(x.view(x.shape[0], -1, g) / step) * step).view_as(x)


@pytest.mark.parametrize("isa", [i for i in ISAS if i in ("native", "native_rows1", "native_rows4", "avx2_vnni", "avx2",
                                                      "avx2_rows4")])
@pytest.mark.parametrize("name, symmetric, g, K", [
    ("int4_w4a16", True, 128, 256), ("int4_w4a16", False, 32, 256), ("int4_w4a16", True, 64, 384),
    ("int8_w8a16", True, 64, 192), ("int8_w8a16", False, 32, 128), ("int8_w8a16", True, 128, 256),
])
def test_wo_gemm_vnni_rounds_x_to_the_documented_fixed_point(libs, isa, name, symmetric, g, K, gen):
    """The VNNI products equal dequantized w @ x rounded to the fixed point (not just close to
    x @ w): within fp32 summation error of the rounded x; rows that cannot take fixed point
    (inf, nan, maxima below 2^-100) take the fp32 path in the same call, and a zero row gives 0."""
    lib = libs[isa]
    if not _vnni_products(lib, name.startswith("int4"), K, g):
        pytest.skip(f"the {lib.isa} build has no VNNI products for this shape")
    scheme = get_scheme(name, group_size=g, symmetric=symmetric)
    int4 = name.startswith("int4")
    q = quantize_weight(torch.randn(3, 37, K, generator=gen), scheme)
    w = dequantize_weight(q.q, q.scale, q.zero, scheme).double()
    x = torch.randn(6, K, generator=gen) * torch.tensor([1.0, 3e30, 1e-3, 1.0, 1e-35, 0.0])[:, None]
    x[3, 5] = float("inf")
    x[0, : g // 2] *= 1e-4  # small values beside large ones in one group
    experts = torch.tensor([0, 1, 2, 0, 1, 2])
    out = torch.full((6, 37), float("nan"))
    lib.wo_gemm(q.q, q.scale, q.zero, experts, x, out, int4=int4, group_size=g)
    z = q.zero.double() if q.zero is not None else torch.full_like(q.scale, 8.0 if int4 else 128.0).double()
    sz = (q.scale.double() * z).repeat_interleave(g, dim=2)
    for j, e in enumerate(experts.tolist()):
        xr = (_fixed_point(x[j:j + 1].double(), g)[0] if j in (0, 1, 2) else x[j].double())
        if j == 4:  # fp32 path: the zero point is the stored one
            sz_e = (q.scale.double() * (q.zero.double() if q.zero is not None else
                                        torch.full_like(q.scale, 8.0 if int4 else 0.0).double())).repeat_interleave(g, 2)[e]
        else:
            sz_e = sz[e]
        if j == 3:
            assert out[j].isnan().any() or out[j].isinf().any()
            continue
        ref = w[e] @ xr
        bound = K * 2.0 ** -23 * ((w[e].abs() + 2 * sz_e) @ xr.abs())
        assert ((out[j].double() - ref).abs() <= bound + 1e-300).all(), j
    assert torch.equal(out[5], torch.zeros(37))


@pytest.mark.parametrize("isa", ISAS)
@settings(max_examples=25, deadline=None)
@given(dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]), E=st.integers(1, 4),
       N=st.integers(1, 45), K=st.integers(1, 150), sizes=st.one_of(st.none(), segment_sizes), n=st.integers(0, 6),
       shared=st.booleans(), seed=st.integers(0, 2 ** 31 - 1))
def test_float_gemm_matches_fp64(libs, isa, dtype, E, N, K, sizes, n, shared, seed):
    """fp32 / bf16 / fp16 weights (16-bit widened exactly) against fp32 rows: within K * 2^-23
    of sum |w| |x| of the exact products."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(E, N, K, generator=g).to(dtype)
    experts, starts, row_expert = _segments(sizes, n, E, g)
    x = torch.randn(1 if shared else len(row_expert), K, generator=g)
    out = torch.full((len(row_expert), N), float("nan"))
    libs[isa].float_gemm(w, experts, x, out, starts)
    for j, e in enumerate(row_expert.tolist()):
        xj, we = x[j if x.shape[0] > 1 else 0].double(), w[e].double()
        assert ((out[j].double() - we @ xj).abs() <= K * 2.0 ** -23 * (we.abs() @ xj.abs()) + 1e-30).all()


@pytest.mark.parametrize("isa", [i for i in ISAS if i in ("native", "avx2", "avx2_rows4", "avx2_vnni")])
@settings(max_examples=25, deadline=None)
@given(dtype=st.sampled_from([torch.bfloat16, torch.float16]), E=st.integers(1, 3), N=st.integers(1, 40),
       K=st.sampled_from([16, 48, 1040, 2080]), sizes=st.lists(st.integers(0, 9), min_size=1, max_size=5),
       seed=st.integers(0, 2 ** 31 - 1))
def test_float_gemm_pair_blocks_match_fp64(libs, isa, dtype, E, N, K, sizes, seed):
    """16-bit weights past several x rows in pair blocks (AVX2 builds): every tail of weight rows
    (odd N) and of x rows (1-3 past each four), K over more than one PAIR_KC pass; within K *
    2^-23 of sum |w| |x| of the exact products."""
    lib = libs[isa]
    if not lib.pair_blocks:
        pytest.skip(f"{isa} build ({lib.isa}) has no pair blocks")
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(E, N, K, generator=g).to(dtype)
    experts, starts, row_expert = _segments(sizes, 0, E, g)
    x = torch.randn(len(row_expert), K, generator=g)
    out = torch.full((len(row_expert), N), float("nan"))
    lib.float_gemm(w, experts, x, out, starts)
    for j, e in enumerate(row_expert.tolist()):
        xj, we = x[j].double(), w[e].double()
        assert ((out[j].double() - we @ xj).abs() <= K * 2.0 ** -23 * (we.abs() @ xj.abs()) + 1e-30).all()


def test_pair_blocks_are_in_the_avx2_builds_only(libs):
    """Pair blocks are built where 16-bit weights have no native products and AVX2 has FMA and
    F16C: the AVX2 builds, not the scalar or AVX-512 ones."""
    for isa, lib in libs.items():
        assert lib.pair_blocks == (lib.isa in ("avx2", "avx2_vnni")), isa


def test_wo_gemm_bad_arguments_are_named(libs):
    lib = libs["native"]
    q = quantize_weight(torch.randn(2, 8, 64), get_scheme("int4_w4a16", group_size=32))
    experts, x, out = torch.tensor([0, 1]), torch.randn(1, 64), torch.empty(2, 8)
    with pytest.raises(TypeError, match="wants uint8 .int4. or int8 / uint8 w, fp32 scale, x and out"):
        lib.wo_gemm(q.q, q.scale, None, experts, x.bfloat16(), out, int4=True, group_size=32)
    with pytest.raises(ValueError, match="group_size must be a multiple of 32 dividing K=64, got 48"):
        lib.wo_gemm(q.q, q.scale, None, experts, x, out, int4=True, group_size=48)
    with pytest.raises(ValueError, match=r"scale \(2, 8, 1\) \(zero None\) must be \[2, 8, 2\]"):
        lib.wo_gemm(q.q, q.scale[:, :, :1].contiguous(), None, experts, x, out, int4=True, group_size=32)
    u8 = quantize_weight(torch.randn(2, 8, 64), get_scheme("int8_w8a16", group_size=32, symmetric=False))
    with pytest.raises(ValueError, match="uint8 int8 weights need their zero points"):
        lib.wo_gemm(u8.q, u8.scale, None, experts, x, out, int4=False, group_size=32)


def test_int8_gemm_bad_arguments_are_named(libs):
    lib = libs["native"]
    w = torch.zeros(2, 8, 16, dtype=torch.int8)
    x = torch.zeros(1, 16, dtype=torch.int8)
    out = torch.empty(2, 8, dtype=torch.int32)
    experts = torch.tensor([0, 1])
    with pytest.raises(TypeError, match=r"wants int8 w, int8 or fp32 x, int32 out \(fp32 with w_scale\); got torch.int8, "
                                        "torch.float64"):
        lib.int8_gemm(w, experts, x.double(), out)
    with pytest.raises(ValueError, match="with fp32 x wants scales: a contiguous fp32 tensor of 1 values, got None"):
        lib.int8_gemm(w, experts, x.float(), out)
    with pytest.raises(ValueError, match=r"w_scale must be a contiguous fp32 \[2, 8\] with fp32 x"):
        lib.int8_gemm(w, experts, x, out.float(), w_scale=torch.ones(2, 8))
    with pytest.raises(TypeError, match="wants int64 experts and starts, got torch.int32"):
        lib.int8_gemm(w, experts.int(), x, out)
    with pytest.raises(ValueError, match="contiguous"):
        lib.int8_gemm(w.transpose(1, 2).contiguous().transpose(1, 2), experts, x, out)
    with pytest.raises(ValueError, match="contiguous"):  # one x row, but strided along K
        lib.int8_gemm(w, experts, torch.zeros(16, 2, dtype=torch.int8)[:, :1].t(), out)
    with pytest.raises(TypeError, match="int32 out"):  # the type is checked before anything is written
        lib.int8_gemm(w, torch.zeros(0, dtype=torch.long), x, torch.empty(0, 8, dtype=torch.int16))
    with pytest.raises(ValueError, match=r"w \(2, 8, 16\), 2 experts, no starts, x \(1, 15\), out \(2, 8\) do not"):
        lib.int8_gemm(w, experts, x[:, :15].contiguous(), out)
    with pytest.raises(ValueError, match="do not fit"):
        lib.int8_gemm(w, experts, torch.zeros(3, 16, dtype=torch.int8), out)
    with pytest.raises(ValueError, match=r"experts must lie in \[0, 2\), got \[0, 2\]"):
        lib.int8_gemm(w, torch.tensor([0, 2]), x, out)
    with pytest.raises(ValueError, match=r"starts must rise from 0 to the 2 rows of out, got \[0, 3, 2\]"):
        lib.int8_gemm(w, experts, x, out, torch.tensor([0, 3, 2]))
    with pytest.raises(ValueError, match=r"starts \(2,\)"):
        lib.int8_gemm(w, experts, x, out, torch.tensor([0, 2]))


def test_builds_report_their_instruction_set_and_reuse_the_cache(libs, tmp_path):
    assert libs["scalar"].isa == "scalar" and libs["scalar"].openmp
    if "avx2" in libs:
        assert libs["avx2"].isa == libs["avx2_rows4"].isa == "avx2"
    for isa in ("avx2_vnni", "avx512"):
        if isa in libs:
            assert libs[isa].isa == isa
    if "native_rows1" in libs:
        assert libs["native_rows1"].isa == libs["native_rows4"].isa == libs["native"].isa
    again = native.build("native", cache_dir=libs["native"].path.parent)
    assert again.path == libs["native"].path and again.isa == libs["native"].isa
    with pytest.raises(ValueError, match=r"isa must be one of \['avx2', 'avx2_rows4', 'avx2_vnni', 'avx512', 'native', 'native_rows1', 'native_rows4', "
                       r"'scalar'\], got 'sse'"):
        native.build("sse", cache_dir=tmp_path)


def test_missing_compiler_and_switch_off_give_reasons(monkeypatch, tmp_path):
    monkeypatch.setattr(native, "_compiler", lambda: None)
    with pytest.raises(RuntimeError, match="no C compiler found"):
        native.build("native", cache_dir=tmp_path)
    monkeypatch.setenv("MOEKIT_NATIVE", "0")
    native.reset()
    try:
        assert native.load() is None
        assert native.status() == "unavailable: turned off by MOEKIT_NATIVE=0"
    finally:
        native.reset()


def test_compiler_errors_are_reported(monkeypatch, tmp_path):
    bad = tmp_path / "broken.c"
    bad.write_text("this is not C\n")
    monkeypatch.setattr(native, "SOURCE", bad)
    with pytest.raises(RuntimeError, match="failed to compile broken.c"):
        native.build("native", cache_dir=tmp_path)
    assert not list(tmp_path.glob("*.so"))  # no half-written library left behind


def _routed_call(T, H, E, k, on_input, use_map, dtype, gen):
    """x [T, H] of dtype, random top-k ids (through a random expert map when use_map), weights,
    and the apply() keywords (SiLU)."""
    emap = random_expert_map(E, E if use_map else 0, gen)
    E_ids = E if emap is None else emap.numel()
    x = torch.randn(T, H, generator=gen).to(dtype)
    ids = torch.rand(T, E_ids, generator=gen).argsort(1)[:, :k].to(torch.int32)
    kw = dict(activation="silu", activation_params=ActivationParams(), apply_router_weight_on_input=on_input,
              expert_map=emap)
    return x, ids, torch.rand(T, k, generator=gen), kw


def test_cpu_int8_native_rows_by_amx_and_isa(monkeypatch):
    """Sorted cpu_int8 calls: the native products up to NATIVE_ROWS_BY_ISA rows an expert where
    torch._int_mm has AMX tiles, every call without them."""
    from moekit.experts import cpu_int8

    monkeypatch.setattr(cpu_int8, "cpu_flags", lambda: frozenset({"avx512_vnni", "amx_int8"}))
    assert cpu_int8.native_rows("avx512_vnni") == cpu_int8.NATIVE_ROWS_VNNI
    assert cpu_int8.native_rows("avx512") == cpu_int8.NATIVE_ROWS
    monkeypatch.setattr(cpu_int8, "cpu_flags", lambda: frozenset({"avx512_vnni"}))
    assert cpu_int8.native_rows("avx512_vnni") == cpu_int8.native_rows("avx512") == float("inf")


@pytest.mark.parametrize("T, k, on_input, bias, use_map", [
    (1, 8, False, False, False), (2, 8, False, True, False), (3, 2, True, False, False),
    (4, 4, False, True, True), (1, 1, False, False, False),
    (6, 4, False, True, False), (9, 3, True, False, True),  # sorted, a few rows an expert: native
    (40, 4, False, False, False),  # sorted, 10 rows an expert: native on AVX-512 VNNI or without AMX
])
def test_cpu_int8_is_identical_with_and_without_native_products(T, k, on_input, bias, use_map, gen):
    """Decode and sorted calls: the same exact int32 products either way, rescaled in the same
    order, so the same output bits; and the reference's bound."""
    if native.load() is None:
        pytest.skip(f"native kernels: {native.status()}")
    E, H, I = 16, 96, 48  # H, I not multiples of the vector width
    extra = dict(b13=torch.randn(E, 2 * I, generator=gen), b2=torch.randn(E, H, generator=gen)) if bias else {}
    w = quantize_experts(torch.randn(E, 2 * I, H, generator=gen) * H ** -0.5,
                         torch.randn(E, H, I, generator=gen) * I ** -0.5, "int8_w8a8", **extra)
    x, ids, tw, kw = _routed_call(T, H, E, k, on_input, use_map, torch.bfloat16, gen)
    fast, plain, fused = CPUInt8Backend(), CPUInt8Backend(), CPUInt8Backend()
    plain.native_products = False
    fast.native_decode = False  # one native call a GEMM: the torch path's operations, the same bits
    a = fast.apply(x, w, tw, ids, **kw)
    b = plain.apply(x, w, tw, ids, **kw)
    assert torch.equal(a, b)
    ref = BACKENDS["reference"].apply(x, w, tw, ids, **kw)
    # against the emulation (fp32 sums of dequantized products, not exact int32 ones) a GEMM2
    # input now and then rounds to the neighbouring int8 step: up to 2e-4 seen over 400 seeds
    assert rel_err(a, ref) <= 1e-3
    # decode through the fused call: its activation may differ from torch's in the last bit (and
    # so, rarely, a quantized GEMM2 input by one step)
    assert rel_err(fused.apply(x, w, tw, ids, **kw), ref) <= 1e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("T, k, on_input, bias, use_map", [
    (1, 4, False, True, False), (3, 4, True, False, True),  # decode
    (6, 4, False, True, True), (7, 2, True, True, False),   # sorted, about one row an expert
])
def test_cpu_backend_with_and_without_native_products(dtype, T, k, on_input, bias, use_map, gen):
    """The `cpu` backend's native paths (fp32 accumulation) and torch's against the reference."""
    from conftest import TOL
    from moekit.experts.base import ExpertWeights
    from moekit.experts.cpu import CPUBackend

    if native.load() is None:
        pytest.skip(f"native kernels: {native.status()}")
    E, H, I = 16, 72, 40  # rows and K not multiples of the vector width
    w = ExpertWeights((torch.randn(E, 2 * I, H, generator=gen) * H ** -0.5).to(dtype),
                      (torch.randn(E, H, I, generator=gen) * I ** -0.5).to(dtype),
                      torch.randn(E, 2 * I, generator=gen).to(dtype) if bias else None,
                      torch.randn(E, H, generator=gen).to(dtype) if bias else None)
    x, ids, tw, kw = _routed_call(T, H, E, k, on_input, use_map, dtype, gen)
    fast, plain, per_gemm = CPUBackend(), CPUBackend(), CPUBackend()
    plain.native_products = False
    per_gemm.native_decode = False  # decode: one native call a GEMM instead of the fused FFN
    ref = BACKENDS["reference"].apply(x, w, tw, ids, **kw)
    for backend in (fast, plain, per_gemm):
        assert rel_err(backend.apply(x, w, tw, ids, **kw), ref) <= TOL[dtype]


def test_cpu_backend_keeps_torch_paths_when_a_gradient_is_needed(gen):
    from moekit.experts.base import ExpertWeights
    from moekit.experts.cpu import CPUBackend

    w = ExpertWeights(torch.randn(4, 32, 16, generator=gen), torch.randn(4, 16, 16, generator=gen))
    x = torch.randn(2, 16, generator=gen, requires_grad=True)
    ids, tw = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32), torch.rand(2, 2, generator=gen)
    assert CPUBackend()._native_library(x, w, tw) is None
    out = CPUBackend().apply(x, w, tw, ids, activation="silu", activation_params=ActivationParams(),
                             apply_router_weight_on_input=False, expert_map=None)
    out.sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0
    with torch.no_grad():
        assert CPUBackend()._native_library(x, w, tw) is native.load()


@pytest.mark.parametrize("isa", ISAS)
def test_every_fp16_value_widens_exactly(libs, isa):
    """All 65536 fp16 bit patterns (subnormals, infinities, NaNs) times 1.0, against torch's widening."""
    w = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.float16).view(1, -1, 1).contiguous()
    out = torch.empty(1, w.shape[1])
    libs[isa].float_gemm(w, torch.tensor([0]), torch.ones(1, 1), out)
    expected = w.view(1, -1).float()
    nan = expected.isnan()
    assert torch.equal(out.isnan(), nan) and torch.equal(out[~nan], expected[~nan])


def _check_round_robin_bf16(backend, E, H, I, T, k, gen, dtype=torch.bfloat16):
    """16-bit experts and x (bf16 unless dtype says), assignments dealt round-robin (T k / E rows
    an expert), SiLU: the backend's output within 1e-2 of `reference`'s."""
    from moekit.experts.base import ExpertWeights

    w = ExpertWeights(torch.randn(E, 2 * I, H, generator=gen).to(dtype), torch.randn(E, H, I, generator=gen).to(dtype))
    x = torch.randn(T, H, generator=gen).to(dtype)
    ids = torch.arange(T * k, dtype=torch.int32).view(T, k) % E
    tw = torch.rand(T, k, generator=gen)
    kw = dict(activation="silu", activation_params=ActivationParams(), apply_router_weight_on_input=False,
              expert_map=None)
    out = backend.apply(x, w, tw, ids, **kw)
    assert rel_err(out, BACKENDS["reference"].apply(x, w, tw, ids, **kw)) <= 1e-2


@pytest.mark.parametrize("emulated, expected", [(False, False), (True, True)])
def test_cpu_backend_rows_limit_depends_on_native_bf16(monkeypatch, emulated, expected, gen):
    """8 rows an expert of bf16: torch's products where bf16 is native, the native kernel where
    it is emulated (NATIVE_ROWS / NATIVE_ROWS_EMULATED)."""
    from moekit.experts import cpu

    if native.load() is None:
        pytest.skip(f"native kernels: {native.status()}")
    monkeypatch.setattr(cpu, "native_dtypes", lambda: frozenset({torch.float32} if emulated else
                                                                  {torch.float32, torch.bfloat16}))
    calls = []
    real = cpu.CPUBackend._native_sorted
    monkeypatch.setattr(cpu.CPUBackend, "_native_sorted", staticmethod(lambda *a: calls.append(1) or real(*a)))
    _check_round_robin_bf16(cpu.CPUBackend(), 4, 64, 32, 16, 2, gen)  # 8 rows an expert
    assert bool(calls) is expected


@pytest.mark.parametrize("amx", [False, True])
@pytest.mark.parametrize("rows", [2, 4, 8])
@pytest.mark.parametrize("activation", ["silu", "relu2_no_mul"])
def test_cpu_backend_bf16_without_amx_rows_rules(monkeypatch, amx, rows, activation, gen):
    """bf16 weights where bf16 is native: without AMX the fp32-row native kernel up to
    NATIVE_ROWS_BF16_NO_AMX rows an expert and the vdpbf16ps kernels above it (torch's grouped
    GEMM where the build has none); with AMX the native kernel up to NATIVE_ROWS[bf16] and the
    per-expert loop above it."""
    from moekit.experts import cpu
    from moekit.experts.base import ExpertWeights

    if native.load() is None:
        pytest.skip(f"native kernels: {native.status()}")
    monkeypatch.setattr(cpu, "native_dtypes", lambda: frozenset({torch.float32, torch.bfloat16}))
    monkeypatch.setattr(cpu, "bf16_without_amx", lambda: not amx)
    calls = []
    for name in ("_native_sorted", "_expert"):
        real = getattr(cpu.CPUBackend, name)
        monkeypatch.setattr(cpu.CPUBackend, name, staticmethod(lambda *a, _n=name, _r=real: calls.append(_n) or _r(*a)))
    real_bf16 = cpu.bf16_sorted
    monkeypatch.setattr(cpu, "bf16_sorted", lambda *a: calls.append("bf16_sorted") or real_bf16(*a))
    real_grouped = cpu._GROUPED.apply
    monkeypatch.setattr(cpu._GROUPED, "apply", lambda *a, **kw: calls.append("grouped") or real_grouped(*a, **kw))
    E, H, I, k = 16, 64, 32, 2
    T = rows * E // k  # past DIRECT_ASSIGNMENTS
    w = ExpertWeights(torch.randn(E, 2 * I, H, generator=gen).bfloat16(), torch.randn(E, H, I, generator=gen).bfloat16())
    x = torch.randn(T, H, generator=gen).bfloat16()
    ids = torch.arange(T * k, dtype=torch.int32).view(T, k) % E
    tw = torch.rand(T, k, generator=gen)
    kw = dict(activation=activation, activation_params=ActivationParams(), apply_router_weight_on_input=False,
              expert_map=None)
    if activation == "relu2_no_mul":
        w = ExpertWeights(w.w13[:, :I].contiguous(), w.w2)
    out = cpu.CPUBackend().apply(x, w, tw, ids, **kw)
    limit = cpu.NATIVE_ROWS[torch.bfloat16] if amx else cpu.NATIVE_ROWS_BF16_NO_AMX
    expected = "_native_sorted" if rows <= limit else (
        "_expert" if amx else ("bf16_sorted" if native.load().bf16_dot else "grouped"))
    assert set(calls) == {expected}
    assert rel_err(out, BACKENDS["reference"].apply(x, w, tw, ids, **kw)) <= 1e-2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("pairs", [False, True])
def test_cpu_backend_emulated_16bit_takes_pair_blocks_at_any_rows(monkeypatch, pairs, dtype, gen):
    """Where bf16 and fp16 are emulated, a build with pair blocks takes sorted 16-bit calls of
    any rows an expert (40 here) on the native kernel; without them the blocked fp32 path runs
    past NATIVE_ROWS_EMULATED."""
    from moekit.experts import cpu

    lib = native.load()
    if lib is None:
        pytest.skip(f"native kernels: {native.status()}")
    monkeypatch.setattr(cpu, "native_dtypes", lambda: frozenset({torch.float32}))
    monkeypatch.setattr(type(lib), "pair_blocks", property(lambda self: pairs))
    calls = []
    for name in ("_native_sorted", "_expert"):
        real = getattr(cpu.CPUBackend, name)
        monkeypatch.setattr(cpu.CPUBackend, name,
                            staticmethod(lambda *a, _n=name, _f=real: calls.append(_n) or _f(*a)))
    _check_round_robin_bf16(cpu.CPUBackend(), 4, 64, 48, 80, 2, gen, dtype)  # 40 rows an expert
    assert set(calls) == ({"_native_sorted"} if pairs else {"_expert"})


def test_cpu_backend_skewed_routing_falls_back_on_the_sorted_rows(monkeypatch, gen):
    """Few tokens whose assignments crowd two experts: past the native rows limit once sorted,
    so the torch products run on the rows sorted for the native kernel (no second sort)."""
    from moekit.experts import cpu
    from moekit.experts.base import ExpertWeights

    if native.load() is None:
        pytest.skip(f"native kernels: {native.status()}")
    sorts = []
    real = cpu.sort_rows
    monkeypatch.setattr(cpu, "sort_rows", lambda *a: sorts.append(a[-1]) or real(*a))
    E, H, I, T, k = 16, 64, 32, 10, 2
    w = ExpertWeights(torch.randn(E, 2 * I, H, generator=gen).bfloat16(), torch.randn(E, H, I, generator=gen).bfloat16())
    x = torch.randn(T, H, generator=gen).bfloat16()
    ids = torch.tensor([[3, 7]] * T, dtype=torch.int32)  # 10 rows each for experts 3 and 7
    tw = torch.rand(T, k, generator=gen)
    kw = dict(activation="silu", activation_params=ActivationParams(), apply_router_weight_on_input=True,
              expert_map=None)
    out = cpu.CPUBackend().apply(x, w, tw, ids, **kw)
    assert sorts == [torch.float32]
    assert rel_err(out, BACKENDS["reference"].apply(x, w, tw, ids, **kw)) <= 1e-2


# ---- decode: each token's whole FFN in one parallel region -----------------------------------

def _ffn_float64(w13, w2, ids, tw, x, activation, on_input, b13=None, b2=None, params=None, emap=None):
    """[T, H] float64 from float weights around torch's activation (in fp32, as the kernel computes it)."""
    from moekit.activations import apply_activation

    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float64)
    for t in range(x.shape[0]):
        for j, e in enumerate(ids[t].tolist()):
            e = e if emap is None else int(emap[e])
            if e < 0:
                continue
            xj = x[t].double() * float(tw[t, j]) if on_input else x[t].double()
            h = w13[e].double() @ xj + (0 if b13 is None else b13[e].double())
            a = apply_activation(h.float()[None], activation, params)[0].double()
            y = w2[e].double() @ a + (0 if b2 is None else b2[e].double())
            out[t] += y if on_input else float(tw[t, j]) * y
    return out


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("activation", list(native.ACTIVATION_CODES))
@pytest.mark.parametrize("on_input, bias, use_map", [(False, False, False), (True, True, True)])
def test_decode_float_weights_match_float64(libs, isa, activation, on_input, bias, use_map, gen):
    """fp32 weights, every activation: the fused FFN against float64 GEMMs around torch's
    activation, within fp32 rounding; odd sizes, repeated experts, three tokens (with a map,
    the last one's experts all elsewhere: zeros)."""
    from moekit.activations import is_gated

    E, H, I, k = 5, 37, 19, 4
    N1 = 2 * I if is_gated(activation) else I
    w13, w2 = torch.randn(E, N1, H, generator=gen) * H ** -0.5, torch.randn(E, H, I, generator=gen) * I ** -0.5
    emap = torch.tensor([3, -1, 0, 4, 1, 2, -1], dtype=torch.int32) if use_map else None
    ids = (torch.tensor([[0, 5, 0, 3], [2, 4, 6, 0], [1, 6, 1, 6]]) if use_map
           else torch.tensor([[3, 0, 3, 4], [1, 2, 0, 4], [2, 2, 1, 0]])).to(torch.int32)
    tw, x = torch.rand(3, k, generator=gen), torch.randn(3, H, generator=gen) * 2
    b13 = torch.randn(E, N1, generator=gen) if bias else None
    b2 = torch.randn(E, H, generator=gen) if bias else None
    params = ActivationParams(alpha=1.5, limit=1.0)  # a limit the values cross
    out = torch.full((3, H), float("nan"))
    libs[isa].decode(native.projection(w13, "float"), native.projection(w2, "float"), ids, tw, x, out,
                     activation=activation, alpha=params.alpha, limit=params.limit, on_input=on_input,
                     expert_map=emap, b13=b13, b2=b2)
    ref = _ffn_float64(w13, w2, ids, tw, x, activation, on_input, b13, b2, params, emap)
    assert rel_err(out, ref) <= 1e-5
    if use_map:
        assert torch.equal(out[2], torch.zeros(H))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("name, opts, kind", [
    ("int8_w8a8", {}, "int8_w8a8"), ("int4_w4a16", {}, "int4"),
    ("int4_w4a16", dict(group_size=32, symmetric=False), "int4"), ("int8_w8a16", dict(group_size=64), "int8"),
    ("int8_w8a16", dict(group_size=32, symmetric=False), "int8"),
])
def test_decode_quantized_weights_match_the_per_gemm_products(libs, isa, name, opts, kind, gen):
    """Quantized projections: the fused call against the same library's per-GEMM products with
    torch's activation between them (the unfused decode path): the same GEMM kernels, so only
    the activation's last bits differ. Both paths quantize GEMM2's input: int8 W8A8 per row, the
    weight-only integer products to fixed point with a step of 2^-14 of each group's largest
    value (cpu_kernels.c, XBITS). The activation's last bit moves a value across a step now and
    then (over 300 seeds: 0 for most, at most 3e-5 in 0.3-0.7 % of the draws, by build and
    scheme), so the bound is one such step's reach, not fp32 rounding."""
    from moekit.activations import apply_activation

    g = get_scheme(name, **opts).group_size if name != "int8_w8a8" else 0
    E, H, I, n = 6, 256, 128, 5
    w = quantize_experts(torch.randn(E, 2 * I, H, generator=gen) * H ** -0.5,
                         torch.randn(E, H, I, generator=gen) * I ** -0.5, name, **opts)
    lib, s = libs[isa], w.scales
    p13, p2 = (native.projection(getattr(w, p), kind, scale=s[f"{p}_scale"], zero=s.get(f"{p}_zero"), group_size=g)
               for p in ("w13", "w2"))
    experts, sw, x = torch.tensor([5, 1, 1, 0, 2]), torch.rand(n, generator=gen), torch.randn(H, generator=gen)
    out = torch.full((1, H), float("nan"))
    lib.decode(p13, p2, experts[None], sw[None], x[None], out, activation="silu")

    def gemm(rows, wname):
        res = torch.empty(n, getattr(w, wname).shape[1])
        if kind == "int8_w8a8":
            return lib.int8_gemm(getattr(w, wname), experts, rows, res, scales=torch.empty(rows.shape[0], 1),
                                 w_scale=s[f"{wname}_scale"])
        return lib.wo_gemm(getattr(w, wname), s[f"{wname}_scale"], s.get(f"{wname}_zero"), experts, rows, res,
                           int4=kind == "int4", group_size=g)

    expected = sw @ gemm(apply_activation(gemm(x[None], "w13"), "silu").contiguous(), "w2")
    assert rel_err(out[0], expected) <= (2e-3 if kind == "int8_w8a8" else 2.0 ** -12)


def test_decode_propagates_nan_and_checks_its_arguments(libs, gen):
    lib = libs["native"]
    w13, w2 = torch.randn(3, 16, 8, generator=gen), torch.randn(3, 8, 8, generator=gen)
    p13, p2 = native.projection(w13, "float"), native.projection(w2, "float")
    ids, tw, x, out = torch.tensor([[0, 2]]), torch.rand(1, 2, generator=gen), torch.randn(1, 8, generator=gen), torch.empty(1, 8)
    x[0, 3] = float("nan")
    for activation in ("silu", "swigluoai", "gelu"):
        lib.decode(p13, p2, ids, tw, x, out, activation=activation)
        assert out.isnan().all()
    x[0, 3] = 0.0
    with pytest.raises(ValueError, match="activation must be one of"):
        lib.decode(p13, p2, ids, tw, x, out, activation="tanh")
    with pytest.raises(ValueError, match=r"topk_ids must lie in \[0, 3\)"):
        lib.decode(p13, p2, torch.tensor([[0, 3]]), tw, x, out, activation="silu", trusted=True)
    with pytest.raises(ValueError, match=r"topk_ids must lie in \[0, 2\) and the expert_map in \[-1, 3\)"):
        lib.decode(p13, p2, ids, tw, x, out, activation="silu", expert_map=torch.tensor([0, 3]))
    with pytest.raises(TypeError, match="wants int32 / int64 topk_ids and expert_map, fp32 topk_weights"):
        lib.decode(p13, p2, ids, tw.double(), x, out, activation="silu")
    with pytest.raises(ValueError, match="do not fit E=3 .p2: 3., H=8, N1=16"):
        lib.decode(p13, p2, ids, tw, x[:, :7], out, activation="silu")
    with pytest.raises(ValueError, match="do not fit E=3"):
        lib.decode(p13, p2, ids, tw, x, out, activation="silu", b13=torch.zeros(3, 8))
    with pytest.raises(ValueError, match=r"p13 \[N1=16, H=8\] and p2 \[H=8, I=8\] do not fit 'silu_no_mul'"):
        lib.decode(p13, p2, ids, tw, x, out, activation="silu_no_mul")
    assert lib.decode(p13, p2, ids[:0], tw[:0], x[:0], out[:0], activation="silu").shape == (0, 8)
    with pytest.raises(ValueError, match="kind must be one of"):
        native.projection(w13, "fp8")
    with pytest.raises(TypeError, match="a float projection wants fp32 / bf16 / fp16 w and no scales"):
        native.projection(w13.to(torch.int8), "float")
    q = quantize_weight(torch.randn(2, 8, 64, generator=gen), get_scheme("int4_w4a16", group_size=32))
    with pytest.raises(ValueError, match="wants g a multiple of 32 dividing K=64"):
        native.projection(q.q, "int4", scale=q.scale, group_size=64)
    with pytest.raises(TypeError, match="an fp32 scale"):
        native.projection(q.q, "int4", group_size=32)


def test_native_decode_projections_are_kept_per_weights_and_rebuilt_for_copies(gen):
    """common.native_decode builds the projections once while the weights live; a copy (new
    tensors, new addresses) gets its own, and pickling the weights carries nothing derived."""
    import copy
    import gc
    import pickle

    from moekit.experts import base
    from moekit.experts.common import native_decode

    if native.load() is None:
        pytest.skip(f"native kernels: {native.status()}")
    w = quantize_experts(torch.randn(4, 64, 32, generator=gen), torch.randn(4, 32, 32, generator=gen), "int8_w8a8")
    lib = native.load()
    first = native_decode(lib, w, "int8_w8a8")
    assert native_decode(lib, w, "int8_w8a8") is first
    dup = copy.deepcopy(w)
    other = native_decode(lib, dup, "int8_w8a8")
    assert other is not first and other[1].struct.w == dup.w13.data_ptr() != first[1].struct.w
    assert pickle.loads(pickle.dumps(w)).w13.equal(w.w13)
    calls = []
    assert base.cached_for(w, "test", (1, "a", w.w13), lambda: calls.append(1) or len(calls)) == 1
    assert base.cached_for(w, "test", (1, "a", w.w13), lambda: calls.append(1) or len(calls)) == 1
    assert base.cached_for(w, "test", (2, "a", w.w13), lambda: calls.append(1) or len(calls)) == 2
    assert base.cached_for(w, "test", (2, "a", w.w2), lambda: calls.append(1) or len(calls)) == 3
    key = id(dup)
    del dup, other
    gc.collect()
    assert key not in base._DERIVED
    # bf16 biases are kept as fp32 copies: an in-place change (a checkpoint loaded into the
    # tensors) makes new ones
    from moekit.experts.base import ExpertWeights
    wb = ExpertWeights(torch.randn(4, 64, 32, generator=gen), torch.randn(4, 32, 32, generator=gen),
                       torch.zeros(4, 64, dtype=torch.bfloat16), torch.zeros(4, 32, dtype=torch.bfloat16))
    assert native_decode(lib, wb, "float")[3].abs().sum() == 0
    wb.b13.add_(1.0)
    assert torch.equal(native_decode(lib, wb, "float")[3], torch.ones(4, 64))


def _bf16_lib(libs, isa):
    lib = libs[isa]
    if not lib.bf16_dot:
        pytest.skip(f"the {isa} build has no AVX-512 BF16 products")
    return lib


def _bf16_case(gen, E, N, K, sizes, shared_x=False):
    w = (torch.randn(E, N, K, generator=gen) * K ** -0.5).bfloat16()
    experts, starts, _ = _segments(sizes, None, E, gen)
    R = sum(sizes)
    x = torch.randn(1 if shared_x else R, K, generator=gen).bfloat16()
    return w, experts, starts, x, R


def _bf16_products(w, experts, starts, x, R):
    """fp64 products of the segments (and the sums of their magnitudes, for the fp32 bound)."""
    out, mag = torch.zeros(R, w.shape[1], dtype=torch.float64), torch.zeros(R, w.shape[1], dtype=torch.float64)
    xx = x.double().expand(R, -1) if x.shape[0] == 1 else x.double()
    for s, e in enumerate(experts.tolist()):
        a, b = int(starts[s]), int(starts[s + 1])
        out[a:b] = xx[a:b] @ w[e].double().t()
        mag[a:b] = xx[a:b].abs() @ w[e].double().abs().t()
    return out, mag


@pytest.mark.parametrize("isa", [i for i in ISAS if i.startswith("native")])
@pytest.mark.parametrize("E, N, K, sizes, shared_x", [
    (3, 37, 45, [0, 1, 5, 9], False), (2, 64, 1024, [4, 7], False), (4, 19, 2100, [3, 0, 12, 1], False),
    (1, 5, 31, [1], False), (3, 8, 64, [6, 2, 0], True), (2, 16, 33, [0, 0], False),
])
def test_bf16_gemm_matches_fp64_products(libs, isa, E, N, K, sizes, shared_x, gen):
    """bf16_gemm (vdpbf16ps): each output the fp32 sum of exact bf16 products, so within fp32
    summation error of the fp64 products; K past one pass (2100 > BF16_KC) and K % 32 tails,
    segments of 0 and 1 rows, one x row shared by all."""
    lib = _bf16_lib(libs, isa)
    w, experts, starts, x, R = _bf16_case(gen, E, N, K, sizes, shared_x)
    out = torch.full((R, N), float("nan"))
    lib.bf16_gemm(w, experts, x, out, starts)
    ref, mag = _bf16_products(w, experts, starts, x, R)
    assert ((out.double() - ref).abs() <= 1e-5 * mag + 1e-30).all()


@pytest.mark.parametrize("isa", [i for i in ISAS if i.startswith("native")])
@pytest.mark.parametrize("activation", ["silu", "gelu", "gelu_tanh", "swigluoai"])
@pytest.mark.parametrize("E, I, K, sizes, bias", [
    (3, 37, 45, [0, 1, 5, 9], True), (2, 64, 1024, [4, 7], False), (4, 21, 2100, [3, 0, 12, 1], True),
    (1, 1, 32, [2], False),
])
def test_bf16_gate_up_is_the_activation_of_the_products_rounded_to_bf16(libs, isa, activation, E, I, K, sizes,
                                                                        bias, gen):
    """bf16_gate_up: bf16(act(W13 x + b13)) with the products summed in fp32: within one bf16
    rounding (2^-8 relative) of the activation of the fp64 products, for every gated activation
    (silu and swigluoai on a vector exp, the others on libm's); gate and up rows of I columns
    (I not a multiple of 16), K past one pass."""
    lib = _bf16_lib(libs, isa)
    w, experts, starts, x, R = _bf16_case(gen, E, 2 * I, K, sizes)
    w = w * 4  # pre-activations of a few units, into the nonlinear range
    b13 = torch.randn(E, 2 * I, generator=gen) if bias else None
    out = torch.full((R, I), float("nan"), dtype=torch.bfloat16)
    lib.bf16_gate_up(w, experts, x, out, starts, activation=activation, b13=b13)
    h, mag = _bf16_products(w, experts, starts, x, R)
    if bias:
        for s, e in enumerate(experts.tolist()):
            h[int(starts[s]):int(starts[s + 1])] += b13[e].double()
    ref = apply_activation(h, activation, ActivationParams())
    # the fp32 sums move h by 1e-5 mag at most; the activations' slopes stay below ~1.2 |u| + |g| there
    slack = 1e-5 * (mag[:, :I] * (h[:, I:].abs() + 1) + mag[:, I:] * (h[:, :I].abs() + 1)) * 2
    assert ((out.double() - ref).abs() <= 2 ** -8 * ref.abs() + slack + 1e-30).all()


def test_bf16_gate_up_exp_over_the_float_range_and_specials(libs):
    """The vector silu / swigluoai over pre-activations from -200 to 200 and inf / NaN (set
    through the gate biases, with zero weights): as torch's within one bf16 rounding,
    infinities and NaN where torch has them."""
    lib = _bf16_lib(libs, "native")
    g = torch.cat([torch.linspace(-200, 200, 397), torch.tensor([float("inf"), -float("inf"), float("nan")])])
    I, K = g.shape[0], 32
    w, x = torch.zeros(1, 2 * I, K, dtype=torch.bfloat16), torch.zeros(1, K, dtype=torch.bfloat16)
    b13 = torch.cat([g, torch.full((I,), 1.5)])[None]
    experts, starts = torch.zeros(1, dtype=torch.int64), torch.tensor([0, 1])
    for activation in ("silu", "swigluoai"):
        out = torch.empty(1, I, dtype=torch.bfloat16)
        lib.bf16_gate_up(w, experts, x, out, starts, activation=activation, b13=b13)
        ref = apply_activation(b13, activation, ActivationParams())[0]
        got = out[0].float()
        assert torch.equal(got.isnan(), ref.isnan()), activation
        inf = ref.isinf()
        assert torch.equal(got[inf], ref[inf]), activation
        fin = ref.isfinite()
        assert ((got[fin] - ref[fin]).abs() <= 2 ** -8 * ref[fin].abs() + 1e-30).all(), activation


def test_bf16_kernels_refuse_what_they_cannot_run(libs, gen):
    lib = _bf16_lib(libs, "native")
    w = torch.randn(2, 8, 32).bfloat16()
    experts, starts, x = torch.tensor([0, 1]), torch.tensor([0, 2, 3]), torch.randn(3, 32).bfloat16()
    with pytest.raises(ValueError, match="bf16_gate_up wants a gated activation"):
        lib.bf16_gate_up(w, experts, x, torch.empty(3, 4, dtype=torch.bfloat16), starts, activation="relu2_no_mul")
    with pytest.raises(TypeError, match="bf16_gemm wants bf16 x and fp32 out"):
        lib.bf16_gemm(w, experts, x.float(), torch.empty(3, 8), starts)
    with pytest.raises(TypeError, match="bf16_gemm wants bf16 w, or weight-only w with its scale"):
        lib.bf16_gemm(w.float(), experts, x, torch.empty(3, 8), starts)
    with pytest.raises(ValueError, match="bf16_gemm: group_size must be a multiple of 32"):
        lib.bf16_gemm(torch.zeros(2, 8, 16, dtype=torch.uint8), experts, x, torch.empty(3, 8), starts,
                      scale=torch.ones(2, 8, 1), int4=True, group_size=16)
    with pytest.raises(ValueError, match=r"b13 None or \[E, 2I\] fp32"):
        lib.bf16_gate_up(w, experts, x, torch.empty(3, 4, dtype=torch.bfloat16), starts, activation="silu",
                         b13=torch.zeros(2, 4))
    with pytest.raises(ValueError, match="do not fit together"):
        lib.bf16_gate_up(w, experts, x, torch.empty(3, 8, dtype=torch.bfloat16), starts, activation="silu")
    other = next((lib for isa, lib in libs.items() if not lib.bf16_dot), None)
    if other is not None:
        with pytest.raises(RuntimeError, match="needs AVX-512 BF16"):
            other.bf16_gemm(w, experts, x, torch.empty(3, 8), starts)

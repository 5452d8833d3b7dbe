"""The quantized Triton experts on a CUDA GPU against the emulated reference (PERF.md tolerances),
CUDA-graph capture, determinism and the oracle's choice. Run with `pytest -m gpu tests/kernels`."""

import pytest
import torch

from conftest import rel_err, random_expert_map, triton_act_dtype

pytest.importorskip("triton")

from moekit import FusedMoE, RoutingConfig, fused_experts  # noqa: E402
from moekit.config import settings  # noqa: E402
from moekit.experts.api import problem_of  # noqa: E402
from moekit.oracle import choose_backend  # noqa: E402
from moekit.quant import TOLERANCE, emulated_experts, get_scheme, quantize_experts  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(settings.triton_interpret, reason="TRITON_INTERPRET=1 is set")]

SCHEMES = [
    ("fp8_w8a8", {}),
    ("fp8_w8a8", {"static": True}),          # one scale shared by the experts: x quantized once per token
    ("fp8_w8a8", {"static": "per_expert"}),  # a scale per expert: a row per assignment
    ("fp8_w8a8_channel", {}),
    ("fp8_w8a8_block128", {}),
    ("int8_w8a8", {}),
    ("int8_w8a16", {}),
    ("int8_w8a16", {"group_size": 64, "symmetric": False}),
    ("int4_w4a16", {}),
    ("int4_w4a16", {"group_size": 32}),
    ("int4_w4a16", {"group_size": 64, "symmetric": False}),
]
IDS = [f"{s}-{'-'.join(f'{k}={v}' for k, v in o.items()) or 'default'}" for s, o in SCHEMES]


def _poison_allocator():
    """Leave NaN in the caching allocator's free memory so an unwritten output element shows."""
    torch.empty(256 * 2**20 // 4, device="cuda").fill_(float("nan"))


def _weights(scheme, opts, E, H, I, gen, bias=False, dtype=torch.bfloat16):
    w13 = torch.randn(E, 2 * I, H, device="cuda", generator=gen) * H ** -0.5
    w2 = torch.randn(E, H, I, device="cuda", generator=gen) * I ** -0.5
    opts = dict(opts)
    static = opts.pop("static", False)
    if static:  # about amax / 448 of the inputs each GEMM sees
        spread = 1.0 if static is True else 1.0 + 0.25 * torch.rand(E, device="cuda", generator=gen)
        opts.update(a13_scale=torch.full((E,), 4.5 / 448, device="cuda") * spread,
                    a2_scale=torch.full((E,), 4.0 / 448, device="cuda") * spread)
    b13 = torch.randn(E, 2 * I, device="cuda", generator=gen).to(dtype) if bias else None
    b2 = torch.randn(E, H, device="cuda", generator=gen).to(dtype) if bias else None
    return quantize_experts(w13, w2, scheme, b13=b13, b2=b2, **opts)


def _routing(T, E_global, k, gen):
    scores = torch.rand(T, E_global, device="cuda", generator=gen)
    return torch.rand(T, k, device="cuda", generator=gen) + 0.05, scores.topk(k, dim=1).indices.to(torch.int32)


def _check(x, wts, w, ids, emap=None, on_input=False):
    _poison_allocator()
    out = fused_experts(x, wts, None, w, ids, expert_map=emap, apply_router_weight_on_input=on_input, backend="triton")
    ref = emulated_experts(x, wts, w, ids, expert_map=emap, apply_router_weight_on_input=on_input,
                           act_dtype=triton_act_dtype(wts, x))
    assert out.dtype == x.dtype and torch.isfinite(out).all()
    err = rel_err(out, ref)
    assert err <= TOLERANCE[get_scheme(wts.quant).precision], err
    return out


@pytest.mark.parametrize("T,n_remote", [(1, 0), (37, 3), (700, 0)], ids=["T1", "T37-expert-map", "T700"])
@pytest.mark.parametrize("scheme,opts", SCHEMES, ids=IDS)
def test_schemes_match_emulated_reference(scheme, opts, T, n_remote, cuda_gen):
    E, k, H, I = 16, 4, 384, 256
    wts = _weights(scheme, opts, E, H, I, cuda_gen)
    emap = random_expert_map(E, n_remote, cuda_gen, "cuda")
    w, ids = _routing(T, E + n_remote, k, cuda_gen)
    _check(torch.randn(T, H, device="cuda", generator=cuda_gen).bfloat16(), wts, w, ids, emap)


@pytest.mark.parametrize("scheme,opts", [SCHEMES[i] for i in (1, 2, 3, 10)], ids=[IDS[i] for i in (1, 2, 3, 10)])
def test_fp16_bias_and_weight_on_input(scheme, opts, cuda_gen):
    wts = _weights(scheme, opts, 8, 256, 128, cuda_gen, bias=True, dtype=torch.float16)
    w, ids = _routing(50, 8, 1, cuda_gen)
    x = torch.randn(50, 256, device="cuda", generator=cuda_gen).half()
    _check(x, wts, w, ids, on_input=True)


def test_deepseek_v3_sized_experts_fp8_block(cuda_gen):
    # The real H and I (long K loops, 56 x 16 weight blocks per expert), 8 of the 256 experts.
    wts = _weights("fp8_w8a8_block128", {}, 8, 7168, 2048, cuda_gen)
    w, ids = _routing(16, 8, 8, cuda_gen)
    _check(torch.randn(16, 7168, device="cuda", generator=cuda_gen).bfloat16(), wts, w, ids)


@pytest.mark.parametrize("scheme,opts,activation", [
    ("fp8_w8a8", {}, "relu2_no_mul"),                                # tuned swap1 on gate_up tiles: fitted off
    ("int4_w4a16", {"group_size": 64}, "silu"),                      # tuned K tiles of 128: cut to the groups
    ("int4_w4a16", {"group_size": 32, "symmetric": False}, "silu"),
])
@pytest.mark.parametrize("T", [1, 16, 256])
def test_shipped_tables_serve_other_activations_and_group_sizes(scheme, opts, activation, T, cuda_gen):
    # Qwen3-30B-A3B's sizes, so the shipped H200 tables are read: an entry tuned for gated fp8 or
    # int4 in groups of 128 must serve these calls too (tables are named by dtype alone).
    E, k, H, I = 128, 8, 2048, 768
    rows = I if activation.endswith("_no_mul") else 2 * I
    w13 = torch.randn(E, rows, H, device="cuda", generator=cuda_gen) * H ** -0.5
    w2 = torch.randn(E, H, I, device="cuda", generator=cuda_gen) * I ** -0.5
    wts = quantize_experts(w13, w2, scheme, **opts)
    w, ids = _routing(T, E, k, cuda_gen)
    x = torch.randn(T, H, device="cuda", generator=cuda_gen).bfloat16()
    _poison_allocator()
    out = fused_experts(x, wts, None, w, ids, activation=activation, backend="triton")
    ref = emulated_experts(x, wts, w, ids, activation=activation, act_dtype=triton_act_dtype(wts, x))
    assert torch.isfinite(out).all() and rel_err(out, ref) <= TOLERANCE[get_scheme(wts.quant).precision]


def test_run_to_run_bit_identical(cuda_gen):
    wts = _weights("fp8_w8a8_block128", {}, 16, 256, 256, cuda_gen)
    w, ids = _routing(3000, 16, 4, cuda_gen)  # the chunked alignment path
    x = torch.randn(3000, 256, device="cuda", generator=cuda_gen).bfloat16()
    assert torch.equal(fused_experts(x, wts, None, w, ids, backend="triton"),
                       fused_experts(x, wts, None, w, ids, backend="triton"))


@pytest.mark.parametrize("quant", ["fp8_w8a8", "int4_w4a16"])  # dynamic per-tensor scale; weight-only
def test_quantized_layer_on_the_oracle_and_in_a_cuda_graph(quant, cuda_gen):
    layer = FusedMoE(16, 256, 128, RoutingConfig(top_k=4), dtype=torch.bfloat16, device="cuda", quant=quant).eval()
    T = 24
    static_x = torch.randn(T, 256, device="cuda", dtype=torch.bfloat16)
    static_logits = torch.randn(T, 16, device="cuda")
    with torch.inference_mode():
        problem = problem_of(static_x, layer.experts.expert_weights(), 4, "silu", False, False)
        assert choose_backend(problem).backend.name == "triton"
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            layer(static_x, static_logits)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = layer(static_x, static_logits)
        for _ in range(3):  # fresh inputs each replay
            static_x.copy_(torch.randn(T, 256, device="cuda", generator=cuda_gen))
            static_logits.copy_(torch.randn(T, 16, device="cuda", generator=cuda_gen))
            graph.replay()
            assert torch.equal(static_out, layer(static_x, static_logits))


def _prefill_configs():
    from moekit.kernels.tuning import MoEConfig, PrefillConfig, TileConfig  # noqa: PLC0415

    return {
        "tma-persistent": MoEConfig(TileConfig(128, 128, 128, 8, 8, 3), TileConfig(128, 128, 128, 8, 8, 3),
                                    PrefillConfig(tma=1, programs_per_sm=1, tail=1)),
        "pointers-tail2": MoEConfig(TileConfig(128, 128, 128, 8, 8, 3), TileConfig(128, 256, 128, 8, 8, 3),
                                    PrefillConfig(tma=0, programs_per_sm=0, tail=2)),
        "gu1-ws-rows-by-tma": MoEConfig(TileConfig(128, 128, 128, 8, 8, 3), TileConfig(128, 256, 128, 8, 4, 3),
                                        PrefillConfig(tma=2, programs_per_sm=1, tail=1, act_tma=1, x_tma=1, ws=1,
                                                      gu1=1)),
        "gu1-tail2-64": MoEConfig(TileConfig(128, 64, 128, 8, 4, 4), TileConfig(128, 128, 128, 8, 4, 4),
                                  PrefillConfig(tma=2, programs_per_sm=1, tail=2, act_tma=1, gu1=1)),
    }


@pytest.mark.parametrize("name", list(_prefill_configs()))
@pytest.mark.parametrize("T,bias,static", [(700, False, True), (37, True, "per_expert"), (700, False, "per_expert")])
def test_fp8_static_scales_on_the_prefill_kernels(name, T, bias, static, cuda_gen):
    """fp8 weights with static per-tensor scales through triton_prefill (explicit config, and as
    a tuned entry's static_prefill knob), an expert map, with and without biases (GEMM2's scales
    folded into the routed weights, or in its epilogue), against the emulated reference; the
    warp-specialized GEMM2 gives the bits of the plain loop."""
    import dataclasses  # noqa: PLC0415

    from moekit.kernels.launch_quant import fused_moe_quant  # noqa: PLC0415
    from moekit.kernels.quant_tuning import QuantKnobs  # noqa: PLC0415
    from moekit.quant import scheme_of  # noqa: PLC0415

    cfg = _prefill_configs()[name]
    E, k, H, I, n_remote = 16, 4, 384, 256, 3
    wts = _weights("fp8_w8a8", {"static": static}, E, H, I, cuda_gen, bias=bias)
    emap = random_expert_map(E, n_remote, cuda_gen, "cuda")
    w, ids = _routing(T, E + n_remote, k, cuda_gen)
    x = torch.randn(T, H, device="cuda", generator=cuda_gen).bfloat16()
    s = wts.scales

    def run(**kw):
        _poison_allocator()
        return fused_moe_quant(x, wts.w13, wts.w2, wts.b13, wts.b2, s["w13_scale"], s["w2_scale"], None, None,
                               s["a13_scale"], s["a2_scale"], w, ids, emap, scheme_of(wts), "silu",
                               out_dtype=x.dtype, **kw)

    ref = emulated_experts(x, wts, w, ids, expert_map=emap, act_dtype=triton_act_dtype(wts, x))
    out = run(config=cfg)
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) <= TOLERANCE[get_scheme(wts.quant).precision], rel_err(out, ref)
    assert torch.equal(out, run(config=cfg))  # run to run
    assert torch.equal(out, run(knobs=QuantKnobs(static_prefill=cfg)))  # the knob takes the same kernels
    if cfg.prefill.ws:
        plain = dataclasses.replace(cfg, prefill=dataclasses.replace(cfg.prefill, ws=0))
        assert torch.equal(out, run(config=plain))


def test_fast_sigmoid_stays_within_its_bound(cuda_gen):
    # The sigmoid of the 8-bit paths' epilogues (0.5 + 0.5 tanh(x / 2) by the approximate tanh)
    # against torch's, over the range activations take and far past it.
    import triton
    import triton.language as tl

    from moekit.kernels.triton_moe import _apply_act, _sigmoid

    @triton.jit
    def both(x_ptr, fast_ptr, silu_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < n
        x = tl.load(x_ptr + offs, mask=ok, other=0.0)
        tl.store(fast_ptr + offs, _sigmoid(x, True), mask=ok)
        tl.store(silu_ptr + offs, _apply_act(x, x, "silu", 0.0, 0.0, True), mask=ok)

    x = torch.cat([torch.linspace(-40, 40, 1 << 16, device="cuda"),
                   torch.randn(1 << 16, device="cuda", generator=cuda_gen) * 4,
                   torch.tensor([0.0, -0.0, 1e30, -1e30, float("inf"), float("-inf")], device="cuda")])
    fast, silu = torch.empty_like(x), torch.empty_like(x)
    both[(triton.cdiv(x.numel(), 1024),)](x, fast, silu, x.numel(), BLOCK=1024)
    exact = torch.sigmoid(x.double())
    assert (fast.double() - exact).abs().max() <= 3e-4
    finite = x.abs() <= 40
    want = (x.double() * exact * x.double())[finite]
    assert ((silu.double()[finite] - want).abs() <= 3e-4 * x.double()[finite] ** 2 + 1e-30).all()


def test_fp8_cast_rounds_as_the_grid_rounding(cuda_gen):
    # to_quant casts with the GPU's conversion; the interpreter's path puts values on the e4m3 grid
    # first. Same values on ties (midpoints of neighbouring fp8 values, both parities), subnormals,
    # values past +-448 and random ones over the whole exponent range.
    import triton
    import triton.language as tl

    from moekit.kernels.triton_quant_rows import fp8_grid_rne, to_quant

    @triton.jit
    def both(v_ptr, hw_ptr, grid_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < n
        v = tl.load(v_ptr + offs, mask=ok, other=0.0)
        tl.store(hw_ptr + offs, to_quant(v, 448.0, False), mask=ok)
        clamped = tl.minimum(tl.maximum(v, -448.0), 448.0)
        tl.store(grid_ptr + offs, fp8_grid_rne(clamped).to(tl.float8e4nv), mask=ok)

    grid_values = torch.arange(256, dtype=torch.uint8, device="cuda").view(torch.float8_e4m3fn).float()
    grid_values = grid_values[torch.isfinite(grid_values)].unique()  # sorted, each zero once
    mids = (grid_values[1:] + grid_values[:-1]) / 2  # exact in fp32: ties
    exps = torch.randint(-14, 10, (1 << 16,), device="cuda", generator=cuda_gen).float()
    rand = torch.randn(1 << 16, device="cuda", generator=cuda_gen) * torch.exp2(exps)
    v = torch.cat([grid_values, mids, mids.nextafter(mids + 1), mids.nextafter(mids - 1), rand,
                   torch.tensor([448.0, 464.0, 480.0, 1e6, -1e6, float("inf"), float("-inf"), 2.0**-10, -(2.0**-10), 0.0,
                                 -0.0], device="cuda")])
    hw = torch.empty(v.numel(), dtype=torch.float8_e4m3fn, device="cuda")
    grid = torch.empty_like(hw)
    both[(triton.cdiv(v.numel(), 1024),)](v, hw, grid, v.numel(), BLOCK=1024)
    # Equal values (the sign of a zero may differ: the grid path rounds -tiny to +0).
    assert torch.equal(hw.float(), grid.float())
    assert torch.equal(hw.float(), v.clamp(-448, 448).to(torch.float8_e4m3fn).float())

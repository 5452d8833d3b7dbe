"""The Triton experts on a CUDA GPU against `reference` (PERF.md tolerances), CUDA-graph
capture and replay, torch.compile, determinism. Run with `pytest -m gpu tests/kernels`."""

import random

import pytest
import torch

from conftest import TOL, rel_err, random_expert_map

pytest.importorskip("triton")

import moekit  # noqa: E402
from moekit import FusedMoE, RoutingConfig, fused_experts  # noqa: E402
from moekit.activations import ACTIVATIONS, is_gated  # noqa: E402
from moekit.config import settings  # noqa: E402
from moekit.experts.api import problem_of  # noqa: E402
from moekit.experts.base import ExpertWeights  # noqa: E402
from moekit.experts.reference import reference_experts  # noqa: E402
from moekit.oracle import choose_backend  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(settings.triton_interpret, reason="TRITON_INTERPRET=1 is set")]

# (name, E, k, H, I): PERF.md's five shapes.
PERF_SHAPES = [
    ("mixtral-8x7b", 8, 2, 4096, 14336),
    ("qwen3-30b-a3b", 128, 8, 2048, 768),
    ("deepseek-v3", 256, 8, 7168, 2048),
    ("olmoe-1b-7b", 64, 8, 2048, 1024),
    ("gpt-oss-20b", 32, 4, 2880, 2880),
]
_weights_cache = {}


def _poison_allocator():
    """Leave NaN in the caching allocator's free memory so an unwritten output element shows."""
    torch.empty(256 * 2**20 // 4, device="cuda").fill_(float("nan"))


def _weights(E, H, I, dtype, gen, activation="silu", bias=False):
    rows = 2 * I if is_gated(activation) else I
    w13 = torch.randn(E, rows, H, device="cuda", generator=gen).mul_(H ** -0.5).to(dtype)
    w2 = torch.randn(E, H, I, device="cuda", generator=gen).mul_(I ** -0.5).to(dtype)
    b13 = torch.randn(E, rows, device="cuda", generator=gen).to(dtype) if bias else None
    b2 = torch.randn(E, H, device="cuda", generator=gen).to(dtype) if bias else None
    return ExpertWeights(w13, w2, b13, b2)


def _routing(T, E_global, k, gen):
    scores = torch.rand(T, E_global, device="cuda", generator=gen)
    ids = scores.topk(k, dim=1).indices.to(torch.int32)
    return torch.rand(T, k, device="cuda", generator=gen) + 0.05, ids


def _check(x, wts, w, ids, emap=None, activation="silu", on_input=False):
    _poison_allocator()
    out = fused_experts(x, wts, None, w, ids, activation=activation, apply_router_weight_on_input=on_input,
                        expert_map=emap, backend="triton")
    ref = reference_experts(x, wts, w, ids, activation=activation, apply_router_weight_on_input=on_input,
                            expert_map=emap)
    assert out.dtype == x.dtype and torch.isfinite(out).all()
    err = rel_err(out, ref)
    assert err <= TOL[x.dtype], err


@pytest.mark.parametrize("M", [1, 16, 64])
@pytest.mark.parametrize("shape", PERF_SHAPES, ids=[s[0] for s in PERF_SHAPES])
def test_perf_shapes_bf16_small_batches(shape, M, cuda_gen):
    name, E, k, H, I = shape
    if name not in _weights_cache:
        _weights_cache.clear()
        torch.cuda.empty_cache()
        _weights_cache[name] = _weights(E, H, I, torch.bfloat16, cuda_gen)
    wts = _weights_cache[name]
    x = torch.randn(M, H, device="cuda", generator=cuda_gen).bfloat16()
    w, ids = _routing(M, E, k, cuda_gen)
    _check(x, wts, w, ids)


@pytest.mark.parametrize("seed", range(12))
def test_random_shapes(seed):
    rng = random.Random(seed * 7919 + 1)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    _weights_cache.clear()
    E = rng.randint(1, 40)
    k = rng.randint(1, min(E, 8))
    H, I = rng.choice([rng.randint(8, 700), 64 * rng.randint(1, 12)]), rng.choice([rng.randint(8, 400), 64 * rng.randint(1, 8)])
    T = rng.choice([1, 2, 3, rng.randint(4, 60), rng.randint(60, 3000)])
    dtype = rng.choice([torch.bfloat16, torch.float16])
    activation = rng.choice(ACTIVATIONS)
    n_remote = rng.choice([0, 0, rng.randint(1, 6)])
    wts = _weights(E, H, I, dtype, gen, activation, bias=rng.random() < 0.3)
    emap = random_expert_map(E, n_remote, gen, "cuda")
    w, ids = _routing(T, E + n_remote, k, gen)
    x = torch.randn(T, H, device="cuda", generator=gen).to(dtype)
    _check(x, wts, w, ids, emap, activation, on_input=k == 1 and rng.random() < 0.5)


@pytest.mark.parametrize("activation,bias,k,n_remote,on_input", [
    ("silu", False, 4, 0, False), ("gelu", True, 4, 3, False), ("swigluoai", True, 1, 0, True)])
@pytest.mark.parametrize("rows", [16, 64, 129])
def test_untuned_shapes_by_rows_per_expert(rows, activation, bias, k, n_remote, on_input, cuda_gen):
    """An untuned shape at the rows an expert where Hopper's rule (tuning.hopper_default) changes
    tiles; then the same call on weights TMA cannot read (an odd start), which take pointer tiles."""
    from moekit.kernels.tuning import device_name, get_config, hopper_default  # noqa: PLC0415

    E, H, I = 24, 1000, 328
    T = rows * E // k
    wts = _weights(E, H, I, torch.bfloat16, cuda_gen, activation, bias)
    if torch.cuda.get_device_capability()[0] == 9:
        assert get_config(T, E, k, H, I, torch.bfloat16, device_name()) == hopper_default(T, E, k, H, I)
    emap = random_expert_map(E, n_remote, cuda_gen, "cuda")
    w, ids = _routing(T, E + n_remote, k, cuda_gen)
    x = torch.randn(T, H, device="cuda", generator=cuda_gen).bfloat16()
    _check(x, wts, w, ids, emap, activation, on_input)
    odd = [torch.empty(t.numel() + 1, device="cuda", dtype=t.dtype)[1:].view(t.shape).copy_(t) for t in (wts.w13, wts.w2)]
    assert odd[0].data_ptr() % 16
    _check(x, ExpertWeights(*odd, wts.b13, wts.b2), w, ids, emap, activation, on_input)


@pytest.mark.parametrize("T", [1, 300])
def test_float32_exact_dots(T, cuda_gen):
    wts = _weights(6, 96, 80, torch.float32, cuda_gen, bias=True)
    w, ids = _routing(T, 6, 2, cuda_gen)
    _check(torch.randn(T, 96, device="cuda", generator=cuda_gen), wts, w, ids)


def test_large_batch_takes_the_three_kernel_alignment(cuda_gen):
    wts = _weights(64, 256, 128, torch.bfloat16, cuda_gen)
    w, ids = _routing(6000, 64, 4, cuda_gen)
    _check(torch.randn(6000, 256, device="cuda", generator=cuda_gen).bfloat16(), wts, w, ids)


def test_run_to_run_bit_identical(cuda_gen):
    wts = _weights(32, 512, 256, torch.bfloat16, cuda_gen)
    w, ids = _routing(700, 32, 4, cuda_gen)
    x = torch.randn(700, 512, device="cuda", generator=cuda_gen).bfloat16()
    a = fused_experts(x, wts, None, w, ids, backend="triton")
    b = fused_experts(x, wts, None, w, ids, backend="triton")
    assert torch.equal(a, b)


def _layer(E=16, k=4, H=256, I=128):
    layer = FusedMoE(E, H, I, RoutingConfig(top_k=k), dtype=torch.bfloat16, device="cuda")
    return layer.eval()


def test_oracle_picks_triton_for_the_layer():
    layer = _layer()
    x = torch.randn(4, 256, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        problem = problem_of(x, layer.experts.expert_weights(), 4, "silu", False, False)
        assert choose_backend(problem).backend.name == "triton"


@pytest.mark.parametrize("T", [1, 64])  # direct path, sorted path
def test_cuda_graph_capture_and_replay(T, cuda_gen):
    layer = _layer()
    static_x = torch.randn(T, 256, device="cuda", dtype=torch.bfloat16)
    static_logits = torch.randn(T, 16, device="cuda")
    with torch.inference_mode():
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
            expected = layer(static_x, static_logits)
            assert torch.equal(static_out, expected)


@pytest.mark.parametrize("quant", [None, "fp8_w8a8", "int4_w4a16"])
def test_torch_compile_of_the_layer(quant, cuda_gen):
    """fullgraph: the router, the oracle's choice and the Triton op trace without a graph break,
    first call compiled (nothing logged or looked up eagerly before)."""
    layer = FusedMoE(16, 256, 128, RoutingConfig(top_k=4), dtype=torch.bfloat16, device="cuda", quant=quant).eval()
    compiled = torch.compile(layer, fullgraph=True)
    for T in (1, 32):
        x = torch.randn(T, 256, device="cuda", generator=cuda_gen).bfloat16()
        logits = torch.randn(T, 16, device="cuda", generator=cuda_gen)
        with torch.inference_mode():
            out = compiled(x, logits)
            eager = layer(x, logits)
        assert rel_err(out, eager) <= TOL[torch.bfloat16]


@pytest.mark.parametrize("T", [1, 64])
def test_trainable_gate_over_frozen_experts(T, cuda_gen):
    # Only the routing weights need gradients: the Triton experts run each assignment without
    # autograd and torch takes the weighted sum over k (experts.api._routed_by_slot).
    layer = FusedMoE(16, 256, 128, RoutingConfig(top_k=4), dtype=torch.bfloat16, device="cuda", gate=True)
    layer.experts.requires_grad_(False)
    x = torch.randn(T, 256, device="cuda", generator=cuda_gen).bfloat16()
    y = layer(x)
    assert y.requires_grad
    with torch.inference_mode():
        assert rel_err(y.detach(), layer(x)) <= TOL[torch.bfloat16]
    g = torch.randn(T, 256, device="cuda", generator=cuda_gen)
    (y.float() * g).sum().backward()
    gate_w = layer.gate.weight.detach().clone().requires_grad_()
    w, ids = moekit.route(torch.nn.functional.linear(x, gate_w), layer.routing)
    ref = fused_experts(x, layer.experts.w13, layer.experts.w2, w, ids, backend="reference")
    (ref.float() * g).sum().backward()
    assert rel_err(layer.gate.weight.grad.float(), gate_w.grad.float()) <= 5e-2

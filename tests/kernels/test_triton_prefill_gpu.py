"""The prefill kernels (kernels/triton_prefill.py) on a CUDA GPU: bf16 against `reference` on
slices of PERF.md's five shapes for every tile pair and knob family, biases with an expert
map, CUDA-graph capture and replay. Run with `pytest -m gpu tests/kernels`."""

import dataclasses

import pytest
import torch

from conftest import TOL, rel_err, random_expert_map

pytest.importorskip("triton")

from moekit.config import settings  # noqa: E402
from moekit.experts.base import ExpertWeights  # noqa: E402
from moekit.experts.reference import reference_experts  # noqa: E402
from moekit.kernels.launch import fused_moe  # noqa: E402
from moekit.kernels.tuning import MoEConfig, PrefillConfig, prefill_space  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(settings.triton_interpret, reason="TRITON_INTERPRET=1 is set")]

# (name, E, k, H, I): PERF.md's five shapes; the tests take at most 16 experts of each.
PERF_SHAPES = [
    ("mixtral-8x7b", 8, 2, 4096, 14336),
    ("qwen3-30b-a3b", 128, 8, 2048, 768),
    ("deepseek-v3", 256, 8, 7168, 2048),
    ("olmoe-1b-7b", 64, 8, 2048, 1024),
    ("gpt-oss-20b", 32, 4, 2880, 2880),
]
# One config per knob family over every tile pair of the search space.
FAMILIES = [dict(tma=1, programs_per_sm=1, tail=4), dict(tma=0, programs_per_sm=0, tail=2),
            dict(tma=2, programs_per_sm=1, tail=1), dict(tma=1, programs_per_sm=1, tail=1, flatten=1),
            dict(tma=2, programs_per_sm=1, tail=4, act_tma=1, x_tma=1),
            dict(tma=2, programs_per_sm=0, tail=2, act_tma=1, x_tma=1),
            dict(tma=2, programs_per_sm=1, tail=1, flatten=1, act_tma=1, x_tma=1)]


def _configs():
    """Each knob family on each tile pair of the search space (persistent grids with the pair's
    programs per SM)."""
    pairs = {}
    for c in prefill_space(4096, 128, 8):
        if c.prefill.programs_per_sm > 0 and not c.prefill.ws and not c.prefill.gu1:
            pairs.setdefault((c.gemm1, c.gemm2), c.prefill.programs_per_sm)
    return [MoEConfig(g1, g2, PrefillConfig(**dict(f, programs_per_sm=per_sm if f["programs_per_sm"] else 0)))
            for (g1, g2), per_sm in pairs.items() for f in FAMILIES]


def _problem(E, k, H, I, T, gen, bias=False, n_remote=0):
    w13 = (torch.randn(E, 2 * I, H, device="cuda", generator=gen) * H ** -0.5).bfloat16()
    w2 = (torch.randn(E, H, I, device="cuda", generator=gen) * I ** -0.5).bfloat16()
    b13 = torch.randn(E, 2 * I, device="cuda", generator=gen).bfloat16() if bias else None
    b2 = torch.randn(E, H, device="cuda", generator=gen).bfloat16() if bias else None
    Eg = E + n_remote
    emap = random_expert_map(E, n_remote, gen, "cuda")
    ids = torch.rand(T, Eg, device="cuda", generator=gen).topk(k, dim=1).indices.int()
    w = torch.rand(T, k, device="cuda", generator=gen) + 0.05
    x = torch.randn(T, H, device="cuda", generator=gen).bfloat16()
    return x, ExpertWeights(w13, w2, b13, b2), w, ids, emap


@pytest.mark.parametrize("shape", PERF_SHAPES, ids=[s[0] for s in PERF_SHAPES])
def test_every_family_matches_reference_on_perf_shapes(shape, cuda_gen):
    _, E, k, H, I = shape
    x, wts, w, ids, _ = _problem(min(E, 16), k, H, I, 512, cuda_gen)
    ref = reference_experts(x, wts, w, ids)
    for cfg in _configs():
        out = fused_moe(x, wts.w13, wts.w2, None, None, w, ids, None, "silu", config=cfg, direct=False,
                        out_dtype=x.dtype)
        assert rel_err(out.float(), ref) <= TOL[torch.bfloat16], cfg.to_json()


def test_bias_expert_map_and_weight_on_input(cuda_gen):
    first = prefill_space(4096, 128, 8)[0]
    cfg = MoEConfig(first.gemm1, first.gemm2, PrefillConfig(1, 1, 4))
    x, wts, w, ids, emap = _problem(12, 2, 2048, 768, 700, cuda_gen, bias=True, n_remote=5)
    out = fused_moe(x, wts.w13, wts.w2, wts.b13, wts.b2, w, ids, emap, "silu", config=cfg, direct=False)
    assert rel_err(out, reference_experts(x, wts, w, ids, expert_map=emap)) <= TOL[torch.bfloat16]
    x, wts, w, ids, _ = _problem(12, 1, 2048, 768, 700, cuda_gen, bias=True)
    out = fused_moe(x, wts.w13, wts.w2, wts.b13, wts.b2, w, ids, None, "silu", on_input=True, config=cfg,
                    direct=False)
    ref = reference_experts(x, wts, w, ids, apply_router_weight_on_input=True)
    assert rel_err(out, ref) <= TOL[torch.bfloat16]


@pytest.mark.parametrize("tail,flatten", [(4, 0), (1, 1)])
def test_row_descriptors_give_the_pointer_loads_bits(tail, flatten, cuda_gen):
    # Rows read by TMA past an expert's rows (the next expert's, never-written rows) only
    # reach rows that are not stored: same bits as gathering each tile's rows by pointers.
    x, wts, w, ids, _ = _problem(16, 8, 2048, 768, 1500, cuda_gen)
    first = prefill_space(4096, 128, 8)[0]
    outs = [fused_moe(x, wts.w13, wts.w2, None, None, w, ids, None, "silu", direct=False, out_dtype=x.dtype,
                      config=MoEConfig(first.gemm1, first.gemm2,
                                       PrefillConfig(2, 1, tail, flatten=flatten, act_tma=a, x_tma=xt)))
            for a, xt in ((0, 0), (1, 0), (0, 1), (1, 1))]
    assert all(torch.equal(outs[0], o) for o in outs[1:])


@pytest.mark.parametrize("family", [0, 2, 6], ids=["host_descriptors", "kernel_descriptors", "row_descriptors"])
def test_cuda_graph_replay_is_bit_identical(family, cuda_gen):
    cfg = _configs()[family]
    x, wts, w, ids, _ = _problem(16, 8, 2048, 768, 1024, cuda_gen)
    _replay_with_new_routing(
        lambda: fused_moe(x, wts.w13, wts.w2, None, None, w, ids, None, "silu", config=cfg, direct=False),
        ids, torch.rand(1024, 16, device="cuda", generator=cuda_gen).topk(8, dim=1).indices.int())


def _replay_with_new_routing(run, ids, new_ids):
    """Capture run() in a CUDA graph, copy new_ids into ids, replay: the replay must give an
    eager run's bits on the new routing, not the first routing's output."""
    eager = run()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = run()
    ids.copy_(new_ids)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, run()) and not torch.equal(captured, eager)


def _same_bits_as(configs, twin, shape, gen):
    """Each config within the bf16 bound of `reference` on a slice of shape, deterministic, and
    bit-identical to twin(config)."""
    _, E, k, H, I = shape
    x, wts, w, ids, _ = _problem(min(E, 16), k, H, I, 700, gen)
    ref = reference_experts(x, wts, w, ids)
    assert configs

    def run(c):
        return fused_moe(x, wts.w13, wts.w2, None, None, w, ids, None, "silu", config=c, direct=False,
                         out_dtype=x.dtype)

    for cfg in configs:
        out = run(cfg)
        assert rel_err(out.float(), ref) <= TOL[torch.bfloat16], cfg.to_json()
        assert torch.equal(out, run(cfg)), cfg.to_json()
        assert torch.equal(out, run(twin(cfg))), cfg.to_json()


WS_CONFIGS = [c for c in prefill_space(4096, 128, 8) if c.prefill.ws and not c.prefill.gu1]
GU1_CONFIGS = [c for c in prefill_space(4096, 128, 8)
               if c.prefill.gu1 and c.prefill.programs_per_sm and not c.prefill.x_tma]


@pytest.mark.parametrize("shape", PERF_SHAPES, ids=[s[0] for s in PERF_SHAPES])
def test_warp_specialized_loops_match_reference_and_the_plain_loops(shape, cuda_gen):
    # ws=1 only reschedules GEMM2's products (a producer warpgroup loads, two consumer
    # warpgroups multiply in the same K order): same bits as the unspecialized loop.
    _same_bits_as(WS_CONFIGS, lambda c: MoEConfig(c.gemm1, c.gemm2, dataclasses.replace(c.prefill, ws=0)), shape,
                  cuda_gen)


def test_warp_specialized_loops_with_bias_map_input_weight_and_graph_replay(cuda_gen):
    cfg = WS_CONFIGS[1]
    x, wts, w, ids, emap = _problem(12, 2, 2048, 768, 700, cuda_gen, bias=True, n_remote=5)
    out = fused_moe(x, wts.w13, wts.w2, wts.b13, wts.b2, w, ids, emap, "silu", config=cfg, direct=False)
    assert rel_err(out, reference_experts(x, wts, w, ids, expert_map=emap)) <= TOL[torch.bfloat16]
    x, wts, w, ids, emap = _problem(12, 2, 2048, 768, 700, cuda_gen, n_remote=5)
    out = fused_moe(x, wts.w13, wts.w2, None, None, w, ids, emap, "silu", on_input=True, config=cfg, direct=False)
    ref = reference_experts(x, wts, w, ids, expert_map=emap, apply_router_weight_on_input=True)
    assert rel_err(out, ref) <= TOL[torch.bfloat16]
    _replay_with_new_routing(
        lambda: fused_moe(x, wts.w13, wts.w2, None, None, w, ids, emap, "silu", config=cfg, direct=False),
        ids, torch.rand(700, 17, device="cuda", generator=cuda_gen).topk(2, dim=1).indices.int())


@pytest.mark.parametrize("shape", PERF_SHAPES, ids=[s[0] for s in PERF_SHAPES])
def test_gate_and_up_in_one_product_give_two_products_bits(shape, cuda_gen):
    # gu1: one [BK, 2 BN] product per step instead of two [BK, BN] ones, the same sums per
    # element: same bits, on every tile pair, tail, grid and specialization of the space.
    _same_bits_as(GU1_CONFIGS, lambda c: MoEConfig(c.gemm1, c.gemm2, dataclasses.replace(c.prefill, gu1=0)), shape,
                  cuda_gen)


def test_gate_and_up_in_one_product_with_bias_map_and_swiglu(cuda_gen):
    cfg = [c for c in GU1_CONFIGS if c.prefill.tail == 4][0]
    x, wts, w, ids, emap = _problem(12, 2, 2048, 768, 700, cuda_gen, bias=True, n_remote=5)
    for activation in ("silu", "swigluoai"):
        out = fused_moe(x, wts.w13, wts.w2, wts.b13, wts.b2, w, ids, emap, activation, config=cfg, direct=False)
        ref = reference_experts(x, wts, w, ids, expert_map=emap, activation=activation)
        assert rel_err(out, ref) <= TOL[torch.bfloat16], activation

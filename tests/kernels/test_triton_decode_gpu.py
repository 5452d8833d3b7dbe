"""The decode knobs of the Triton experts on a CUDA GPU: every variant against `reference` on the
PERF.md shapes' H and I, bit-identical results although the split's partials arrive in any
order, and CUDA-graph replays (the split counters are cleared by GEMM1 on every call).
Run with `pytest -m gpu tests/kernels`."""

import pytest
import torch

from conftest import TOL, rel_err

pytest.importorskip("triton")

from moekit.config import settings  # noqa: E402
from moekit.experts.base import ExpertWeights  # noqa: E402
from moekit.experts.reference import reference_experts  # noqa: E402
from moekit.kernels.launch import fused_moe  # noqa: E402
from moekit.kernels.tuning import MoEConfig, TileConfig  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(settings.triton_interpret, reason="TRITON_INTERPRET=1 is set")]

# (name, E, k, H, I): PERF.md's shapes with at most 32 experts (the kernels' tiles see H, I and k;
# fewer experts keep the weights small).
SHAPES = [
    ("mixtral-8x7b", 8, 2, 4096, 14336),
    ("qwen3-30b-a3b", 32, 8, 2048, 768),
    ("deepseek-v3", 32, 8, 7168, 2048),
    ("olmoe-1b-7b", 32, 8, 2048, 1024),
    ("gpt-oss-20b", 32, 4, 2880, 2880),
]


def _pdl() -> int:
    return int(torch.cuda.get_device_capability()[0] >= 9)


def _cfg(g1: dict, g2: dict, bm: int = 16) -> MoEConfig:
    return MoEConfig(TileConfig(bm, **g1), TileConfig(bm, **g2))


# Direct-path variants (M = 1): CUDA-core and tl.dot GEMMs, split GEMM2, PDL where the GPU has it.
DIRECT = {
    "gemv-split8-pdl": lambda: _cfg(dict(BLOCK_SIZE_N=16, BLOCK_SIZE_K=256, GEMV=1),
                                    dict(BLOCK_SIZE_N=16, BLOCK_SIZE_K=256, SPLIT_K=8, GEMV=1, PDL=_pdl())),
    "gemv8warps-split3": lambda: _cfg(dict(BLOCK_SIZE_N=32, BLOCK_SIZE_K=256, num_warps=8, num_stages=4, GEMV=1),
                                      dict(BLOCK_SIZE_N=64, BLOCK_SIZE_K=128, num_warps=8, SPLIT_K=3, GEMV=1)),
    "dot-split16-pdl": lambda: _cfg(dict(BLOCK_SIZE_N=64, BLOCK_SIZE_K=128, num_stages=4),
                                    dict(BLOCK_SIZE_N=32, BLOCK_SIZE_K=256, SPLIT_K=16, PDL=_pdl())),
    # GEMM2's first weight tiles loaded before it waits for GEMM1.
    "gemv-split4-pre2-pdl": lambda: _cfg(dict(BLOCK_SIZE_N=16, BLOCK_SIZE_K=128, GEMV=1),
                                         dict(BLOCK_SIZE_N=32, BLOCK_SIZE_K=256, SPLIT_K=4, GEMV=1, PDL=_pdl(), PRE=2)),
    "dot-split4-pre1-pdl": lambda: _cfg(dict(BLOCK_SIZE_N=16, BLOCK_SIZE_K=128, GEMV=1),
                                        dict(BLOCK_SIZE_N=64, BLOCK_SIZE_K=256, SPLIT_K=4, PDL=_pdl(), PRE=1)),
    # Both GEMMs in one launch, the partial sum as its dependent.
    "fused-pdl": lambda: _cfg(dict(BLOCK_SIZE_N=64, BLOCK_SIZE_K=128, num_stages=4, GEMV=1, FUSED=1),
                              dict(BLOCK_SIZE_N=64, BLOCK_SIZE_K=128, PDL=_pdl())),
    "fused-8warps": lambda: _cfg(dict(BLOCK_SIZE_N=32, BLOCK_SIZE_K=256, num_warps=8, GEMV=1, FUSED=1),
                                 dict(BLOCK_SIZE_N=128, BLOCK_SIZE_K=128, num_stages=2)),
}
# Sorted-path variants (M = 16..256): GEMM2 split over K.
SORTED = {
    "bm16-split2": lambda: _cfg(dict(BLOCK_SIZE_N=64, BLOCK_SIZE_K=128),
                                dict(BLOCK_SIZE_N=64, BLOCK_SIZE_K=128, SPLIT_K=2)),
    "bm64-split4-pdl": lambda: _cfg(dict(BLOCK_SIZE_N=64, BLOCK_SIZE_K=64, GROUP_SIZE_M=8),
                                    dict(BLOCK_SIZE_N=128, BLOCK_SIZE_K=64, GROUP_SIZE_M=8, SPLIT_K=4, PDL=_pdl()), 64),
}
_weights_cache = {}


def _weights(name, E, H, I, gen):
    if name not in _weights_cache:
        _weights_cache.clear()
        torch.cuda.empty_cache()
        w13 = torch.randn(E, 2 * I, H, device="cuda", generator=gen).mul_(H ** -0.5).bfloat16()
        w2 = torch.randn(E, H, I, device="cuda", generator=gen).mul_(I ** -0.5).bfloat16()
        _weights_cache[name] = ExpertWeights(w13, w2)
    return _weights_cache[name]


def _routing(T, E, k, gen):
    ids = torch.rand(T, E, device="cuda", generator=gen).topk(k, dim=1).indices.to(torch.int32)
    return torch.rand(T, k, device="cuda", generator=gen) + 0.05, ids


def _run(x, wts, w, ids, cfg, direct):
    return fused_moe(x, wts.w13, wts.w2, None, None, w, ids, None, "silu", config=cfg, direct=direct,
                     out_dtype=x.dtype)


def _check(x, wts, w, ids, cfg, direct):
    torch.empty(256 * 2**20 // 4, device="cuda").fill_(float("nan"))  # unwritten outputs show as NaN
    out = _run(x, wts, w, ids, cfg, direct)
    ref = reference_experts(x, wts, w, ids)
    assert out.dtype == x.dtype and torch.isfinite(out).all()
    assert rel_err(out, ref) <= TOL[x.dtype], rel_err(out, ref)


@pytest.mark.parametrize("variant", list(DIRECT))
@pytest.mark.parametrize("shape", SHAPES, ids=[s[0] for s in SHAPES])
def test_direct_variants_on_perf_shapes(shape, variant, cuda_gen):
    name, E, k, H, I = shape
    wts = _weights(name, E, H, I, cuda_gen)
    w, ids = _routing(1, E, k, cuda_gen)
    _check(torch.randn(1, H, device="cuda", generator=cuda_gen).bfloat16(), wts, w, ids, DIRECT[variant](), True)


@pytest.mark.parametrize("M", [16, 256])
@pytest.mark.parametrize("variant", list(SORTED))
@pytest.mark.parametrize("shape", SHAPES, ids=[s[0] for s in SHAPES])
def test_sorted_split_on_perf_shapes(shape, variant, M, cuda_gen):
    name, E, k, H, I = shape
    wts = _weights(name, E, H, I, cuda_gen)
    w, ids = _routing(M, E, k, cuda_gen)
    _check(torch.randn(M, H, device="cuda", generator=cuda_gen).bfloat16(), wts, w, ids, SORTED[variant](), False)


@pytest.mark.parametrize("M,variant", [(1, "gemv-split8-pdl"), (1, "dot-split16-pdl"), (1, "fused-pdl"),
                                       (1, "gemv-split4-pre2-pdl"), (1, "dot-split4-pre1-pdl"),
                                       (256, "bm64-split4-pdl")])
def test_split_results_are_bit_identical_run_to_run(M, variant, cuda_gen):
    # Partials arrive in a different order on every run; the last arriver sums them in split order.
    name, E, k, H, I = SHAPES[1]
    wts = _weights(name, E, H, I, cuda_gen)
    w, ids = _routing(M, E, k, cuda_gen)
    x = torch.randn(M, H, device="cuda", generator=cuda_gen).bfloat16()
    cfg = (DIRECT if M == 1 else SORTED)[variant]()
    first = _run(x, wts, w, ids, cfg, M == 1)
    for _ in range(20):
        assert torch.equal(_run(x, wts, w, ids, cfg, M == 1), first)


@pytest.mark.parametrize("M,variant", [(1, "gemv-split8-pdl"), (1, "fused-pdl"), (1, "gemv-split4-pre2-pdl"),
                                       (64, "bm64-split4-pdl")])
def test_cuda_graph_replays_with_fresh_routing(M, variant, cuda_gen):
    name, E, k, H, I = SHAPES[3]
    wts = _weights(name, E, H, I, cuda_gen)
    cfg = (DIRECT if M == 1 else SORTED)[variant]()
    x = torch.randn(M, H, device="cuda", generator=cuda_gen).bfloat16()
    w, ids = _routing(M, E, k, cuda_gen)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        _run(x, wts, w, ids, cfg, M == 1)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _run(x, wts, w, ids, cfg, M == 1)
    for _ in range(3):
        x.copy_(torch.randn(M, H, device="cuda", generator=cuda_gen))
        w_new, ids_new = _routing(M, E, k, cuda_gen)
        w.copy_(w_new)
        ids.copy_(ids_new)
        graph.replay()
        assert torch.equal(out, _run(x, wts, w, ids, cfg, M == 1))
        assert rel_err(out, reference_experts(x, wts, w, ids)) <= TOL[torch.bfloat16]

"""moekit's 16-bit CUDA experts kernels (kernels/hopper_block.py dense_*) on a Hopper GPU: against
the fp32 reference (PERF.md tolerances) and the Triton experts, run to run, and in a CUDA graph
with new routing. Run with `pytest -m gpu tests/kernels`."""

import pytest
import torch

from conftest import TOL, rel_err, random_expert_map

pytest.importorskip("triton")

from moekit import fused_experts  # noqa: E402
from moekit.config import settings  # noqa: E402
from moekit.experts.base import ExpertWeights  # noqa: E402
from moekit.experts.reference import reference_experts  # noqa: E402
from moekit.kernels import hopper_block  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(settings.triton_interpret, reason="TRITON_INTERPRET=1 is set"),
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                                 reason="the CUDA kernels need a Hopper GPU"),
              pytest.mark.skipif(hopper_block.load() is None, reason=hopper_block.status())]


def _problem(T, E, k, H, I, dtype, gen, n_remote=0, skewed=False):
    w13 = (torch.randn(E, 2 * I, H, device="cuda", generator=gen) * H ** -0.5).to(dtype)
    w2 = (torch.randn(E, H, I, device="cuda", generator=gen) * I ** -0.5).to(dtype)
    emap = random_expert_map(E, n_remote, gen, "cuda")
    scores = torch.rand(T, E + n_remote, device="cuda", generator=gen)
    if skewed:  # most tokens on a few experts, some experts with none
        scores[:, : (E + n_remote) // 4] += 2.0
    ids = scores.topk(k, dim=1).indices.to(torch.int32)
    w = torch.rand(T, k, device="cuda", generator=gen) + 0.05
    x = torch.randn(T, H, device="cuda", generator=gen).to(dtype)
    return x, w13, w2, w, ids, emap


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("T,E,k,H,I,n_remote,skewed", [
    (1, 8, 2, 256, 256, 0, False),
    (5, 4, 2, 384, 192, 0, False),       # I = 3 x 64 (odd column items), H = 3 x 128
    (37, 16, 4, 512, 256, 3, False),      # expert map: a few experts on another rank
    (300, 16, 1, 768, 512, 0, True),      # k = 1, experts without tokens
    (700, 32, 8, 1024, 768, 0, False),    # tiles of 64 and 128 rows
    (2000, 8, 2, 2048, 1536, 0, True),    # several tiles an expert
    (900, 160, 6, 512, 256, 0, False),    # more experts than a warp's lanes hold one each
], ids=["T1", "T37-expert-map", "T300-k1-skewed", "T700-k8", "T2000-skewed", "T900-E160"])
def test_dense_matches_the_reference_and_triton(T, E, k, H, I, n_remote, skewed, dtype, cuda_gen):
    x, w13, w2, w, ids, emap = _problem(T, E, k, H, I, dtype, cuda_gen, n_remote, skewed)
    out = hopper_block.dense_experts(x, w13, w2, w, ids, emap)
    assert out.shape == (T, H) and out.dtype == dtype and torch.isfinite(out).all()
    ref = reference_experts(x, ExpertWeights(w13, w2), w, ids, expert_map=emap)
    assert rel_err(out, ref) <= TOL[dtype], rel_err(out, ref)
    tri = fused_experts(x, w13, w2, w, ids, expert_map=emap, backend="triton")
    assert rel_err(out, tri) <= TOL[dtype]
    assert torch.equal(out, hopper_block.dense_experts(x, w13, w2, w, ids, emap))  # run to run


def test_dense_no_tokens(cuda_gen):
    x, w13, w2, w, ids, emap = _problem(0, 8, 2, 256, 256, torch.bfloat16, cuda_gen)
    assert hopper_block.dense_experts(x, w13, w2, w, ids).shape == (0, 256)


def test_dense_qwen3_sized_experts_in_a_cuda_graph(cuda_gen):
    T, E, k, H, I = 2048, 128, 8, 2048, 768
    x, w13, w2, w, ids, _ = _problem(T, E, k, H, I, torch.bfloat16, cuda_gen)
    ref = reference_experts(x, ExpertWeights(w13, w2), w, ids)
    assert rel_err(hopper_block.dense_experts(x, w13, w2, w, ids), ref) <= TOL[torch.bfloat16]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = hopper_block.dense_experts(x, w13, w2, w, ids)
    _, _, _, w_new, ids_new, _ = _problem(T, E, k, H, I, torch.bfloat16, cuda_gen, skewed=True)
    w.copy_(w_new)
    ids.copy_(ids_new)
    graph.replay()
    assert torch.equal(out, hopper_block.dense_experts(x, w13, w2, w, ids))


def test_dense_refusals():
    dev = torch.device("cuda")
    assert "bfloat16 or float16" in hopper_block.dense_refusal(dev, torch.float32, 8, 256, 256)
    assert "multiple of" in hopper_block.dense_refusal(dev, torch.bfloat16, 8, 2880, 2880 + 32)
    assert "at most" in hopper_block.dense_refusal(dev, torch.bfloat16, 2048, 256, 256)
    assert hopper_block.dense_refusal(dev, torch.bfloat16, 8, 256, 256) is None

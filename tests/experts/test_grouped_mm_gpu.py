"""`grouped_mm` on CUDA (gpu mark; SM90): bf16 against the fp32 reference, expert maps and
empty experts included, and a CUDA graph of the call replayed with new routing."""

import pytest
import torch

from moekit import ExpertWeights, RoutingConfig, fused_experts, route
from moekit.experts.reference import reference_experts

from conftest import TOL, rel_err

pytestmark = pytest.mark.gpu


def _problem(T, E, H, I, k, gen, expert_map=None):
    dev = "cuda"
    x = torch.randn(T, H, generator=gen, device=dev).bfloat16()
    w13 = (torch.randn(E, 2 * I, H, generator=gen, device=dev) * H ** -0.5).bfloat16()
    w2 = (torch.randn(E, H, I, generator=gen, device=dev) * I ** -0.5).bfloat16()
    E_ids = E if expert_map is None else expert_map.numel()
    w, ids = route(torch.randn(T, E_ids, generator=gen, device=dev), RoutingConfig(top_k=k))
    return x, ExpertWeights(w13, w2), w, ids


@pytest.fixture
def sm90():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("torch's CUDA grouped_mm needs compute capability 9.0")


@pytest.mark.parametrize("T", [1, 7, 300])
@pytest.mark.parametrize("mapped", [False, True], ids=["all-local", "expert-map"])
def test_grouped_mm_on_cuda_matches_reference(sm90, cuda_gen, T, mapped):
    E, H, I, k = 8, 256, 128, 2
    emap = None
    if mapped:  # 16 global experts, 8 of them here
        emap = torch.full((16,), -1, dtype=torch.int32, device="cuda")
        emap[torch.randperm(16, device="cuda", generator=cuda_gen)[:E]] = torch.arange(E, dtype=torch.int32,
                                                                                    device="cuda")
    x, weights, w, ids = _problem(T, E, H, I, k, cuda_gen, emap)
    out = fused_experts(x, weights, None, w, ids, backend="grouped_mm", expert_map=emap)
    ref = reference_experts(x, weights, w, ids, expert_map=emap)
    assert rel_err(out, ref) <= TOL[torch.bfloat16]


def test_grouped_mm_call_replays_in_a_cuda_graph(sm90, cuda_gen):
    T, E, H, I, k = 64, 8, 256, 128, 2
    x, weights, w, ids = _problem(T, E, H, I, k, cuda_gen)
    call = lambda: fused_experts(x, weights, None, w, ids, backend="grouped_mm")  # noqa: E731
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()  # warm-up outside capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    for _ in range(2):  # new routing in the captured buffers, then replay
        _, _, w_new, ids_new = _problem(T, E, H, I, k, cuda_gen)
        w.copy_(w_new)
        ids.copy_(ids_new)
        graph.replay()
        assert torch.equal(out, call())

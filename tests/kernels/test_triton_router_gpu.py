"""The one-launch router on a CUDA GPU: route() takes it there, and it gives the torch router's
ids (bit for bit: both take libdevice's exp) and weights within an ulp or two; NaN logits raise;
CUDA-graph capture and replay. Run with `pytest -m gpu tests/kernels`."""

import math

import pytest
import torch

pytest.importorskip("triton")

from moekit import RoutingConfig, route  # noqa: E402
from moekit.config import settings  # noqa: E402
from moekit.routing import router  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(settings.triton_interpret, reason="TRITON_INTERPRET=1 is set")]

CONFIGS = [
    ("mixtral", dict(top_k=2), 8, False),
    ("qwen3", dict(top_k=8), 128, False),
    ("olmoe no renorm", dict(top_k=8, renormalize=False), 64, False),
    ("deepseek-v3", dict(top_k=8, scoring="sigmoid", num_expert_group=8, topk_group=4, routed_scaling_factor=2.5),
     256, True),
    ("deepseek-v2", dict(top_k=6, num_expert_group=8, topk_group=3, renormalize=False, routed_scaling_factor=16.0),
     160, False),
    ("sqrtsoftplus", dict(top_k=6, scoring="sqrtsoftplus"), 72, False),
    ("gpt-oss", dict(top_k=4, order="topk_then_softmax"), 32, False),
    ("llama4", dict(top_k=1, order="topk_then_sigmoid", renormalize=False, apply_router_weight_on_input=True), 16,
     False),
    ("cohere2-sigmoid", dict(top_k=8, order="topk_then_sigmoid", renormalize=True), 128, False),
    ("qwen3-next", dict(top_k=10), 512, False),
]


def _logits(kind, T, E, gen):
    if kind == "randn":
        return torch.randn(T, E, device="cuda", generator=gen) * 2
    # bf16 on a coarse grid: exact ties in every row
    return (torch.randint(-3, 4, (T, E), device="cuda", generator=gen).float() * 0.5).bfloat16()


@pytest.mark.parametrize("kind", ["randn", "ties"])
@pytest.mark.parametrize("T", [1, 16, 256, 4096])
@pytest.mark.parametrize("name,kw,E,use_bias", CONFIGS, ids=[c[0] for c in CONFIGS])
def test_kernel_route_matches_torch_route(name, kw, E, use_bias, T, kind, cuda_gen):
    cfg = RoutingConfig(**kw)
    z = _logits(kind, T, E, cuda_gen)
    bias = None
    if use_bias:
        bias = (torch.randn(E, device="cuda", generator=cuda_gen) * 0.05 if kind == "randn" else
                torch.randint(-1, 2, (E,), device="cuda", generator=cuda_gen).float() * 0.25)
    assert router._kernel_routes(z, cfg, bias)
    w, ids = route(z, cfg, bias)
    w_ref, ids_ref = router.route_torch(z, cfg, bias)
    assert torch.equal(ids, ids_ref)
    torch.testing.assert_close(w, w_ref, rtol=1e-6, atol=1e-30)


def test_nan_logits_raise_on_cuda():
    z = torch.randn(5, 64, device="cuda")
    z[3, 7] = math.nan
    with pytest.raises(ValueError, match="NaN"):
        route(z, RoutingConfig(top_k=4))


def test_torch_path_where_the_kernel_cannot():
    z = torch.randn(4, 16, device="cuda", requires_grad=True)
    cfg = RoutingConfig(top_k=2)
    assert not router._kernel_routes(z, cfg, None)  # autograd through the logits
    w, _ = route(z, cfg)
    w.sum().backward()
    assert z.grad is not None
    custom = RoutingConfig(top_k=2, custom=lambda h, lg, k: torch.topk(lg, k, dim=-1))
    assert not router._kernel_routes(z.detach(), custom, None)


def test_route_in_a_cuda_graph(cuda_gen):
    cfg = RoutingConfig(top_k=8, scoring="sigmoid", num_expert_group=8, topk_group=4, routed_scaling_factor=2.5)
    bias = torch.randn(256, device="cuda", generator=cuda_gen) * 0.05
    z = torch.randn(64, 256, device="cuda", generator=cuda_gen)
    route(z, cfg, bias)  # compiles outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        w, ids = route(z, cfg, bias)
    for _ in range(3):
        z.copy_(torch.randn(64, 256, device="cuda", generator=cuda_gen))
        g.replay()
        w_ref, ids_ref = router.route_torch(z, cfg, bias)
        assert torch.equal(ids, ids_ref)
        torch.testing.assert_close(w, w_ref, rtol=1e-6, atol=1e-30)

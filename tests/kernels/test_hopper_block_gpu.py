"""moekit's CUDA kernels of the 128 x 128 block-scaled fp8 scheme (kernels/hopper_block.py,
QuantKnobs.cuda) on a Hopper GPU: against the emulated reference (PERF.md tolerances) and the
Gluon kernels of the same call, run to run, in CUDA graphs with new routing. Run with
`pytest -m gpu tests/kernels`."""

import pytest
import torch

from conftest import rel_err, triton_act_dtype

pytest.importorskip("triton")

from moekit.config import settings  # noqa: E402
from moekit.kernels import gluon_block, hopper_block  # noqa: E402
from moekit.kernels.launch_quant import fused_moe_quant  # noqa: E402
from moekit.kernels.quant_tuning import QuantKnobs  # noqa: E402
from moekit.quant import TOLERANCE, emulated_experts, scheme_of  # noqa: E402
from test_gluon_block_gpu import _cases, _routing, _weights  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(settings.triton_interpret, reason="TRITON_INTERPRET=1 is set"),
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                                 reason="the CUDA kernels need a Hopper GPU"),
              pytest.mark.skipif(gluon_block.GLUON_MISSING is not None, reason=str(gluon_block.GLUON_MISSING)),
              pytest.mark.skipif(hopper_block.load() is None, reason=hopper_block.status())]


def _run(wts, x, w, ids, emap=None, cuda="on", rows=128, cublas1="off"):
    s = wts.scales
    return fused_moe_quant(x, wts.w13, wts.w2, None, None, s["w13_scale"], s["w2_scale"], None, None, None, None, w,
                           ids, emap, scheme_of(wts), "silu", knobs=QuantKnobs(gluon=rows, cublas1=cublas1, cuda=cuda),
                           out_dtype=x.dtype)


@pytest.mark.parametrize("T,E,k,H,I,n_remote,skewed", [
    (0, 8, 2, 256, 256, 0, False),
    (1, 8, 2, 256, 256, 0, False),
    (37, 16, 4, 512, 256, 3, False),      # expert map: a few experts on another rank
    (300, 16, 1, 768, 512, 0, True),      # k = 1, experts without tokens
    (700, 32, 8, 1024, 768, 0, False),    # several tiles an expert, I = 768 (six K steps in GEMM2)
    (2000, 8, 2, 2048, 1536, 0, True),
    (900, 160, 6, 512, 256, 0, False),    # more experts than a warp's lanes hold one each (the schedule's scan)
], ids=["T0", "T1", "T37-expert-map", "T300-k1-skewed", "T700-k8", "T2000-skewed", "T900-E160"])
def test_cuda_block_matches_the_reference_and_the_gluon_kernels(T, E, k, H, I, n_remote, skewed, cuda_gen):
    for wts, emap, w, ids, x, ref in _cases(T, E, k, H, I, n_remote, skewed, cuda_gen):
        out = _run(wts, x, w, ids, emap)
        assert out.shape == (T, H) and out.dtype == x.dtype and torch.isfinite(out).all()
        if T:
            assert rel_err(out, ref) <= TOLERANCE["fp8"], rel_err(out, ref)
            assert rel_err(out, _run(wts, x, w, ids, emap, cuda="off")) <= TOLERANCE["fp8"]
            assert torch.equal(out, _run(wts, x, w, ids, emap))  # run to run
            mixed = _run(wts, x, w, ids, emap, cuda="gemm1")  # GEMM2 on the Gluon kernel
            assert rel_err(mixed, ref) <= TOLERANCE["fp8"], rel_err(mixed, ref)


def test_cuda_block_deepseek_v3_sized_experts_in_a_cuda_graph(cuda_gen):
    E, k, H, I, T = 32, 8, 7168, 2048, 1024
    wts = _weights(E, H, I, cuda_gen)
    w, ids = _routing(T, E, k, cuda_gen)
    x = torch.randn(T, H, device="cuda", generator=cuda_gen).bfloat16()
    ref = emulated_experts(x, wts, w, ids, act_dtype=triton_act_dtype(wts, x))
    eager = _run(wts, x, w, ids)
    assert rel_err(eager, ref) <= TOLERANCE["fp8"]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _run(wts, x, w, ids)
    w2, ids2 = _routing(T, E, k, cuda_gen, skewed=True)
    w.copy_(w2)
    ids.copy_(ids2)
    graph.replay()
    assert torch.equal(out, _run(wts, x, w, ids))


def test_auto_takes_the_cuda_kernels_on_128_row_tiles(cuda_gen):
    wts = _weights(8, 512, 256, cuda_gen)
    w, ids = _routing(600, 8, 2, cuda_gen)
    x = torch.randn(600, 512, device="cuda", generator=cuda_gen).bfloat16()
    assert torch.equal(_run(wts, x, w, ids, cuda="auto"), _run(wts, x, w, ids, cuda="on"))


def test_explicit_cuda_knob_refused_with_the_reason(cuda_gen):
    wts = _weights(8, 256, 256, cuda_gen)
    w, ids = _routing(64, 8, 2, cuda_gen)
    x = torch.randn(64, 256, device="cuda", generator=cuda_gen).bfloat16()
    with pytest.raises(ValueError, match="knobs.cuda='on' .*128-row tiles, got 64"):
        _run(wts, x, w, ids, rows=64)


@pytest.mark.parametrize("T,E,k,H,I", [(700, 32, 8, 1024, 768), (2000, 8, 2, 2048, 1536), (5, 4, 2, 512, 256)])
def test_cta_pairs_sharing_a_tiles_give_single_ctas_bits(T, E, k, H, I, cuda_gen, monkeypatch):
    wts = _weights(E, H, I, cuda_gen)
    w, ids = _routing(T, E, k, cuda_gen, skewed=True)
    x = torch.randn(T, H, device="cuda", generator=cuda_gen).bfloat16()
    monkeypatch.setattr(hopper_block, "CLUSTER", 2)
    pairs = _run(wts, x, w, ids)
    monkeypatch.setattr(hopper_block, "CLUSTER", 1)
    assert torch.equal(pairs, _run(wts, x, w, ids))


@pytest.mark.parametrize("T,E,k,H,I", [(700, 32, 8, 1024, 768), (300, 16, 1, 768, 512)])
def test_k_steps_in_pairs_give_one_step_at_a_times_bits(T, E, k, H, I, cuda_gen, monkeypatch):
    wts = _weights(E, H, I, cuda_gen)
    w, ids = _routing(T, E, k, cuda_gen, skewed=True)
    x = torch.randn(T, H, device="cuda", generator=cuda_gen).bfloat16()
    monkeypatch.setattr(hopper_block, "PIPELINED", True)
    pairs = _run(wts, x, w, ids)
    monkeypatch.setattr(hopper_block, "PIPELINED", False)
    assert torch.equal(pairs, _run(wts, x, w, ids))


def test_cuda_and_cublas_both_on_is_refused(cuda_gen):
    wts = _weights(8, 256, 256, cuda_gen)
    w, ids = _routing(64, 8, 2, cuda_gen)
    x = torch.randn(64, 256, device="cuda", generator=cuda_gen).bfloat16()
    with pytest.raises(ValueError, match="cuda='on' and knobs.cublas1='on' both ask for GEMM1"):
        _run(wts, x, w, ids, cublas1="on")


def test_auto_takes_the_cuda_kernels_over_the_cublas_rule(cuda_gen, monkeypatch):
    from moekit.kernels import cublas_block  # noqa: PLC0415

    if cublas_block.refusal(torch.device("cuda"), 512, 256) is not None:
        pytest.skip(cublas_block.refusal(torch.device("cuda"), 512, 256))
    monkeypatch.setattr(cublas_block, "CUBLAS_MIN_FLOP", 0)  # small products, to keep the test quick
    E, k, H, I, T = 8, 2, 512, 512, 2048
    wts = _weights(E, H, I, cuda_gen)
    w, ids = _routing(T, E, k, cuda_gen)
    x = torch.randn(T, H, device="cuda", generator=cuda_gen).bfloat16()
    assert torch.equal(_run(wts, x, w, ids, cuda="auto", cublas1="auto"), _run(wts, x, w, ids))
    assert torch.equal(_run(wts, x, w, ids, cuda="on", cublas1="auto"), _run(wts, x, w, ids))
    # cuBLAS where its rule wants it with the CUDA kernels off, or over "auto" when asked for
    on_cublas = _run(wts, x, w, ids, cuda="off", cublas1="on")
    assert torch.equal(_run(wts, x, w, ids, cuda="off", cublas1="auto"), on_cublas)
    assert torch.equal(_run(wts, x, w, ids, cuda="auto", cublas1="on"), on_cublas)

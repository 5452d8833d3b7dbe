"""The Gluon kernels of the 128 x 128 block-scaled fp8 scheme (QuantKnobs.gluon) on a Hopper GPU
against the emulated reference (PERF.md tolerances) and against the Triton tiles, in CUDA graphs,
run to run. Run with `pytest -m gpu tests/kernels`."""

import pytest
import torch

from conftest import rel_err, random_expert_map, triton_act_dtype

pytest.importorskip("triton")

from moekit.config import settings  # noqa: E402
from moekit.kernels import cublas_block, cublaslt, gluon_block  # noqa: E402
from moekit.kernels.launch_quant import fused_moe_quant  # noqa: E402
from moekit.kernels.quant_tuning import QuantKnobs  # noqa: E402
from moekit.quant import TOLERANCE, emulated_experts, quantize_experts, scheme_of  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(settings.triton_interpret, reason="TRITON_INTERPRET=1 is set"),
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                                 reason="the Gluon kernels need a Hopper GPU"),
              pytest.mark.skipif(gluon_block.GLUON_MISSING is not None, reason=str(gluon_block.GLUON_MISSING))]

SCHEME = "fp8_w8a8_block128"
CUBLAS_REFUSAL = cublas_block.refusal(torch.device("cuda"), 512, 256) if torch.cuda.is_available() else "no CUDA GPU"


def _weights(E, H, I, gen):
    w13 = torch.randn(E, 2 * I, H, device="cuda", generator=gen) * H ** -0.5
    w2 = torch.randn(E, H, I, device="cuda", generator=gen) * I ** -0.5
    return quantize_experts(w13, w2, SCHEME)


def _routing(T, E_global, k, gen, skewed=False):
    scores = torch.rand(T, E_global, device="cuda", generator=gen)
    if skewed:  # most tokens on a few experts, some experts with none
        scores[:, : E_global // 4] += 2.0
    return torch.rand(T, k, device="cuda", generator=gen) + 0.05, scores.topk(k, dim=1).indices.to(torch.int32)


def _run(wts, x, w, ids, emap=None, rows=0, cublas1="auto", cuda="off"):
    """The call on the Gluon kernels (cuda="off": moekit's CUDA kernels are tested in test_hopper_block_gpu.py)."""
    s = wts.scales
    return fused_moe_quant(x, wts.w13, wts.w2, None, None, s["w13_scale"], s["w2_scale"], None, None, None, None, w,
                           ids, emap, scheme_of(wts), "silu", knobs=QuantKnobs(gluon=rows, cublas1=cublas1, cuda=cuda),
                           out_dtype=x.dtype)


def _poison_allocator():
    torch.empty(256 * 2**20 // 4, device="cuda").fill_(float("nan"))


def _cases(T, E, k, H, I, n_remote, skewed, gen):
    """(weights, expert map, routing weights, ids, x, emulated reference) for bf16 and fp16 x, the
    allocator's free memory poisoned with NaN just before each is handed out."""
    wts = _weights(E, H, I, gen)
    emap = random_expert_map(E, n_remote, gen, "cuda")
    w, ids = _routing(T, E + n_remote, k, gen, skewed)
    for dtype in (torch.bfloat16, torch.float16):
        x = torch.randn(T, H, device="cuda", generator=gen).to(dtype)
        ref = emulated_experts(x, wts, w, ids, expert_map=emap, act_dtype=triton_act_dtype(wts, x))
        _poison_allocator()
        yield wts, emap, w, ids, x, ref


@pytest.mark.parametrize("rows", [64, 128])
@pytest.mark.parametrize("T,E,k,H,I,n_remote,skewed", [
    (0, 8, 2, 256, 256, 0, False),
    (1, 8, 2, 256, 256, 0, False),
    (37, 16, 4, 512, 256, 3, False),      # expert map: a few experts on another rank
    (300, 16, 1, 768, 512, 0, True),      # k = 1, experts without tokens
    (700, 32, 8, 1024, 768, 0, False),    # several tiles an expert, odd numbers of K steps in pairs (I = 768)
    (2000, 8, 2, 2048, 1536, 0, True),
], ids=["T0", "T1", "T37-expert-map", "T300-k1-skewed", "T700-k8", "T2000-skewed"])
def test_gluon_block_matches_emulated_reference(rows, T, E, k, H, I, n_remote, skewed, cuda_gen):
    for wts, emap, w, ids, x, ref in _cases(T, E, k, H, I, n_remote, skewed, cuda_gen):
        out = _run(wts, x, w, ids, emap, rows)
        dtype = x.dtype
        assert out.shape == (T, H) and out.dtype == dtype and torch.isfinite(out).all()
        if T:
            assert rel_err(out, ref) <= TOLERANCE["fp8"], rel_err(out, ref)
            # the Triton tiles of the same call agree as closely as either does with the reference
            assert rel_err(out, _run(wts, x, w, ids, emap, 0)) <= TOLERANCE["fp8"]


def test_gluon_block_deepseek_v3_sized_experts_in_a_cuda_graph(cuda_gen):
    E, k, H, I, T = 32, 8, 7168, 2048, 512
    wts = _weights(E, H, I, cuda_gen)
    w, ids = _routing(T, E, k, cuda_gen)
    x = torch.randn(T, H, device="cuda", generator=cuda_gen).bfloat16()
    ref = emulated_experts(x, wts, w, ids, act_dtype=triton_act_dtype(wts, x))
    eager = _run(wts, x, w, ids, rows=128)
    assert rel_err(eager, ref) <= TOLERANCE["fp8"]
    assert torch.equal(eager, _run(wts, x, w, ids, rows=128))  # run to run
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _run(wts, x, w, ids, rows=128)
    w2, ids2 = _routing(T, E, k, cuda_gen)
    w.copy_(w2)
    ids.copy_(ids2)
    graph.replay()
    assert torch.equal(out, _run(wts, x, w, ids, rows=128))


def test_explicit_gluon_knob_refused_with_the_reason(cuda_gen):
    wts = _weights(8, 256, 256, cuda_gen)
    w, ids = _routing(4, 8, 2, cuda_gen)
    x = torch.randn(4, 256, device="cuda", generator=cuda_gen).bfloat16()
    s = wts.scales
    with pytest.raises(ValueError, match="knobs.gluon=128 .*silu"):
        fused_moe_quant(x, wts.w13, wts.w2, None, None, s["w13_scale"], s["w2_scale"], None, None, None, None, w, ids,
                        None, scheme_of(wts), "gelu", knobs=QuantKnobs(gluon=128), out_dtype=x.dtype)


@pytest.mark.skipif(CUBLAS_REFUSAL is not None, reason=str(CUBLAS_REFUSAL))
@pytest.mark.parametrize("T,E,k,H,I,n_remote,skewed", [
    (1, 8, 2, 512, 256, 0, False),
    (37, 16, 4, 512, 512, 3, False),      # expert map
    (300, 16, 1, 1024, 512, 0, True),     # k = 1, experts without tokens
    (700, 32, 8, 1024, 768, 0, False),
    (3000, 8, 2, 2048, 1536, 0, True),    # the rule's own sizes (750 rows an expert)
], ids=["T1", "T37-expert-map", "T300-k1-skewed", "T700-k8", "T3000-skewed"])
def test_cublas_gemm1_matches_the_reference_and_the_gluon_gemm1(T, E, k, H, I, n_remote, skewed, cuda_gen):
    for wts, emap, w, ids, x, ref in _cases(T, E, k, H, I, n_remote, skewed, cuda_gen):
        out = _run(wts, x, w, ids, emap, 128, cublas1="on")
        dtype = x.dtype
        assert out.shape == (T, H) and out.dtype == dtype and torch.isfinite(out).all()
        assert rel_err(out, ref) <= TOLERANCE["fp8"], rel_err(out, ref)
        assert rel_err(out, _run(wts, x, w, ids, emap, 128, cublas1="off")) <= TOLERANCE["fp8"]
        assert torch.equal(out, _run(wts, x, w, ids, emap, 128, cublas1="on"))  # run to run


@pytest.mark.skipif(CUBLAS_REFUSAL is not None, reason=str(CUBLAS_REFUSAL))
@pytest.mark.skipif(cublaslt.refusal() is not None, reason=str(cublaslt.refusal()))
@pytest.mark.parametrize("T,E,k,H,I,skewed", [(37, 16, 4, 512, 512, False), (3000, 8, 2, 2048, 1536, True),
                                              (700, 32, 8, 1024, 768, False)])
def test_cublaslt_called_directly_gives_torchs_bits(T, E, k, H, I, skewed, cuda_gen, monkeypatch):
    """The products through cublaslt.py and through torch._scaled_mm: same algorithm choice
    aside, the same recipe; the layer's output must agree to the bit."""
    wts = _weights(E, H, I, cuda_gen)
    w, ids = _routing(T, E, k, cuda_gen, skewed)
    x = torch.randn(T, H, device="cuda", generator=cuda_gen).bfloat16()
    assert cublaslt.engine(torch.device("cuda"), 2 * I, H, torch.bfloat16) is not None
    direct = _run(wts, x, w, ids, rows=128, cublas1="on")
    monkeypatch.setattr(cublas_block, "USE_DIRECT", False)
    via_torch = _run(wts, x, w, ids, rows=128, cublas1="on")
    ref = emulated_experts(x, wts, w, ids, act_dtype=triton_act_dtype(wts, x))
    assert rel_err(direct, ref) <= TOLERANCE["fp8"] and rel_err(via_torch, ref) <= TOLERANCE["fp8"]
    assert torch.equal(direct, via_torch), rel_err(direct, via_torch)


@pytest.mark.skipif(CUBLAS_REFUSAL is not None, reason=str(CUBLAS_REFUSAL))
@pytest.mark.skipif(cublaslt.refusal() is not None, reason=str(cublaslt.refusal()))
def test_a_cublaslt_failure_falls_back_to_torch_for_every_product(cuda_gen, monkeypatch, caplog):
    """cuBLASLt refusing a product halfway (some products already enqueued): the call redoes every
    product through torch._scaled_mm, says so once, and keeps to torch for that shape."""
    E, k, H, I, T = 8, 2, 512, 512, 700
    wts = _weights(E, H, I, cuda_gen)
    w, ids = _routing(T, E, k, cuda_gen)
    x = torch.randn(T, H, device="cuda", generator=cuda_gen).bfloat16()
    monkeypatch.setattr(cublas_block, "USE_DIRECT", False)
    via_torch = _run(wts, x, w, ids, rows=128, cublas1="on")
    monkeypatch.setattr(cublas_block, "USE_DIRECT", True)
    monkeypatch.setattr(cublas_block, "_DIRECT_FAILED", {})
    real, calls = cublaslt.BlockScaledFp8.__call__, []

    def failing(self, m, *args, **kwargs):
        calls.append(m)
        if len(calls) == 3:
            raise RuntimeError("cuBLASLt product failed with status 13")
        return real(self, m, *args, **kwargs)
    monkeypatch.setattr(cublaslt.BlockScaledFp8, "__call__", failing)
    with caplog.at_level("WARNING", logger="moekit"):
        out = _run(wts, x, w, ids, rows=128, cublas1="on")
    assert torch.equal(out, via_torch)
    assert "status 13" in caplog.text and "through torch._scaled_mm from now on" in caplog.text
    assert len(calls) == 3
    assert torch.equal(_run(wts, x, w, ids, rows=128, cublas1="on"), via_torch) and len(calls) == 3


@pytest.mark.skipif(CUBLAS_REFUSAL is not None, reason=str(CUBLAS_REFUSAL))
def test_cublas_gemm1_steps_aside_in_cuda_graph_capture(cuda_gen, monkeypatch):
    """The rule's sizes take cuBLAS eagerly; captured, the same call runs the Gluon GEMM1 (the
    host cannot read the row counts), and an explicit "on" says why it cannot."""
    E, k, H, I, T = 8, 2, 512, 512, 2048
    monkeypatch.setattr(cublas_block, "CUBLAS_MIN_FLOP", 0)  # small products, to keep the test quick
    assert cublas_block.wanted(T, k, E, H, I, torch.device("cuda"))
    wts = _weights(E, H, I, cuda_gen)
    w, ids = _routing(T, E, k, cuda_gen)
    x = torch.randn(T, H, device="cuda", generator=cuda_gen).bfloat16()
    assert torch.equal(_run(wts, x, w, ids, rows=128), _run(wts, x, w, ids, rows=128, cublas1="on"))
    gluon = _run(wts, x, w, ids, rows=128, cublas1="off")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _run(wts, x, w, ids, rows=128)
    graph.replay()
    assert torch.equal(out, gluon)
    with pytest.raises(ValueError, match="cublas1='on' cannot run .* CUDA-graph capture"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            _run(wts, x, w, ids, rows=128, cublas1="on")


@pytest.mark.skipif(CUBLAS_REFUSAL is not None, reason=str(CUBLAS_REFUSAL))
def test_cublas_gemm1_refuses_scale_rows_cublas_misreads(cuda_gen):
    wts = _weights(8, 768, 256, cuda_gen)  # H / 128 = 6 blocks a scale row: cuBLAS computed garbage
    w, ids = _routing(64, 8, 2, cuda_gen)
    x = torch.randn(64, 768, device="cuda", generator=cuda_gen).bfloat16()
    with pytest.raises(ValueError, match="H and 2I must be multiples of 512"):
        _run(wts, x, w, ids, rows=128, cublas1="on")
    ref = emulated_experts(x, wts, w, ids, act_dtype=triton_act_dtype(wts, x))
    assert rel_err(_run(wts, x, w, ids, rows=128), ref) <= TOLERANCE["fp8"]  # "auto": the Gluon GEMM1

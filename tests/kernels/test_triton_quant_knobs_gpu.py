"""The quantized Triton experts' variants (QuantKnobs) on a CUDA GPU in bf16 (the bf16 bit
patterns of int4 weights run only here) against the emulated reference, in CUDA graphs, run
to run. Run with `pytest -m gpu tests/kernels`."""

import pytest
import torch

from conftest import rel_err, random_expert_map, triton_act_dtype

pytest.importorskip("triton")

from moekit.config import settings  # noqa: E402
from moekit.kernels.launch_quant import fused_moe_quant  # noqa: E402
from moekit.kernels.quant_tuning import QuantKnobs  # noqa: E402
from moekit.kernels.tuning import MoEConfig, TileConfig  # noqa: E402
from moekit.quant import TOLERANCE, emulated_experts, get_scheme, quantize_experts, scheme_of  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(settings.triton_interpret, reason="TRITON_INTERPRET=1 is set")]


def _weights(scheme, opts, E, H, I, gen):
    w13 = torch.randn(E, 2 * I, H, device="cuda", generator=gen) * H ** -0.5
    w2 = torch.randn(E, H, I, device="cuda", generator=gen) * I ** -0.5
    opts = dict(opts)
    if opts.pop("static", False):
        opts.update(a13_scale=torch.full((E,), 4.5 / 448, device="cuda"), a2_scale=torch.full((E,), 4.0 / 448, device="cuda"))
    return quantize_experts(w13, w2, scheme, **opts)


def _routing(T, E_global, k, gen):
    scores = torch.rand(T, E_global, device="cuda", generator=gen)
    return torch.rand(T, k, device="cuda", generator=gen) + 0.05, scores.topk(k, dim=1).indices.to(torch.int32)


def _run(wts, x, w, ids, emap=None, config=None, knobs=None):
    s = wts.scales
    return fused_moe_quant(x, wts.w13, wts.w2, None, None, s["w13_scale"], s["w2_scale"], s.get("w13_zero"),
                           s.get("w2_zero"), s.get("a13_scale"), s.get("a2_scale"), w, ids, emap, scheme_of(wts), "silu",
                           config=config, knobs=knobs, out_dtype=x.dtype)


def _tiles(bm, bn1, bk1, bn2, bk2, warps=4, stages=3):
    return MoEConfig(TileConfig(bm, bn1, bk1, 8, warps, stages), TileConfig(bm, bn2, bk2, 8, warps, stages))


# (scheme, options, tiles, knobs): decode tiles (BM 16, 8-bit products upcast) and compute
# tiles (BM >= 64, wgmma) for every knob.
VARIANTS = [
    ("int4_w4a16", {}, (16, 64, 128, 64, 128), dict(gate_up=True, prefetch1=True, prefetch2=True, split_k=4,
                                                     pdl=True)),
    ("int4_w4a16", {"group_size": 64, "symmetric": False}, (16, 32, 64, 128, 64), dict(split_k=2)),
    ("int4_w4a16", {"group_size": 32}, (32, 64, 32, 32, 32), dict(w_convert="cast", prefetch2=True)),
    ("int4_w4a16", {}, (16, 64, 128, 64, 128), dict(w_convert="ptx", gate_up=True, split_k=2, pdl=True)),
    ("int4_w4a16", {"group_size": 64, "symmetric": False}, (16, 32, 64, 128, 64), dict(w_convert="ptx")),
    ("int4_w4a16", {}, (64, 64, 128, 128, 128), dict(w_convert="ptx", prefetch1=True)),
    # paired int4 products: x prepared in the alignment's launch, offsets corrected per group
    ("int4_w4a16", {}, (16, 64, 64, 64, 128), dict(w_convert="pairs", gate_up=True, split_k=2, pdl=True)),
    ("int4_w4a16", {"group_size": 64, "symmetric": False}, (16, 32, 64, 128, 32), dict(w_convert="pairs")),
    ("int4_w4a16", {"group_size": 32}, (32, 128, 32, 64, 32), dict(w_convert="pairs_bits", gate_up=True)),
    ("int8_w8a16", {}, (16, 64, 128, 64, 128), dict(gate_up=True, prefetch1=True, split_k=3)),
    ("int8_w8a16", {"group_size": 64, "symmetric": False}, (16, 64, 64, 64, 64), dict(prefetch2=True)),
    ("fp8_w8a8_block128", {}, (16, 64, 128, 128, 128), dict(gate_up=True, split_k=2, pdl=True)),
    ("fp8_w8a8_block128", {}, (64, 64, 128, 128, 128), dict(gate_up=True, fuse_x_quant=False)),
    ("fp8_w8a8_block128", {}, (128, 64, 128, 128, 128, 8), dict(gate_up=True)),
    ("fp8_w8a8", {"static": True}, (16, 64, 256, 64, 256), dict(gate_up=True, split_k=2, pdl=True)),
    ("fp8_w8a8", {"static": True}, (128, 128, 128, 256, 128, 8), dict(gate_up=True)),
    ("fp8_w8a8", {}, (64, 64, 128, 128, 128), dict(split_k=2)),
    ("fp8_w8a8_channel", {}, (64, 64, 128, 128, 128), dict(gate_up=True)),
    ("int8_w8a8", {}, (16, 64, 128, 64, 128), dict(gate_up=True, split_k=2)),
    # swapped products: weight rows on the 64-row side of fp8 warpgroup products
    ("fp8_w8a8", {"static": True}, (16, 64, 256, 64, 256), dict(swap1=True, swap2=True, pdl=True)),
    ("fp8_w8a8", {"static": True}, (16, 64, 128, 128, 128), dict(swap1=True, gate_up=True, swap2=True, split_k=2)),
    ("fp8_w8a8", {}, (32, 128, 128, 128, 128, 8), dict(swap1=True, swap2=True, prefetch1=True, prefetch2=True)),
    ("fp8_w8a8_channel", {}, (16, 64, 128, 64, 128), dict(swap1=True, gate_up=True, swap2=True, split_k=4)),
    # 32 columns of gate and 32 of up: one 64-row product
    ("fp8_w8a8", {"static": True}, (32, 32, 128, 64, 128), dict(swap1=True, gate_up=True, swap2=True)),
]
IDS = [f"{v[0]}-{'-'.join(f'{k}={x}' for k, x in v[1].items())}-{'-'.join(f'{k}={x}' for k, x in v[3].items())}"
       for v in VARIANTS]


@pytest.mark.parametrize("T,n_remote", [(1, 0), (37, 3), (700, 0)], ids=["T1", "T37-expert-map", "T700"])
@pytest.mark.parametrize("scheme,opts,tiles,knobs", VARIANTS, ids=IDS)
def test_variant_matches_emulated_reference(scheme, opts, tiles, knobs, T, n_remote, cuda_gen):
    E, k, H, I = 16, 4, 512, 384
    wts = _weights(scheme, opts, E, H, I, cuda_gen)
    emap = random_expert_map(E, n_remote, cuda_gen, "cuda")
    w, ids = _routing(T, E + n_remote, k, cuda_gen)
    x = torch.randn(T, H, device="cuda", generator=cuda_gen).bfloat16()
    torch.empty(256 * 2**20 // 4, device="cuda").fill_(float("nan"))  # an unwritten element would show
    out = _run(wts, x, w, ids, emap, _tiles(*tiles), QuantKnobs(**knobs))
    ref = emulated_experts(x, wts, w, ids, expert_map=emap, act_dtype=triton_act_dtype(wts, x))
    assert out.dtype == x.dtype and torch.isfinite(out).all()
    assert rel_err(out, ref) <= TOLERANCE[get_scheme(wts.quant).precision]


@pytest.mark.parametrize("scheme,opts", [("int4_w4a16", {}), ("fp8_w8a8", {"static": True})])
def test_split_k_and_pdl_are_run_to_run_identical_and_graph_safe(scheme, opts, cuda_gen):
    wts = _weights(scheme, opts, 8, 1024, 512, cuda_gen)
    cfg, knobs = _tiles(16, 64, 128, 64, 128), QuantKnobs(split_k=4, gate_up=True, pdl=True)
    w, ids = _routing(24, 8, 2, cuda_gen)
    x = torch.randn(24, 1024, device="cuda", generator=cuda_gen).bfloat16()
    first = _run(wts, x, w, ids, config=cfg, knobs=knobs)
    assert torch.equal(first, _run(wts, x, w, ids, config=cfg, knobs=knobs))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        _run(wts, x, w, ids, config=cfg, knobs=knobs)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _run(wts, x, w, ids, config=cfg, knobs=knobs)
    for _ in range(2):  # fresh inputs each replay
        new_w, new_ids = _routing(24, 8, 2, cuda_gen)
        x.copy_(torch.randn(24, 1024, device="cuda", generator=cuda_gen))
        w.copy_(new_w)
        ids.copy_(new_ids)
        graph.replay()
        assert torch.equal(out, _run(wts, x, w, ids, config=cfg, knobs=knobs))


@pytest.mark.parametrize("opts", [{}, {"group_size": 64, "symmetric": False}], ids=["sym-128", "zero-64"])
@pytest.mark.parametrize("T", [1, 16, 333])
def test_paired_products_in_ptx_are_the_bit_operations_bits(opts, T, cuda_gen):
    """w_convert "pairs" (inline PTX) and "pairs_bits" (bit operations) give every weight the same
    value at the same place of the products (the PTX relies on each register holding four bytes
    of one word of eight weights), so their outputs are the same bits; graph replays too."""
    wts = _weights("int4_w4a16", opts, 16, 1024, 512, cuda_gen)
    w, ids = _routing(T, 16, 4, cuda_gen)
    x = torch.randn(T, 1024, device="cuda", generator=cuda_gen).bfloat16()
    cfg = _tiles(16, 64, 64, 64, 64, stages=4)
    outs = [_run(wts, x, w, ids, config=cfg, knobs=QuantKnobs(w_convert=c, gate_up=True, split_k=2))
            for c in ("pairs", "pairs_bits")]
    assert torch.equal(outs[0], outs[1])
    ref = emulated_experts(x, wts, w, ids, act_dtype=triton_act_dtype(wts, x))
    assert rel_err(outs[0], ref) <= TOLERANCE[get_scheme(wts.quant).precision]
    knobs = QuantKnobs(w_convert="pairs", gate_up=True, split_k=2, pdl=True)
    _run(wts, x, w, ids, config=cfg, knobs=knobs)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _run(wts, x, w, ids, config=cfg, knobs=knobs)
    x.copy_(torch.randn(T, 1024, device="cuda", generator=cuda_gen))
    graph.replay()
    assert torch.equal(out, _run(wts, x, w, ids, config=cfg, knobs=QuantKnobs(w_convert="pairs_bits", gate_up=True,
                                                                              split_k=2)))


@pytest.mark.parametrize("scheme,opts", [("fp8_w8a8", {"static": True}), ("fp8_w8a8", {}),
                                         ("fp8_w8a8_channel", {}), ("int8_w8a8", {})])
@pytest.mark.parametrize("T", [256, 512, 1031], ids=["32-rows", "64-rows", "129-rows"])
def test_untuned_8bit_calls_match_emulated_reference(scheme, opts, T, cuda_gen):
    """An untuned shape through the call's own tile choice (on Hopper quant_tuning.untuned_w8a8:
    64-row and 128-row gate-and-up tiles, the prefill kernels for static fp8) with experts
    left without tokens."""
    from moekit.kernels.launch_quant import quant_tiles  # noqa: PLC0415
    from moekit.kernels.quant_rows import modes_of  # noqa: PLC0415
    from moekit.kernels.quant_tuning import untuned_w8a8  # noqa: PLC0415
    from moekit.kernels.tuning import device_name  # noqa: PLC0415

    E, k, H, I = 24, 3, 768, 640
    wts = _weights(scheme, opts, E, H, I, cuda_gen)
    w, ids = _routing(T, E - 2, k, cuda_gen)  # the last two experts get no tokens
    x = torch.randn(T, H, device="cuda", generator=cuda_gen).bfloat16()
    sch = get_scheme(scheme)
    picked = quant_tiles(T, E, k, H, I, x.dtype, device_name(), sch, modes_of(sch))
    if torch.cuda.get_device_capability()[0] == 9:
        assert picked == (untuned_w8a8(T, E, k, scheme == "fp8_w8a8") or picked)
    out = _run(wts, x, w, ids)
    ref = emulated_experts(x, wts, w, ids, act_dtype=triton_act_dtype(wts, x))
    assert out.dtype == x.dtype and torch.isfinite(out).all()
    assert rel_err(out, ref) <= TOLERANCE[sch.precision]


@pytest.mark.parametrize("scheme,opts", [("int4_w4a16", {}), ("int4_w4a16", {"group_size": 64, "symmetric": False}),
                                         ("int8_w8a16", {}), ("int8_w8a16", {"group_size": 32, "symmetric": False})])
@pytest.mark.parametrize("T", [1, 3, 40, 200, 1031], ids=["1-token", "0.4-rows", "5-rows", "25-rows", "129-rows"])
def test_untuned_weight_only_calls_match_emulated_reference(scheme, opts, T, cuda_gen):
    """An untuned weight-only shape through the call's own tile choice (on Hopper
    quant_tuning.untuned_weight_only: below half a row an expert narrow tiles, int4 up to 16 rows
    the paired products, from 16 rows the weights dequantized with their group scales before the
    product) with experts left without tokens."""
    from moekit.kernels.launch_quant import quant_tiles  # noqa: PLC0415
    from moekit.kernels.quant_rows import modes_of  # noqa: PLC0415
    from moekit.kernels.tuning import device_name  # noqa: PLC0415

    E, k, H, I = 24, 3, 768, 640
    wts = _weights(scheme, opts, E, H, I, cuda_gen)
    w, ids = _routing(T, E - 2, k, cuda_gen)  # the last two experts get no tokens
    x = torch.randn(T, H, device="cuda", generator=cuda_gen).bfloat16()
    sch = get_scheme(scheme, **opts)
    _, knobs = quant_tiles(T, E, k, H, I, x.dtype, device_name(), sch, modes_of(sch))
    hopper = torch.cuda.get_device_capability()[0] == 9
    assert knobs.fold_w == (hopper and T * k >= 16 * E)
    assert (knobs.w_convert == "pairs") == (hopper and sch.weight_dtype == "int4" and 0.5 * E <= T * k < 16 * E)
    out = _run(wts, x, w, ids)
    ref = emulated_experts(x, wts, w, ids, act_dtype=triton_act_dtype(wts, x))
    assert out.dtype == x.dtype and torch.isfinite(out).all()
    assert rel_err(out, ref) <= TOLERANCE[sch.precision]

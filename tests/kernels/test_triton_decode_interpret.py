"""The decode knobs of the Triton experts (GEMM2 split over programs, the CUDA-core direct
GEMMs, the sum over k for few tokens) on CPU under Triton's interpreter, against `reference`.

The interpreter runs programs one after another, so the split's last arriver is always the
last split here; the GPU tests (test_triton_decode_gpu.py) cover the arrival races. fp16/fp32
only (tl.dot on bf16 operands is wrong in the interpreter).
"""

from dataclasses import replace

import pytest
import torch

from conftest import TOL, rel_err, random_expert_map
from triton_child import IN_INTERPRETER, run_in_interpreter

if not IN_INTERPRETER:

    def test_decode_kernels_under_the_triton_interpreter():
        run_in_interpreter(__file__)

else:
    from moekit.activations import ACTIVATIONS, is_gated
    from moekit.experts.base import ExpertWeights
    from moekit.experts.reference import reference_experts
    from moekit.kernels import triton_moe as moe
    from moekit.kernels.launch import fused_moe
    from moekit.kernels.tuning import MoEConfig, TileConfig

    def _problem(T, E, k, H, I, dtype, gen, activation="silu", bias=False, n_remote=0, scale=1.0):
        """x [T, H], weights, routing over E local + n_remote non-local experts (distinct per token)."""
        rows = 2 * I if is_gated(activation) else I
        x = (torch.randn(T, H, generator=gen) * scale).to(dtype)
        w13 = (torch.randn(E, rows, H, generator=gen) * H ** -0.5).to(dtype)
        w2 = (torch.randn(E, H, I, generator=gen) * I ** -0.5).to(dtype)
        b13 = torch.randn(E, rows, generator=gen).to(dtype) if bias else None
        b2 = torch.randn(E, H, generator=gen).to(dtype) if bias else None
        emap = random_expert_map(E, n_remote, gen)
        ids = torch.stack([torch.randperm(E + n_remote, generator=gen)[:k] for _ in range(T)]) if T else \
            torch.zeros(0, k, dtype=torch.long)
        return x, ExpertWeights(w13, w2, b13, b2), torch.rand(T, k, generator=gen) + 0.05, ids.to(torch.int32), emap

    def _config(gemv1=0, gemv2=0, split=1, bm=16, bn=16, bk=16):
        return MoEConfig(TileConfig(bm, bn, bk, 1, 4, 2, GEMV=gemv1),
                         TileConfig(bm, bn, bk, 1, 4, 2, SPLIT_K=split, GEMV=gemv2))

    def _check(x, wts, w, ids, emap, config, direct, activation="silu", on_input=False):
        out = fused_moe(x, wts.w13, wts.w2, wts.b13, wts.b2, w, ids, emap, activation, on_input=on_input,
                        config=config, direct=direct)
        ref = reference_experts(x, wts, w, ids, activation=activation, apply_router_weight_on_input=on_input,
                                expert_map=emap)
        assert out.shape == ref.shape and torch.isfinite(out).all()
        assert rel_err(out, ref) <= TOL[x.dtype], rel_err(out, ref)
        return out

    # Direct path, k = 3 slots, I = 24 in K blocks of 16: 6 iterations of (slot, K block) per token.
    @pytest.mark.parametrize("gemv1,gemv2,split", [
        (0, 0, 2),   # tl.dot GEMM2, split dividing the 6 iterations
        (0, 0, 4),   # split not dividing them (2, 2, 2, 0: the last split has no work)
        (1, 0, 1),   # CUDA-core GEMM1 only
        (0, 1, 1),   # CUDA-core GEMM2 only, no split
        (1, 1, 3),   # both on CUDA cores, split
        (1, 1, 7),   # more splits than iterations: empty partials still count in
    ])
    @pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
    def test_direct_variants_with_map_and_bias(gemv1, gemv2, split, dtype, gen):
        x, wts, w, ids, emap = _problem(3, 5, 3, 40, 24, dtype, gen, bias=True, n_remote=3)
        _check(x, wts, w, ids, emap, _config(gemv1, gemv2, split), direct=True)

    # PRE peels a program's first one or two (slot, K block) iterations: splits of 6 iterations
    # into 1, 3 (2 each), 4 (2, 2, 2, 0) and 7 (fewer iterations than PRE) programs.
    @pytest.mark.parametrize("split", [1, 3, 4, 7])
    @pytest.mark.parametrize("pre", [1, 2])
    @pytest.mark.parametrize("gemv2", [0, 1])
    def test_gemm2_weights_loaded_ahead_are_bit_identical(split, pre, gemv2, gen):
        x, wts, w, ids, emap = _problem(3, 5, 3, 40, 24, torch.float32, gen, bias=True, n_remote=3)
        base = _config(1, gemv2, split)
        out = _check(x, wts, w, ids, emap, base, direct=True)
        ahead = MoEConfig(base.gemm1, replace(base.gemm2, PRE=pre))
        assert torch.equal(_check(x, wts, w, ids, emap, ahead, direct=True), out)  # same order of sums
        # The sorted path ignores PRE.
        assert torch.equal(fused_moe(x, wts.w13, wts.w2, wts.b13, wts.b2, w, ids, emap, "silu", config=ahead,
                                     direct=False),
                           fused_moe(x, wts.w13, wts.w2, wts.b13, wts.b2, w, ids, emap, "silu", config=base,
                                     direct=False))

    # Sorted path: I = 40 is 3 K blocks of 16 for GEMM2's split.
    @pytest.mark.parametrize("split,bm", [
        (2, 16),    # 2 + 1 blocks
        (3, 16),    # one block each
        (5, 32),    # more splits than blocks, 32-row blocks with padding rows
    ])
    @pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
    def test_sorted_split_with_map_and_bias(split, bm, dtype, gen):
        x, wts, w, ids, emap = _problem(9, 4, 2, 32, 40, dtype, gen, bias=True, n_remote=2)
        _check(x, wts, w, ids, emap, _config(split=split, bm=bm), direct=False)

    @pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # exp(-x) -> inf is sigmoid's 0
    @pytest.mark.parametrize("activation", ACTIVATIONS)
    def test_every_activation_on_the_cuda_core_kernels(activation, gen):
        # scale 3: gate/up values reach past swigluoai's clamp limit of 7.
        x, wts, w, ids, emap = _problem(2, 4, 2, 32, 16, torch.float32, gen, activation=activation, bias=True,
                                        scale=3.0)
        _check(x, wts, w, ids, emap, _config(1, 1, 2), direct=True, activation=activation)

    @pytest.mark.parametrize("gemv", [0, 1])
    def test_router_weight_on_input_k1(gemv, gen):
        x, wts, w, ids, emap = _problem(3, 5, 1, 32, 16, torch.float32, gen, bias=True)
        _check(x, wts, w, ids, emap, _config(gemv, gemv, 2), direct=True, on_input=True)

    def test_one_token_k1_odd_sizes(gen):
        x, wts, w, ids, emap = _problem(1, 3, 1, 33, 17, torch.float16, gen)
        _check(x, wts, w, ids, emap, _config(1, 1, 3), direct=True)

    def test_token_whose_slots_are_all_remote_gets_zeros(gen):
        x, wts, w, ids, emap = _problem(1, 4, 2, 32, 16, torch.float32, gen, bias=True, n_remote=4)
        ids = (emap < 0).nonzero().flatten()[:2].to(torch.int32).reshape(1, 2)
        for config in (_config(1, 1, 2), _config(0, 0, 3)):
            out = fused_moe(x, wts.w13, wts.w2, wts.b13, wts.b2, w, ids, emap, "silu", config=config, direct=True)
            assert torch.equal(out, torch.zeros_like(out))

    def test_empty_batch(gen):
        x, wts, w, ids, emap = _problem(0, 4, 2, 32, 16, torch.float32, gen)
        for direct in (True, False):
            out = fused_moe(x, wts.w13, wts.w2, None, None, w, ids, None, "silu", config=_config(1, 1, 2),
                            direct=direct)
            assert out.shape == (0, 32)

    def test_split_runs_are_bit_identical_and_agree_across_splits(gen):
        x, wts, w, ids, emap = _problem(4, 6, 2, 48, 48, torch.float32, gen)
        outs = {}
        for direct in (True, False):
            for split in (1, 2, 3):
                cfg = _config(int(direct), int(direct), split)
                a = fused_moe(x, wts.w13, wts.w2, None, None, w, ids, None, "silu", config=cfg, direct=direct)
                b = fused_moe(x, wts.w13, wts.w2, None, None, w, ids, None, "silu", config=cfg, direct=direct)
                assert torch.equal(a, b)  # counters start from zero on every call
                outs[direct, split] = a
        for out in outs.values():
            assert rel_err(out, outs[False, 1]) <= 1e-5

    def test_out_dtype_of_x_equals_fp32_then_cast(gen):
        x, wts, w, ids, emap = _problem(2, 4, 2, 32, 16, torch.float16, gen)
        for direct in (True, False):
            cfg = _config(int(direct), int(direct), 2)
            o32 = fused_moe(x, wts.w13, wts.w2, None, None, w, ids, None, "silu", config=cfg, direct=direct)
            o16 = fused_moe(x, wts.w13, wts.w2, None, None, w, ids, None, "silu", config=cfg, direct=direct,
                            out_dtype=x.dtype)
            assert o16.dtype == torch.float16 and torch.equal(o16, o32.to(torch.float16))

    @pytest.mark.parametrize("T", [40, 300])  # one token row per program with pipelined slots / [4, BN] tiles
    def test_sum_over_k_both_tilings(T, gen):
        assert (T <= moe.SUM_K_ROW_MAX) == (T == 40)
        x, wts, w, ids, emap = _problem(T, 4, 2, 32, 16, torch.float32, gen, n_remote=1)
        _check(x, wts, w, ids, emap, None, direct=False)

    def _fused(bc=16, bk=16, bh=16):
        return MoEConfig(TileConfig(16, bc, bk, 1, 4, 2, GEMV=1, FUSED=1), TileConfig(16, bh, 16, 1, 4, 2))

    # Fused direct path: I = 24 is two I blocks of 16 (the second half empty), H = 40 three
    # w2 row blocks of 16 (the last partial); with a map, biases and remote slots.
    @pytest.mark.parametrize("bc,bh", [(16, 16), (32, 32), (16, 64)])
    @pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
    def test_fused_direct_with_map_and_bias(bc, bh, dtype, gen):
        x, wts, w, ids, emap = _problem(3, 5, 3, 40, 24, dtype, gen, bias=True, n_remote=3)
        _check(x, wts, w, ids, emap, _fused(bc=bc, bh=bh), direct=True)

    @pytest.mark.filterwarnings("ignore:overflow encountered in exp")
    @pytest.mark.parametrize("activation", ACTIVATIONS)
    def test_every_activation_on_the_fused_direct_kernel(activation, gen):
        x, wts, w, ids, emap = _problem(2, 4, 2, 32, 20, torch.float32, gen, activation=activation, bias=True,
                                        scale=3.0)
        _check(x, wts, w, ids, emap, _fused(), direct=True, activation=activation)

    @pytest.mark.parametrize("b13,b2", [(True, False), (False, True)])
    def test_fused_direct_with_one_bias(b13, b2, gen):
        x, wts, w, ids, emap = _problem(2, 4, 2, 32, 16, torch.float32, gen, bias=True)
        wts = ExpertWeights(wts.w13, wts.w2, wts.b13 if b13 else None, wts.b2 if b2 else None)
        _check(x, wts, w, ids, emap, _fused(), direct=True)

    def test_fused_direct_router_weight_on_input_and_odd_sizes(gen):
        x, wts, w, ids, emap = _problem(3, 5, 1, 33, 17, torch.float32, gen, bias=True)
        _check(x, wts, w, ids, emap, _fused(), direct=True, on_input=True)
        x, wts, w, ids, emap = _problem(1, 3, 1, 33, 17, torch.float16, gen)
        _check(x, wts, w, ids, emap, _fused(), direct=True)

    def test_fused_direct_remote_slots_zero_and_repeat_bit_identical(gen):
        x, wts, w, ids, emap = _problem(1, 4, 2, 32, 16, torch.float32, gen, bias=True, n_remote=4)
        ids = (emap < 0).nonzero().flatten()[:2].to(torch.int32).reshape(1, 2)
        out = fused_moe(x, wts.w13, wts.w2, wts.b13, wts.b2, w, ids, emap, "silu", config=_fused(), direct=True)
        assert torch.equal(out, torch.zeros_like(out))
        x, wts, w, ids, emap = _problem(4, 6, 2, 48, 48, torch.float16, gen)
        runs = [fused_moe(x, wts.w13, wts.w2, None, None, w, ids, None, "silu", config=_fused(), direct=True,
                          out_dtype=dt) for dt in (torch.float32, torch.float32, torch.float16)]
        assert torch.equal(runs[0], runs[1]) and torch.equal(runs[2], runs[0].to(torch.float16))
        unfused = fused_moe(x, wts.w13, wts.w2, None, None, w, ids, None, "silu", config=_config(1, 1, 1),
                            direct=True)
        assert rel_err(runs[0], unfused) <= 1e-3  # same math, other fp32 summation order

    def test_fused_is_ignored_on_the_sorted_path(gen):
        x, wts, w, ids, emap = _problem(9, 4, 2, 32, 40, torch.float16, gen, n_remote=2)
        _check(x, wts, w, ids, emap, _fused(), direct=False)

    def test_pdl_needs_an_sm90_gpu(gen):
        x, wts, w, ids, emap = _problem(1, 4, 2, 32, 16, torch.float32, gen)
        cfg = MoEConfig(TileConfig(16, 16, 16), TileConfig(16, 16, 16, PDL=1))
        with pytest.raises(ValueError, match="PDL=1 needs a CUDA GPU of compute capability 9.0"):
            fused_moe(x, wts.w13, wts.w2, None, None, w, ids, None, "silu", config=cfg)

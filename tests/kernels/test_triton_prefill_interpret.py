"""The prefill kernels (kernels/triton_prefill.py) on CPU under Triton's interpreter, against `reference`.

Routing is built so that experts get chosen row counts: none, one, exactly a row granule,
one past it, a full tile, one past a tile, several tiles; so every tail loop (BM, BM/2,
BM/4 rows), tile boundaries inside an expert and experts with no rows all run. The TMA
paths run too (descriptors built on the host and in the kernel): the interpreter executes
tensor-descriptor loads, zero fill past the tensor included. fp16/fp32 only (tl.dot on
bf16 is wrong in the interpreter).
"""

import pytest
import torch

from conftest import TOL, rel_err, random_expert_map
from triton_child import IN_INTERPRETER, run_in_interpreter

if not IN_INTERPRETER:

    def test_prefill_kernels_under_the_triton_interpreter():
        run_in_interpreter(__file__)

else:
    from moekit.activations import is_gated
    from moekit.experts.base import ExpertWeights
    from moekit.experts.reference import reference_experts
    from moekit.kernels.launch import fused_moe
    from moekit.kernels.triton_prefill import row_tiles_bound
    from moekit.kernels.tuning import MoEConfig, PrefillConfig, TileConfig

    # BM = 64: granules 64 / 32 / 16 for tail 1 / 2 / 4.
    TILES = (TileConfig(64, 32, 32, 2, 4, 2), TileConfig(64, 16, 16, 3, 4, 2))

    def _config(tma=1, per_sm=1, tail=2, tiles=TILES, act_tma=0, x_tma=0):
        return MoEConfig(tiles[0], tiles[1], PrefillConfig(tma, per_sm, tail, act_tma=act_tma, x_tma=x_tma))

    def _routing_with_counts(counts, k, gen):
        """ids [T, k] (distinct experts per token) giving expert e counts[e] assignments."""
        E = len(counts)
        T = sum(counts) // k
        left = list(counts)
        rows = []
        for _ in range(T):  # greedily take the k experts with the most assignments left
            pick = sorted(range(E), key=lambda e: (-left[e], e))[:k]
            for e in pick:
                left[e] -= 1
            rows.append(pick)
        assert all(c == 0 for c in left), "counts must be realisable with distinct experts per token"
        ids = torch.tensor(rows, dtype=torch.int32)
        ids = ids[torch.randperm(T, generator=gen)]  # tokens in random order
        return torch.rand(T, k, generator=gen) + 0.05, ids

    def _weights(E, H, I, dtype, gen, activation="silu", bias=False):
        rows = 2 * I if is_gated(activation) else I
        w13 = (torch.randn(E, rows, H, generator=gen) * H ** -0.5).to(dtype)
        w2 = (torch.randn(E, H, I, generator=gen) * I ** -0.5).to(dtype)
        b13 = torch.randn(E, rows, generator=gen).to(dtype) if bias else None
        b2 = torch.randn(E, H, generator=gen).to(dtype) if bias else None
        return ExpertWeights(w13, w2, b13, b2)

    def _check(x, wts, w, ids, emap=None, config=None, activation="silu", on_input=False, out_dtype=torch.float32):
        out = fused_moe(x, wts.w13, wts.w2, wts.b13, wts.b2, w, ids, emap, activation, on_input=on_input,
                        config=config or _config(), direct=False, out_dtype=out_dtype)
        ref = reference_experts(x, wts, w, ids, activation=activation, apply_router_weight_on_input=on_input,
                                expert_map=emap)
        assert out.dtype == out_dtype and out.shape == ref.shape
        err = rel_err(out.float(), ref)
        assert err <= TOL[x.dtype], err
        return out

    # Counts for BM = 64: empty, 1, 16 (a BM/4 granule), 17, 33 (> BM/2), 64 (a tile), 65, 150.
    COUNTS = [0, 1, 16, 17, 33, 64, 65, 150]

    @pytest.mark.parametrize("tail", [1, 2, 4])
    @pytest.mark.parametrize("tma,per_sm,dtype", [
        (1, 1, torch.float32), (1, 1, torch.float16),  # host descriptors, persistent grid
        (0, 0, torch.float32),                         # pointers, one program per work item
        (2, 1, torch.float32),                         # descriptors built in the kernel
    ])
    def test_every_tail_loop_matches_reference(tail, tma, per_sm, dtype, gen):
        w, ids = _routing_with_counts(COUNTS, 2, gen)
        wts = _weights(len(COUNTS), 48, 40, dtype, gen)
        x = torch.randn(ids.shape[0], 48, generator=gen).to(dtype)
        _check(x, wts, w, ids, config=_config(tma, per_sm, tail))

    @pytest.mark.parametrize("tail,per_sm", [(1, 1), (2, 0), (4, 1)])
    @pytest.mark.parametrize("act_tma,x_tma", [(1, 0), (0, 1), (1, 1)])
    def test_row_descriptors_match_pointer_loads_bit_for_bit(tail, per_sm, act_tma, x_tma, gen, monkeypatch):
        # GEMM2's act tiles and GEMM1's gathered x tiles by TMA read whole BM, BM/2, BM/4 row
        # blocks: rows past an expert's (the next expert's, or zeros past R) must not reach a
        # stored row. Poison them: buffers hold whatever the allocator left, so fill with NaN.
        w, ids = _routing_with_counts(COUNTS, 2, gen)
        wts = _weights(len(COUNTS), 48, 40, torch.float32, gen, bias=True)
        x = torch.randn(ids.shape[0], 48, generator=gen)
        real_empty = torch.empty

        def nan_empty(*args, **kwargs):
            t = real_empty(*args, **kwargs)
            return t.fill_(float("nan")) if t.is_floating_point() else t

        ptrs = _check(x, wts, w, ids, config=_config(2, per_sm, tail))
        monkeypatch.setattr(torch, "empty", nan_empty)
        desc = _check(x, wts, w, ids, config=_config(2, per_sm, tail, act_tma=act_tma, x_tma=x_tma))
        assert torch.equal(ptrs, desc)
        if tail == 1:
            flat = MoEConfig(TILES[0], TILES[1], PrefillConfig(2, 1, 1, flatten=1, act_tma=act_tma, x_tma=x_tma))
            assert torch.equal(ptrs, _check(x, wts, w, ids, config=flat))

    @pytest.mark.parametrize("x_tma,flatten", [(0, 0), (1, 0), (0, 1)])
    @pytest.mark.parametrize("bias,n_remote,on_input", [(False, 0, False), (True, 3, False), (False, 3, True)])
    def test_warp_specialized_schedule_gives_the_plain_loops_bits(x_tma, flatten, bias, n_remote, on_input, gen):
        # ws=1 finds a tile's expert from the padded ends re-read per tile (no scan); the
        # interpreter runs that schedule (the specialization itself is the GPU compiler's).
        # flatten with ws flattens GEMM1's loops only.
        # Empty experts, one-row experts, tile boundaries and remote experts included.
        counts = COUNTS + [5, 3, 2][:n_remote]
        w, ids = _routing_with_counts(counts, 2, gen)
        emap = None
        if n_remote:  # the last n_remote global experts are remote
            emap = torch.arange(len(counts), dtype=torch.int32)
            emap[len(COUNTS):] = -1
        wts = _weights(len(COUNTS), 48, 40, torch.float32, gen, bias=bias)
        x = torch.randn(ids.shape[0], 48, generator=gen)
        plain = _check(x, wts, w, ids, emap, config=_config(2, 1, 1, act_tma=1, x_tma=x_tma), on_input=on_input)
        ws = MoEConfig(TILES[0], TILES[1], PrefillConfig(2, 1, 1, flatten=flatten, act_tma=1, x_tma=x_tma, ws=1))
        assert torch.equal(plain, _check(x, wts, w, ids, emap, config=ws, on_input=on_input))

    @pytest.mark.parametrize("tail,x_tma,activation", [(1, 0, "silu"), (2, 1, "swigluoai"), (4, 0, "gelu"),
                                                        (2, 0, "silu_no_mul")])
    def test_gate_and_up_in_one_product_give_two_products_bits(tail, x_tma, activation, gen):
        # gu1 reads [2, BN, BK] blocks of w13 seen as [E * 2, I, H] and splits the [BM, 2 BN]
        # product: the same sums per element as the two products (non-gated: one product
        # anyway); the interpreter's fp32 products come from numpy, whose blocking may order a
        # sum differently for another width, so agreement to fp32 rounding is asked here (the
        # GPU test asks for the bits). I = 40 is not a multiple of BN = 32: the blocks run past
        # each half's rows into zeros.
        w, ids = _routing_with_counts(COUNTS, 2, gen)
        wts = _weights(len(COUNTS), 48, 40, torch.float32, gen, activation=activation, bias=True)
        x = torch.randn(ids.shape[0], 48, generator=gen)
        two = _check(x, wts, w, ids, config=_config(2, 1, tail, act_tma=1, x_tma=x_tma), activation=activation)
        one = MoEConfig(TILES[0], TILES[1], PrefillConfig(2, 1, tail, act_tma=1, x_tma=x_tma, gu1=1))
        assert rel_err(_check(x, wts, w, ids, config=one, activation=activation), two) <= 1e-6

    def test_grids_descriptors_and_flattening_agree_bit_for_bit(gen):
        # INTERPRETER_SMS programs walk every (row tile, column tile); results are bit-identical
        # to one program per work item, and from run to run. Weight tiles through pointers reach
        # the interpreter's numpy product in another memory layout than the descriptors' transposed
        # tiles, and numpy's BLAS may order a sum differently for it: fp32 rounding there (the GPU
        # test asks for the bits).
        w, ids = _routing_with_counts(COUNTS, 2, gen)
        wts = _weights(len(COUNTS), 48, 40, torch.float32, gen)
        x = torch.randn(ids.shape[0], 48, generator=gen)
        a = _check(x, wts, w, ids, config=_config(1, 1, 4))
        b = _check(x, wts, w, ids, config=_config(1, 0, 4))
        c = _check(x, wts, w, ids, config=_config(0, 1, 4))
        d = _check(x, wts, w, ids, config=_config(2, 1, 4))
        assert torch.equal(a, b) and torch.equal(a, d) and rel_err(c, a) <= 1e-6
        flat = MoEConfig(TILES[0], TILES[1], PrefillConfig(1, 1, 1, flatten=1))
        assert torch.equal(_check(x, wts, w, ids, config=flat), _check(x, wts, w, ids, config=_config(1, 1, 1)))
        assert torch.equal(a, _check(x, wts, w, ids, config=_config(1, 1, 4)))

    @pytest.mark.parametrize("case", [
        dict(T=1, E=4, k=2, H=32, I=16),                     # one token on the sorted path
        dict(T=9, E=5, k=1, H=48, I=40),                     # k = 1
        dict(T=6, E=4, k=4, H=32, I=16),                     # k = E
        dict(T=12, E=3, k=2, H=33, I=17, tma=0),             # odd H and I through pointers
        dict(T=7, E=5, k=2, H=32, I=16, n_remote=4),         # expert map with non-local experts
        dict(T=30, E=6, k=3, H=32, I=48, bias=True),         # biases
        dict(T=7, E=5, k=2, H=32, I=16, n_remote=4, tma=2, act_tma=1, x_tma=1),  # row descriptors, map
        dict(T=1, E=4, k=2, H=32, I=16, tma=2, act_tma=1, x_tma=1),              # one token
    ])
    def test_edge_shapes_match_reference(case, gen):
        case = dict(case)
        T, E, k, H, I = (case.pop(n) for n in ("T", "E", "k", "H", "I"))
        n_remote, tma = case.pop("n_remote", 0), case.pop("tma", 1)
        rows = dict(act_tma=case.pop("act_tma", 0), x_tma=case.pop("x_tma", 0))
        wts = _weights(E, H, I, torch.float32, gen, bias=case.pop("bias", False))
        Eg = E + n_remote
        emap = random_expert_map(E, n_remote, gen)
        ids = torch.stack([torch.randperm(Eg, generator=gen)[:k] for _ in range(T)]).to(torch.int32)
        w = torch.rand(T, k, generator=gen) + 0.05
        x = torch.randn(T, H, generator=gen)
        _check(x, wts, w, ids, emap, config=_config(tma=tma, tail=4, **rows))

    def test_no_local_assignment_gives_zeros(gen):
        wts = _weights(3, 32, 16, torch.float32, gen)
        emap = torch.tensor([-1, -1, 0, 1, 2], dtype=torch.int32)
        ids = torch.tensor([[0, 1], [1, 0]], dtype=torch.int32)
        out = fused_moe(torch.randn(2, 32, generator=gen), wts.w13, wts.w2, None, None, torch.rand(2, 2, generator=gen),
                        ids, emap, "silu", config=_config(), direct=False)
        assert torch.equal(out, torch.zeros(2, 32))

    @pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # exp(-x) -> inf is sigmoid's 0
    @pytest.mark.parametrize("activation", ["swigluoai", "gelu_tanh", "relu2_no_mul"])
    def test_activations_with_bias(activation, gen):
        w, ids = _routing_with_counts([5, 0, 20, 17], 2, gen)
        wts = _weights(4, 32, 48, torch.float32, gen, activation=activation, bias=True)
        x = torch.randn(ids.shape[0], 32, generator=gen) * 3.0  # past swigluoai's clamp limit
        _check(x, wts, w, ids, activation=activation, config=_config(1, 1, 4))

    def test_router_weight_on_input_and_output_in_x_dtype(gen):
        w, ids = _routing_with_counts([9, 20, 0, 3], 1, gen)
        wts = _weights(4, 32, 16, torch.float16, gen, bias=True)
        x = torch.randn(ids.shape[0], 32, generator=gen).to(torch.float16)
        _check(x, wts, w, ids, on_input=True)
        o32 = _check(x, wts, w, ids)
        o16 = _check(x, wts, w, ids, out_dtype=torch.float16)
        assert torch.equal(o16, o32.to(torch.float16))

    def test_large_alignment_path_end_to_end(gen, monkeypatch):
        import moekit.kernels.launch as launch

        monkeypatch.setattr(launch, "ALIGN_SMALL_MAX", 0)  # the chunked alignment at the granule
        w, ids = _routing_with_counts(COUNTS, 2, gen)
        wts = _weights(len(COUNTS), 32, 16, torch.float32, gen)
        _check(torch.randn(ids.shape[0], 32, generator=gen), wts, w, ids, config=_config(1, 1, 4))

    def test_tma_refuses_unaligned_rows(gen):
        wts = _weights(3, 36, 20, torch.float16, gen)  # 36 * 2 bytes is not a multiple of 16
        ids = torch.tensor([[0, 1], [2, 1]], dtype=torch.int32)
        with pytest.raises(ValueError, match="TMA needs w13's rows 16-byte aligned"):
            fused_moe(torch.randn(2, 36, generator=gen).half(), wts.w13, wts.w2, None, None,
                      torch.rand(2, 2, generator=gen), ids, None, "silu", config=_config(tma=1), direct=False)

    def test_row_tiles_bound_holds():
        # Every expert adds at most one partly filled tile; a tile holds at least one assignment.
        for counts in ([0, 1, 16, 17, 33, 64, 65, 150], [1] * 8, [129, 0, 0, 1]):
            tiles = sum(-(-c // 64) for c in counts)
            assert tiles <= row_tiles_bound(sum(counts), len(counts), 64)
        assert row_tiles_bound(3, 100, 64) == 3

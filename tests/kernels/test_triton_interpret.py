"""The Triton experts kernels on CPU under Triton's interpreter, against `reference`.

TRITON_INTERPRET is read when moekit and the kernels are imported, so the tests run in a
fresh process with it set (the parent's one test starts that process). Interpreter runs
use fp16/fp32 only: tl.dot on bf16 operands returns wrong values there.
"""

import pytest
import torch
from torch import library

from conftest import TOL, rel_err, random_expert_map
from triton_child import IN_INTERPRETER, run_in_interpreter

if not IN_INTERPRETER:

    def test_kernels_under_the_triton_interpreter():
        run_in_interpreter(__file__)

else:
    from hypothesis import given
    from hypothesis import settings as hyp_settings
    from hypothesis import strategies as st

    from moekit import fused_experts
    from moekit.activations import ACTIVATIONS, is_gated
    from moekit.config import settings
    from moekit.experts.base import ExpertWeights
    from moekit.experts.reference import reference_experts
    from moekit.experts.triton_experts import TritonBackend, triton_fused_experts
    from moekit.kernels.launch import fused_moe, moe_align
    from moekit.kernels.tuning import MoEConfig, TileConfig

    def _routing(T, E_global, k, gen):
        """Distinct experts per token (tie-free), weights in (0, 1]."""
        ids = torch.stack([torch.randperm(E_global, generator=gen)[:k] for _ in range(T)]) if T else \
            torch.zeros(0, k, dtype=torch.long)
        return torch.rand(T, k, generator=gen) + 0.05, ids.to(torch.int32)

    def _problem(T, E, k, H, I, dtype, gen, activation="silu", bias=False, n_remote=0, scale=1.0):
        gated = is_gated(activation)
        rows = 2 * I if gated else I
        x = (torch.randn(T, H, generator=gen) * scale).to(dtype)
        w13 = (torch.randn(E, rows, H, generator=gen) * H ** -0.5).to(dtype)
        w2 = (torch.randn(E, H, I, generator=gen) * I ** -0.5).to(dtype)
        b13 = torch.randn(E, rows, generator=gen).to(dtype) if bias else None
        b2 = torch.randn(E, H, generator=gen).to(dtype) if bias else None
        emap = random_expert_map(E, n_remote, gen)
        w, ids = _routing(T, E + n_remote, k, gen)
        return x, ExpertWeights(w13, w2, b13, b2), w, ids, emap

    def _check(x, wts, w, ids, emap, activation="silu", on_input=False, direct=None, config=None, tol=None):
        out = fused_moe(x, wts.w13, wts.w2, wts.b13, wts.b2, w, ids, emap, activation,
                        on_input=on_input, direct=direct, config=config)
        ref = reference_experts(x, wts, w, ids, activation=activation, apply_router_weight_on_input=on_input,
                                expert_map=emap)
        assert out.dtype == torch.float32 and out.shape == ref.shape
        assert torch.isfinite(out).all()
        err = rel_err(out, ref)
        assert err <= (tol or TOL[x.dtype]), err
        return out

    def _expected_alignment(ids, emap, E, bm):
        """Independent alignment: per expert, its assignments in order, padded to bm rows."""
        flat = ids.reshape(-1).long()
        local = flat if emap is None else emap.long()[flat]
        rows, ends = [], []
        for e in range(E):
            mine = (local == e).nonzero().flatten().tolist()
            padded = -(-len(mine) // bm) * bm
            rows += mine + [flat.numel()] * (padded - len(mine))
            ends.append(len(rows))
        return rows, ends

    def test_interpreter_flag_was_read():
        assert settings.triton_interpret

    @pytest.mark.parametrize("T,E,k,bm,n_remote,small,chunk", [
        (1, 4, 2, 16, 0, True, None),       # one token
        (5, 9, 3, 16, 3, True, None),       # non-local experts (-1) get no rows
        (37, 70, 2, 32, 0, True, None),     # most experts empty, E not a power of two
        (40, 3, 3, 16, 0, True, None),      # k = E: every expert full, several blocks each
        (1, 8, 2, 16, 6, True, None),       # both slots non-local: no rows at all
        (500, 8, 3, 64, 2, False, None),    # chunked path (six chunks of 256) with an expert map
        (700, 70, 4, 16, 0, False, None),   # chunked path, chunk boundaries inside experts
        (1, 4, 2, 16, 0, False, None),      # chunked path, one chunk, mostly padding lanes
        (33, 5, 2, 16, 1, False, 16),       # many small chunks, the last one partial, a map
        (64, 300, 8, 128, 0, False, 32),    # E_PAD 512: 16 chunks' histograms read in two steps
        (700, 70, 4, 16, 3, True, None),    # one launch over 2800 assignments, a map
        (64, 300, 8, 128, 0, True, None),   # one launch, a program for each of 300 experts
        (7, 1, 1, 16, 0, True, None),       # one expert
    ])
    def test_alignment_matches_independent_sort(T, E, k, bm, n_remote, small, chunk, gen):
        _, _, _, ids, emap = _problem(T, E, k, 16, 16, torch.float32, gen, n_remote=n_remote)
        if n_remote and T == 1:  # route the token to non-local experts only
            ids = (emap < 0).nonzero().flatten()[:k].to(torch.int32).reshape(1, k)
        al = moe_align(ids, emap, E, bm, small_max=10**9 if small else 0, chunk=chunk)
        rows, ends = _expected_alignment(ids, emap, E, bm)
        assert al.expert_end.tolist() == ends
        # Both paths: each expert's assignments in order, then its padding.
        assert al.sorted_ids[:len(rows)].tolist() == rows
        assert al.max_blocks * bm >= len(rows)

    @hyp_settings(max_examples=25, deadline=None)
    @given(T=st.integers(1, 90), E=st.integers(1, 40), k=st.integers(1, 6), bm=st.sampled_from([16, 32, 64]),
           n_remote=st.integers(0, 5), small=st.booleans(), seed=st.integers(0, 2**31 - 1))
    def test_alignment_property(T, E, k, bm, n_remote, small, seed):
        """Any routing, either path: each expert's assignments in order, then its padding."""
        g = torch.Generator().manual_seed(seed)
        k = min(k, E + n_remote)
        emap = random_expert_map(E, n_remote, g)
        ids = torch.stack([torch.randperm(E + n_remote, generator=g)[:k] for _ in range(T)]).to(torch.int32)
        al = moe_align(ids, emap, E, bm, small_max=10**9 if small else 0, chunk=None if small else 16)
        rows, ends = _expected_alignment(ids, emap, E, bm)
        assert al.expert_end.tolist() == ends
        assert al.sorted_ids[:len(rows)].tolist() == rows

    def test_alignment_chunk_must_be_a_power_of_two(gen):
        ids = torch.zeros(4, 2, dtype=torch.int32)
        with pytest.raises(ValueError, match="chunk must be a power of two"):
            moe_align(ids, None, 4, 16, small_max=0, chunk=48)

    @pytest.mark.parametrize("case", [
        dict(T=1, E=4, k=2, H=32, I=16),                      # one token: direct path
        dict(T=1, E=6, k=3, H=33, I=17),                      # odd H and I on the direct path
        dict(T=9, E=5, k=1, H=48, I=40),                      # k = 1
        dict(T=6, E=4, k=4, H=32, I=16),                      # k = E
        dict(T=9, E=12, k=2, H=40, I=24),                     # experts with no token
        dict(T=17, E=3, k=2, H=64, I=48, bias=True),          # several row blocks per expert, biases
        dict(T=7, E=5, k=2, H=32, I=16, n_remote=4),          # expert map with non-local experts
        dict(T=1, E=5, k=3, H=32, I=16, n_remote=4, bias=True),  # direct path, map and biases
    ])
    @pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
    def test_matches_reference(case, dtype, gen):
        case = dict(case)
        x, wts, w, ids, emap = _problem(case.pop("T"), case.pop("E"), case.pop("k"), case.pop("H"), case.pop("I"),
                                        dtype, gen, **case)
        _check(x, wts, w, ids, emap)

    @pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # exp(-x) -> inf is sigmoid's 0
    @pytest.mark.parametrize("direct", [True, False])
    @pytest.mark.parametrize("activation", ACTIVATIONS)
    def test_every_activation_with_bias(activation, direct, gen):
        # scale 3: gate/up values reach past swigluoai's clamp limit of 7.
        x, wts, w, ids, emap = _problem(3, 4, 2, 32, 16, torch.float32, gen, activation=activation, bias=True,
                                        scale=3.0)
        _check(x, wts, w, ids, emap, activation=activation, direct=direct)

    @pytest.mark.parametrize("direct", [True, False])
    def test_router_weight_on_input(direct, gen):
        x, wts, w, ids, emap = _problem(6, 5, 1, 32, 16, torch.float32, gen, bias=True)
        _check(x, wts, w, ids, emap, on_input=True, direct=direct)

    def test_both_paths_and_tiles_agree(gen):
        x, wts, w, ids, emap = _problem(8, 6, 2, 32, 32, torch.float32, gen)
        big = MoEConfig(TileConfig(32, 32, 32, 2, 4, 2), TileConfig(32, 64, 16, 1, 4, 2))
        a = _check(x, wts, w, ids, emap, direct=True)
        b = _check(x, wts, w, ids, emap, direct=False)
        c = _check(x, wts, w, ids, emap, direct=False, config=big)
        assert rel_err(a, b) <= 1e-5 and rel_err(b, c) <= 1e-5

    def test_one_token_with_more_slots_than_the_direct_path_holds_takes_the_sorted_path(gen):
        from moekit.kernels.triton_moe import MAX_TOP_K

        k = MAX_TOP_K + 1
        x, wts, w, ids, emap = _problem(1, k + 1, k, 16, 16, torch.float32, gen)
        _check(x, wts, w, ids, emap)
        with pytest.raises(ValueError, match=f"direct path takes top_k <= {MAX_TOP_K}"):
            fused_moe(x, wts.w13, wts.w2, None, None, w, ids, None, "silu", direct=True)

    def test_large_alignment_path_end_to_end(gen, monkeypatch):
        import moekit.kernels.launch as launch

        monkeypatch.setattr(launch, "ALIGN_SMALL_MAX", 0)
        x, wts, w, ids, emap = _problem(70, 9, 3, 32, 16, torch.float32, gen, n_remote=2)
        _check(x, wts, w, ids, emap, direct=False)

    def test_run_to_run_bit_identical(gen):
        x, wts, w, ids, emap = _problem(20, 4, 2, 32, 16, torch.float32, gen)
        outs = [fused_moe(x, wts.w13, wts.w2, None, None, w, ids, None, "silu", direct=False) for _ in range(2)]
        assert torch.equal(outs[0], outs[1])

    def test_fused_experts_backend_triton_and_empty_batch(gen):
        x, wts, w, ids, emap = _problem(5, 4, 2, 32, 16, torch.float16, gen)
        out = fused_experts(x, wts.w13, wts.w2, w, ids, backend="triton")
        ref = fused_experts(x, wts.w13, wts.w2, w, ids, backend="reference")
        assert out.dtype == torch.float16 and rel_err(out, ref) <= TOL[torch.float16]
        for direct in (True, False):  # x's dtype written directly equals fp32 then one cast
            o32 = fused_moe(x, wts.w13, wts.w2, None, None, w, ids, None, "silu", direct=direct)
            o16 = fused_moe(x, wts.w13, wts.w2, None, None, w, ids, None, "silu", direct=direct, out_dtype=x.dtype)
            assert o16.dtype == torch.float16 and torch.equal(o16, o32.to(torch.float16))
        empty = fused_experts(x[:0], wts.w13, wts.w2, w[:0], ids[:0], backend="triton")
        assert empty.shape == (0, 32)
        assert fused_moe(x[:0], wts.w13, wts.w2, None, None, w[:0], ids[:0], None, "silu").shape == (0, 32)
        with pytest.raises(TypeError, match="out_dtype"):
            fused_moe(x, wts.w13, wts.w2, None, None, w, ids, None, "silu", out_dtype=torch.bfloat16)

    def test_backend_refuses_bf16_in_the_interpreter():
        from moekit.experts.base import ExpertsProblem

        p = ExpertsProblem("cpu", torch.bfloat16, torch.bfloat16, "silu", False, False, False, 8, 64, 32, 2)
        assert "bf16" in TritonBackend().unsupported(p)
        p16 = ExpertsProblem("cpu", torch.float16, torch.float16, "silu", False, False, False, 8, 64, 32, 2)
        assert TritonBackend().unsupported(p16) is None
        with pytest.raises(ValueError, match="backend='triton' cannot run"):
            fused_experts(torch.randn(2, 64).bfloat16(), torch.randn(8, 64, 64).bfloat16(),
                          torch.randn(8, 64, 32).bfloat16(), torch.rand(2, 2), torch.zeros(2, 2, dtype=torch.int32),
                          backend="triton")

    def test_launcher_rejects_bad_layouts(gen):
        x, wts, w, ids, emap = _problem(3, 4, 2, 32, 16, torch.float32, gen)
        with pytest.raises(ValueError, match="w13 must be contiguous"):
            fused_moe(x, wts.w13.transpose(1, 2).contiguous().transpose(1, 2), wts.w2, None, None, w, ids, None, "silu")
        with pytest.raises(TypeError, match="topk_ids must be torch.int32"):
            fused_moe(x, wts.w13, wts.w2, None, None, w, ids.long(), None, "silu")

    def test_launcher_rejects_shapes_that_do_not_match(gen):
        x, wts, w, ids, emap = _problem(3, 4, 2, 32, 16, torch.float32, gen, bias=True)
        w13, w2, b13, b2 = wts.w13, wts.w2, wts.b13, wts.b2
        cases = [
            (dict(w13=w13[:, :, :16].contiguous()), r"w13 must be \[4, 32, 32\]"),  # H of w13 is not x's
            (dict(w13=w13[:, :16].contiguous()), r"w13 must be \[4, 32, 32\]"),     # I of w13 is not w2's
            (dict(w13=w13[:3].contiguous()), r"w13 must be \[4, 32, 32\]"),         # fewer experts than w2
            (dict(w2=w2[:, :16].contiguous()), r"w2 must be \[E, H=32, I\]"),
            (dict(b13=b13[:, :16].contiguous()), r"b13 must be \[4, 32\]"),
            (dict(b2=b2[:, :16].contiguous()), r"b2 must be \[4, 32\]"),
            (dict(w=w[:, :1].contiguous()), "topk_weights must have the shape of topk_ids"),
            (dict(w=w[:2].contiguous(), ids=ids[:2].contiguous()), r"topk_ids must be \[T=3, k\]"),
            (dict(x=x[None]), "x must be 2-D"),
        ]
        for change, match in cases:
            a = dict(dict(x=x, w13=w13, w2=w2, b13=b13, b2=b2, w=w, ids=ids), **change)
            with pytest.raises(ValueError, match=match):
                fused_moe(a["x"], a["w13"], a["w2"], a["b13"], a["b2"], a["w"], a["ids"], None, "silu")

    def test_custom_op_fake_and_schema(gen):
        x, wts, w, ids, emap = _problem(3, 4, 2, 32, 16, torch.float16, gen)
        for out_dtype in (torch.float32, torch.float16):
            library.opcheck(triton_fused_experts,
                                  (x, wts.w13, wts.w2, None, None, w, ids, None, "silu", 1.702, 7.0, False, out_dtype))

    def test_layer_compiles_whole(gen):
        """torch.compile(fullgraph=True) of a layer on the triton backend: routing, the custom op and
        the combine trace without a graph break, with the eager layer's output."""
        from moekit import FusedMoE, RoutingConfig

        layer = FusedMoE(8, 64, 32, RoutingConfig(top_k=2), dtype=torch.float16, backend="triton", gate=True).eval()
        compiled = torch.compile(layer, fullgraph=True)
        with torch.no_grad():
            for T in (1, 6):
                x = torch.randn(T, 64, generator=gen).half()
                assert rel_err(compiled(x), layer(x)) <= TOL[torch.float16]

"""The quantized Triton experts on CPU under Triton's interpreter, against the emulated reference.

Every scheme runs here with fp16 activations (fp8 included: under the interpreter the kernels
round onto the e4m3 grid themselves, so the interpreter's own fp8 casts, which round wrongly,
only see exact values). TRITON_INTERPRET is read at import, so the cases run in a child process.
"""

import pytest
import torch
from torch import library

from conftest import rel_err, triton_act_dtype
from triton_child import IN_INTERPRETER, run_in_interpreter

if not IN_INTERPRETER:

    def test_quant_kernels_under_the_triton_interpreter():
        run_in_interpreter(__file__)

else:
    import triton
    import triton.language as tl

    from moekit import fused_experts
    from moekit.activations import is_gated
    from moekit.experts.base import ExpertsProblem
    from moekit.experts.triton_experts import TritonBackend, triton_quant_experts
    from moekit.kernels.launch_quant import quant_config, quant_unsupported
    from moekit.kernels.quant_rows import align_and_quantize, modes_of, quant_rows, quantize_rows
    from moekit.kernels.triton_quant_rows import to_quant
    from moekit.kernels.tuning import MoEConfig, TileConfig
    from moekit.quant import TOLERANCE, emulated_experts, get_scheme, quantize_activation, quantize_experts

    # (scheme, quantize_experts options, H, I): every scheme, group sizes and zero points.
    SCHEMES = [
        ("fp8_w8a8", {}, 48, 40),                                      # odd-ish sizes: per-tensor takes any
        ("fp8_w8a8", {"static": True}, 48, 40),                        # static per-expert activation scales
        ("fp8_w8a8_channel", {}, 40, 24),
        ("fp8_w8a8_block128", {}, 128, 128),
        ("int8_w8a8", {}, 40, 24),
        ("int8_w8a16", {}, 128, 128),                                  # group 128, symmetric
        ("int8_w8a16", {"group_size": 32, "symmetric": False}, 64, 32),  # zero points
        ("int4_w4a16", {}, 128, 128),
        ("int4_w4a16", {"group_size": 64}, 64, 64),
        ("int4_w4a16", {"group_size": 32, "symmetric": False}, 64, 32),
    ]
    IDS = [f"{s}-{'-'.join(f'{k}={v}' for k, v in o.items()) or 'default'}" for s, o, _, _ in SCHEMES]

    def _weights(scheme, opts, E, H, I, gen, activation="silu", bias=False):
        rows = 2 * I if is_gated(activation) else I
        w13 = torch.randn(E, rows, H, generator=gen) * H ** -0.5
        w2 = torch.randn(E, H, I, generator=gen) * I ** -0.5
        opts = dict(opts)
        if opts.pop("static", False):  # roughly amax / 448 of the inputs each GEMM sees
            opts.update(a13_scale=torch.rand(E, generator=gen) * 0.004 + 0.008,
                        a2_scale=torch.rand(E, generator=gen) * 0.002 + 0.004)
        b13 = torch.randn(E, rows, generator=gen).half() if bias else None
        b2 = torch.randn(E, H, generator=gen).half() if bias else None
        return quantize_experts(w13, w2, scheme, b13=b13, b2=b2, **opts)

    def _routing(T, E_global, k, gen):
        ids = torch.stack([torch.randperm(E_global, generator=gen)[:k] for _ in range(T)]) if T else \
            torch.zeros(0, k, dtype=torch.long)
        return torch.rand(T, k, generator=gen) + 0.05, ids.to(torch.int32)

    def _expert_map(E, n_remote, gen):
        emap = torch.full((E + n_remote,), -1, dtype=torch.int32)
        emap[torch.randperm(E + n_remote, generator=gen)[:E]] = torch.arange(E, dtype=torch.int32)
        return emap

    def _check(x, wts, w, ids, emap=None, activation="silu", on_input=False):
        out = fused_experts(x, wts, None, w, ids, activation=activation, apply_router_weight_on_input=on_input,
                            expert_map=emap, backend="triton")
        ref = emulated_experts(x, wts, w, ids, activation=activation, apply_router_weight_on_input=on_input,
                               expert_map=emap, act_dtype=triton_act_dtype(wts, x))
        assert out.dtype == x.dtype and out.shape == ref.shape
        assert torch.isfinite(out).all()
        err = rel_err(out, ref)
        assert err <= TOLERANCE[get_scheme(wts.quant).precision], err
        return out

    @pytest.mark.parametrize("case", [
        dict(T=1, E=4, k=2),               # one token
        dict(T=7, E=3, k=3),               # odd T, k = E
        dict(T=5, E=12, k=2),              # most experts get no token
        dict(T=9, E=5, k=2, n_remote=4),   # expert map with -1 entries
    ], ids=["T1", "T7-k=E", "empty-experts", "expert-map"])
    @pytest.mark.parametrize("scheme,opts,H,I", SCHEMES, ids=IDS)
    def test_matches_emulated_reference(scheme, opts, H, I, case, gen):
        wts = _weights(scheme, opts, case["E"], H, I, gen)
        emap = _expert_map(case["E"], case["n_remote"], gen) if case.get("n_remote") else None
        w, ids = _routing(case["T"], case["E"] + case.get("n_remote", 0), case["k"], gen)
        _check(torch.randn(case["T"], H, generator=gen).half(), wts, w, ids, emap)

    @pytest.mark.parametrize("scheme,opts,H,I", [SCHEMES[i] for i in (1, 3, 4, 9)], ids=[IDS[i] for i in (1, 3, 4, 9)])
    def test_bias_non_gated_activation_and_weight_on_input(scheme, opts, H, I, gen):
        wts = _weights(scheme, opts, 4, H, I, gen, activation="gelu_no_mul", bias=True)
        w, ids = _routing(6, 4, 1, gen)
        x = torch.randn(6, H, generator=gen).half()
        _check(x, wts, w, ids, activation="gelu_no_mul", on_input=True)
        _check(x, wts, w, ids, activation="gelu_no_mul")

    # fp8 prefill tiles: pointers with tail tiles; device descriptors with both operands by TMA,
    # gate and up in one product and GEMM2 warp-specialized (a plain loop here; same bits).
    FP8_PREFILL = {
        "pointers-tail2": (TileConfig(128, 32, 32, 8, 4, 2), TileConfig(128, 32, 32, 8, 4, 2),
                           dict(tma=0, programs_per_sm=0, tail=2)),
        "tma-gu1-ws": (TileConfig(64, 32, 32, 8, 4, 2), TileConfig(64, 32, 32, 8, 4, 2),
                       dict(tma=2, programs_per_sm=1, tail=1, act_tma=1, x_tma=1, ws=1, gu1=1)),
        "tma-x-rows-tail2": (TileConfig(128, 32, 64, 8, 4, 2), TileConfig(128, 64, 32, 8, 4, 2),
                             dict(tma=2, programs_per_sm=1, tail=2, x_tma=1, act_tma=1)),
    }

    @pytest.mark.parametrize("name", list(FP8_PREFILL))
    @pytest.mark.parametrize("bias", [False, True])
    @pytest.mark.parametrize("shared", [False, True])
    def test_fp8_static_scales_on_the_prefill_kernels(name, bias, shared, gen):
        # Static per-tensor fp8 through triton_prefill's kernels: explicit config and the tuned
        # entry's static_prefill knob; an expert map, an expert with no rows, biases (GEMM2's
        # scales in its epilogue) or none (folded into the routed weights by GEMM1), scales
        # shared by the experts (x quantized once per token) or not.
        from moekit.kernels.launch_quant import fused_moe_quant
        from moekit.kernels.quant_tuning import QuantKnobs
        from moekit.kernels.tuning import PrefillConfig
        from moekit.quant import scheme_of

        g1, g2, pre = FP8_PREFILL[name]
        cfg = MoEConfig(g1, g2, PrefillConfig(**pre))
        E, H, I, k = 6, 64, 48, 2
        wts = _weights("fp8_w8a8", {"static": True}, E, H, I, gen, bias=bias)
        s = wts.scales
        if shared:
            s["a13_scale"].fill_(0.01)
        emap = _expert_map(E, 2, gen)
        w, ids = _routing(70, E + 2, k, gen)
        ids[ids == int((emap == 3).nonzero()[0])] = int((emap == -1).nonzero()[0])  # local expert 3 gets no rows
        x = torch.randn(70, H, generator=gen).half()

        def run(**kw):
            return fused_moe_quant(x, wts.w13, wts.w2, wts.b13, wts.b2, s["w13_scale"], s["w2_scale"], None, None,
                                   s["a13_scale"], s["a2_scale"], w, ids, emap, scheme_of(wts), "silu",
                                   out_dtype=x.dtype, **kw)

        out = run(config=cfg)
        ref = emulated_experts(x, wts, w, ids, expert_map=emap, act_dtype=triton_act_dtype(wts, x))
        assert torch.isfinite(out).all()
        assert rel_err(out, ref) <= TOLERANCE[get_scheme("fp8_w8a8").precision], rel_err(out, ref)
        sorted_path = run(config=MoEConfig(g1, g2))
        assert rel_err(out, sorted_path) <= 1e-2  # the sorted kernels' result, up to rounding
        assert torch.equal(out, run(config=cfg))  # run to run

    def test_fp8_prefill_refusals_name_the_reason(gen):
        from moekit.kernels.launch_quant import fused_moe_quant
        from moekit.kernels.tuning import PrefillConfig
        from moekit.quant import scheme_of

        cfg = MoEConfig(TileConfig(64, 32, 32), TileConfig(64, 32, 32), PrefillConfig(tma=0, programs_per_sm=0, tail=1))
        wts = _weights("fp8_w8a8", {}, 4, 64, 48, gen)
        s = wts.scales
        w, ids = _routing(3, 4, 2, gen)
        x = torch.randn(3, 64, generator=gen).half()
        with pytest.raises(ValueError, match="they take static activation scales"):
            fused_moe_quant(x, wts.w13, wts.w2, None, None, s["w13_scale"], s["w2_scale"], None, None, None, None,
                            w, ids, None, scheme_of(wts), "silu", config=cfg, out_dtype=x.dtype)
        static = _weights("fp8_w8a8", {"static": True}, 4, 64, 48, gen)
        s = static.scales
        w1, ids1 = _routing(3, 4, 1, gen)
        with pytest.raises(ValueError, match="routed weight on the output"):
            fused_moe_quant(x, static.w13, static.w2, None, None, s["w13_scale"], s["w2_scale"], None, None,
                            s["a13_scale"], s["a2_scale"], w1, ids1, None, scheme_of(static), "silu", config=cfg,
                            on_input=True, out_dtype=x.dtype)
        short = MoEConfig(TileConfig(64, 32, 32), TileConfig(64, 32, 32), PrefillConfig(tma=0, programs_per_sm=0, tail=2))
        with pytest.raises(ValueError, match="BLOCK_SIZE_M / prefill tail >= 64"):
            fused_moe_quant(x, static.w13, static.w2, None, None, s["w13_scale"], s["w2_scale"], None, None,
                            s["a13_scale"], s["a2_scale"], w, ids, None, scheme_of(static), "silu", config=short,
                            out_dtype=x.dtype)

    @pytest.mark.parametrize("shared", ["all", "some"])
    @pytest.mark.parametrize("fuse", [True, False])
    def test_static_scales_shared_by_experts_quantize_x_once_per_token(shared, fuse, gen):
        # Experts with one input scale: a token whose local experts all share it is quantized
        # once and its slots read that row (others: a row per slot). Same bits either way.
        from moekit.kernels.launch_quant import fused_moe_quant
        from moekit.kernels.quant_tuning import QuantKnobs
        from moekit.quant import scheme_of

        E, H, I = 6, 48, 40
        wts = _weights("fp8_w8a8", {"static": True}, E, H, I, gen)
        a13 = wts.scales["a13_scale"]
        if shared == "all":
            a13.fill_(0.01)
        else:
            a13[: E // 2] = 0.01  # tokens routed within the first half share; the rest do not
        emap = _expert_map(E, 2, gen)
        w, ids = _routing(9, E + 2, 2, gen)
        x = torch.randn(9, H, generator=gen).half()
        _check(x, wts, w, ids, emap)
        # The rows themselves: every local slot reads a row holding x[t] quantized with its
        # expert's scale; slots of a token whose experts share a scale read one row.
        modes = modes_of(get_scheme("fp8_w8a8"))
        q = torch.zeros(ids.numel(), H, dtype=torch.float8_e4m3fn)
        src = torch.full((ids.numel(),), -1, dtype=torch.int32)
        if fuse:
            align_and_quantize(ids, emap, E, 16, x, q, a13, modes, 4, 0, None, 512, src=src)
        else:
            quant_rows(x, q, a13, modes, 4, 0, topk_ids=ids, expert_map=emap, src=src)
        local = emap[ids.long()]
        for t in range(ids.shape[0]):
            slots = [j for j in range(ids.shape[1]) if local[t, j] >= 0]
            for j in slots:
                a = t * ids.shape[1] + j
                want = quantize_activation(x[t:t + 1].float(), get_scheme("fp8_w8a8"), a13[local[t, j]])[0]
                assert torch.equal(q[src[a]].float(), want[0].float())
            if len({float(a13[local[t, j]]) for j in slots}) == 1:
                assert {int(src[t * ids.shape[1] + j]) for j in slots} == {t * ids.shape[1] + slots[0]}
            else:
                assert [int(src[t * ids.shape[1] + j]) for j in slots] == [t * ids.shape[1] + j for j in slots]
        if shared == "all":
            assert len(set(src[local.flatten() >= 0].tolist())) <= ids.shape[0]

    def test_every_local_slot_counts_in_the_per_tensor_scale(gen):
        # Token 0 reaches no local expert and is 100x larger: a dynamic per-tensor scale that
        # included it would flatten every other token to a few fp8 steps.
        wts = _weights("fp8_w8a8", {}, 4, 32, 32, gen)
        emap = torch.tensor([0, 1, 2, 3, -1, -1], dtype=torch.int32)
        w, ids = _routing(5, 4, 2, gen)
        ids[0] = torch.tensor([4, 5], dtype=torch.int32)
        x = torch.randn(5, 32, generator=gen).half()
        x[0] *= 100
        _check(x, wts, w, ids, emap)

    @pytest.mark.parametrize("group,H,small_max", [(32, 96, 512), (64, 128, 0), (128, 1152, 512)],
                             ids=["one-launch", "chunked", "two-chunks-a-row"])
    def test_x_in_the_paired_order_with_group_sums(group, H, small_max, gen):
        """GRAN 5 in the alignment's launch (int4 paired products): x copied with each group of
        eight columns in PAIRS_ORDER, the fp32 sums of its weight groups beside it; the
        alignment itself unchanged."""
        from moekit.kernels.launch import moe_align  # noqa: PLC0415
        from moekit.kernels.triton_moe_quant import PAIRS_ORDER  # noqa: PLC0415

        T, E, k = 7, 6, 3
        w, ids = _routing(T, E, k, gen)
        x = torch.randn(T, H, generator=gen).half()
        q = torch.full((T, H), float("nan"), dtype=x.dtype)
        s = torch.full((T, H // group), float("nan"))
        modes = modes_of(get_scheme("int4_w4a16", group_size=group))
        al = align_and_quantize(ids, None, E, 16, x, q, s, modes, 5, group, None, small_max)
        perm = torch.tensor([8 * j + p for j in range(H // 8) for p in PAIRS_ORDER])
        assert torch.equal(q, x[:, perm])
        torch.testing.assert_close(s, x.float().view(T, H // group, group).sum(-1), rtol=1e-6, atol=1e-6)
        ref = moe_align(ids, None, E, 16, small_max=small_max)
        used = int(ref.expert_end[-1])  # rows past the last expert's are never read
        assert torch.equal(al.expert_end, ref.expert_end) and torch.equal(al.sorted_ids[:used], ref.sorted_ids[:used])

    def test_large_alignment_path_and_small_tiles(gen, monkeypatch):
        import moekit.kernels.launch as launch

        monkeypatch.setattr(launch, "ALIGN_SMALL_MAX", 0)
        wts = _weights("int4_w4a16", {"group_size": 32, "symmetric": False}, 6, 64, 32, gen)
        w, ids = _routing(70, 6, 3, gen)
        _check(torch.randn(70, 64, generator=gen).half(), wts, w, ids)

    @pytest.mark.parametrize("name,opts,bm,tiles", [
        ("fp8_w8a8_block128", {}, 16, (64, 128, 32, 32)),                 # K within a 128 block; 8-bit K >= 32
        ("int4_w4a16", {"group_size": 32}, 16, (64, 32, 32, 32)),        # int4 halves need K >= 32
        ("int8_w8a8", {}, 16, (64, 256, 32, 32)),
        ("int8_w8a16", {"group_size": 64}, 16, (64, 64, 32, 16)),
        ("int8_w8a16", {}, 16, (32, 128, 32, 16)),                        # 64 x 128 converted weights: narrower
        ("fp8_w8a8", {}, 64, (64, 128, 32, 128)),                          # compute tiles: 8-bit K of 128
        ("fp8_w8a8_block128", {}, 128, (64, 128, 32, 128)),                # K-group scales: GEMM1 N <= 64
    ])
    def test_tiles_fit_the_scales(name, opts, bm, tiles):
        cfg = MoEConfig(TileConfig(bm, 64, 256), TileConfig(bm, 32, 16))
        q = quant_config(cfg, modes_of(get_scheme(name, **opts)))
        got = (q.gemm1.BLOCK_SIZE_N, q.gemm1.BLOCK_SIZE_K, q.gemm2.BLOCK_SIZE_N, q.gemm2.BLOCK_SIZE_K)
        assert got == tiles

    @pytest.mark.parametrize("name", ["fp8_w8a8_channel", "fp8_w8a8_block128", "int8_w8a8"])
    @pytest.mark.parametrize("rows,cols", [(9, 256), (37, 384)])  # 37 x 384: several row blocks, the last short
    def test_activation_quantization_is_bit_identical_to_torch(name, rows, cols, gen):
        scheme = get_scheme(name)
        for scale in (1.0, 1e-3, 300.0):  # fp8 subnormals, normals, saturation-free large values
            x = (torch.randn(rows, cols, generator=gen) * scale).half()
            x[1] = 0  # an all-zero row gets scale 1
            x[2, :128] = 0  # and an all-zero group
            q, s = quantize_rows(x, scheme)
            q_ref, s_ref = quantize_activation(x, scheme)
            assert torch.equal(s, s_ref)
            assert torch.equal(q.float(), q_ref.float())

    def test_empty_batch(gen):
        wts = _weights("int8_w8a8", {}, 4, 40, 24, gen)
        x = torch.randn(0, 40).half()
        out = fused_experts(x, wts, None, torch.rand(0, 2), torch.zeros(0, 2, dtype=torch.int32), backend="triton")
        assert out.shape == (0, 40) and out.dtype == torch.float16

    def test_launcher_rejects_routing_of_another_shape(gen):
        from moekit.kernels.launch_quant import fused_moe_quant
        from moekit.quant.layout import scheme_of

        wts = _weights("int8_w8a8", {}, 3, 64, 32, gen)
        w, ids = _routing(4, 3, 2, gen)
        x = torch.randn(4, 64, generator=gen).half()
        s = wts.scales
        for w_, ids_, match in ((w[:, :1].contiguous(), ids, "topk_weights must have the shape of topk_ids"),
                                (w[:2].contiguous(), ids[:2].contiguous(), r"topk_ids must be \[T=4, k\]")):
            with pytest.raises(ValueError, match=match):
                fused_moe_quant(x, wts.w13, wts.w2, None, None, s["w13_scale"], s["w2_scale"], None, None, None, None,
                                w_, ids_, None, scheme_of(wts), "silu")

    def test_refusals_name_the_reason():
        fp8, int4 = get_scheme("fp8_w8a8_block128"), get_scheme("int4_w4a16")
        assert "8.9" in quant_unsupported(fp8, torch.bfloat16, (8, 0), 256, 256)
        assert quant_unsupported(fp8, torch.bfloat16, (8, 9), 256, 256) is None
        assert "8.0" in quant_unsupported(int4, torch.float16, (7, 5), 256, 256)
        assert quant_unsupported(int4, torch.float16, (8, 0), 256, 256) is None
        assert "float32" in quant_unsupported(int4, torch.float32, (9, 0), 256, 256)
        assert "exact" in quant_unsupported(get_scheme("int8_w8a8"), torch.bfloat16, (9, 0), 256, 200_000)
        backend = TritonBackend()
        p = ExpertsProblem("cpu", torch.bfloat16, torch.uint8, "silu", False, False, False, 8, 128, 128, 2,
                           quant="int4_w4a16")
        assert "float16" in backend.unsupported(p)
        p16 = ExpertsProblem("cpu", torch.float16, torch.float8_e4m3fn, "silu", False, False, False, 8, 128, 128, 2,
                             quant="fp8_w8a8")
        assert backend.unsupported(p16) is None
        assert backend.differentiable is False

    def test_custom_op_fake_and_schema(gen):
        wts = _weights("int4_w4a16", {"group_size": 32, "symmetric": False}, 4, 64, 32, gen)
        w, ids = _routing(3, 4, 2, gen)
        x = torch.randn(3, 64, generator=gen).half()
        s = wts.scales
        library.opcheck(triton_quant_experts, (
            x, wts.w13, wts.w2, None, None, s["w13_scale"], s["w2_scale"], s["w13_zero"], s["w2_zero"], None, None,
            w, ids, None, "int4_w4a16", 32, "silu", 1.702, 7.0, False, torch.float16))

    def test_fp8_rounding_in_the_interpreter_matches_torch(gen):
        # to_quant's interpreter path puts values on the e4m3 grid before the cast (the interpreter's
        # own cast rounds ties away from even): it must give torch's round-to-nearest-even values on
        # ties (midpoints of neighbouring fp8 values), just off them, subnormals and saturated values.
        @triton.jit
        def cast(v_ptr, q_ptr, n, BLOCK: tl.constexpr):
            offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
            ok = offs < n
            tl.store(q_ptr + offs, to_quant(tl.load(v_ptr + offs, mask=ok, other=0.0), 448.0, False), mask=ok)

        grid_values = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
        grid_values = grid_values[torch.isfinite(grid_values)].unique()
        mids = (grid_values[1:] + grid_values[:-1]) / 2
        rand = torch.randn(4096, generator=gen) * torch.exp2(torch.randint(-14, 10, (4096,), generator=gen).float())
        v = torch.cat([grid_values, mids, mids.nextafter(mids + 1), mids.nextafter(mids - 1), rand,
                       torch.tensor([464.0, 1e6, -1e6, 2.0**-10, 3 * 2.0**-11])])
        q = torch.empty(v.numel(), dtype=torch.float8_e4m3fn)
        cast[(triton.cdiv(v.numel(), 1024),)](v, q, v.numel(), BLOCK=1024)
        assert torch.equal(q.float(), v.clamp(-448, 448).to(torch.float8_e4m3fn).float())

"""The quantized Triton experts' variants (QuantKnobs) and tuned quantized tables.

Each variant runs under Triton's interpreter (fp16 activations, in a child process: the
variable is read at import) against the emulated reference; the table and knob checks are
plain Python and run here.
"""

import json
import re
from dataclasses import replace

import pytest
import torch

from conftest import rel_err, random_expert_map, triton_act_dtype
from triton_child import IN_INTERPRETER, run_in_interpreter

pytest.importorskip("triton")

from moekit.kernels import quant_tuning, tuning  # noqa: E402
from moekit.kernels.launch_quant import _k_splits, _sum_block, check_tiles, quant_config, quant_tiles  # noqa: E402
from moekit.kernels.quant_rows import modes_of  # noqa: E402
from moekit.kernels.quant_tuning import (QuantKnobs, lookup_quant_config, parse_quant_configs,  # noqa: E402
                                         quant_file_name, quant_search_space)
from moekit.kernels.tuning import MoEConfig, TileConfig  # noqa: E402
from moekit.quant import get_scheme  # noqa: E402

if not IN_INTERPRETER:

    def test_quant_knobs_under_the_triton_interpreter():
        run_in_interpreter(__file__)

    def test_knobs_validate_and_round_trip():
        k = QuantKnobs(gate_up=True, split_k=3, w_convert="cast")
        assert k.to_json() == {"gate_up": True, "split_k": 3, "w_convert": "cast"}
        assert QuantKnobs.from_json(k.to_json()) == k
        assert QuantKnobs().to_json() == {}
        with pytest.raises(ValueError, match="split_k"):
            QuantKnobs(split_k=0)
        with pytest.raises(ValueError, match="w_convert"):
            QuantKnobs(w_convert="magic")
        with pytest.raises(TypeError, match="prefetch1"):
            QuantKnobs(prefetch1=1)
        with pytest.raises(ValueError, match="quant"):
            QuantKnobs.from_json({"split": 2})
        assert QuantKnobs.from_json({"gluon": 128}) == QuantKnobs(gluon=128)
        assert QuantKnobs.from_json({"fold_w": True}) == QuantKnobs(fold_w=True)
        for bad in (96, True, "128"):
            with pytest.raises(ValueError, match="gluon must be 0"):
                QuantKnobs(gluon=bad)

    def test_untuned_block_calls_take_the_gluon_kernels_by_rows_per_expert(monkeypatch):
        from moekit.kernels import gluon_block  # noqa: PLC0415

        block, tensor = get_scheme("fp8_w8a8_block128"), get_scheme("fp8_w8a8")
        rows = lambda T, H=2048, I=768, scheme=block, dev="NVIDIA_H200": gluon_block.default_rows(  # noqa: E731
            T, 128, 8, H, I, scheme, dev)
        assert rows(16384, dev=None) == 0  # CPU: no tables, no Gluon
        monkeypatch.setattr(gluon_block, "GLUON_MISSING", None)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
        # rows an expert: T * k / E
        assert [rows(T) for T in (1, 256, 512, 1023, 1024, 16384)] == [0, 0, 64, 64, 128, 128]
        assert rows(16384, scheme=tensor) == 0 and rows(16384, I=2880) == 0 and rows(16384, dev=None) == 0
        # an untuned table on a Hopper device: the quantized tiles plus the Gluon row tile
        cfg, knobs = quant_tiles(4096, 128, 8, 2048, 768, torch.bfloat16, "NO_SUCH_GPU", block, modes_of(block))
        assert knobs.gluon == 128 and cfg.gemm1.BLOCK_SIZE_K == 128
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
        assert rows(16384) == 0  # not Hopper

    def test_untuned_8bit_calls_on_hopper_take_the_measured_rule(monkeypatch):
        from moekit.kernels.quant_tuning import _FP8_STATIC_PREFILL, _W8A8_LARGE, _W8A8_MID  # noqa: PLC0415

        def tiles(T, scheme, E=64, k=8, H=2048, I=1024):  # an untuned shape: no table of any dtype
            sch = get_scheme(scheme)
            return quant_tiles(T, E, k, H, I, torch.bfloat16, "NO_SUCH_GPU", sch, modes_of(sch))

        off_hopper = {s: [tiles(T, s) for T in (256, 512, 1024)] for s in ("fp8_w8a8", "int8_w8a8")}
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
        for scheme in ("fp8_w8a8", "fp8_w8a8_channel", "int8_w8a8"):
            prefill = _FP8_STATIC_PREFILL if scheme == "fp8_w8a8" else None  # fp8 per-tensor activations only
            for T, cfg in ((512, _W8A8_MID), (1023, _W8A8_MID), (1024, _W8A8_LARGE), (16384, _W8A8_LARGE)):
                assert tiles(T, scheme) == (cfg, QuantKnobs(gate_up=True, fuse_x_quant=False, static_prefill=prefill))
            assert tiles(511, scheme)[1] == QuantKnobs()  # below 64 rows an expert: the fitted tiles
        # schemes with scales along K keep theirs; weight-only ones take untuned_weight_only
        assert tiles(4096, "fp8_w8a8_block128")[1] == QuantKnobs(gluon=128)
        assert tiles(4096, "int4_w4a16")[1] == QuantKnobs(gate_up=True, fold_w=True)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
        assert {s: [tiles(T, s) for T in (256, 512, 1024)] for s in off_hopper} == off_hopper

    def test_untuned_weight_only_calls_on_hopper_fold_their_scales(monkeypatch):
        from moekit.kernels.quant_tuning import _WO_LARGE, _WO_MID  # noqa: PLC0415

        def tiles(T, scheme, **opts):  # an untuned shape: no table of any dtype
            sch = get_scheme(scheme, **opts)
            return quant_tiles(T, 64, 8, 2048, 1024, torch.bfloat16, "NO_SUCH_GPU", sch, modes_of(sch))

        off_hopper = [tiles(T, "int4_w4a16") for T in (128, 512, 4096)]
        assert all(not knobs.fold_w for _, knobs in off_hopper)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
        folded = QuantKnobs(gate_up=True, fold_w=True)
        for scheme in ("int4_w4a16", "int8_w8a16"):
            for T, cfg in ((128, _WO_MID), (511, _WO_MID), (512, _WO_LARGE), (16384, _WO_LARGE)):
                assert tiles(T, scheme) == (cfg, folded)
            assert not tiles(127, scheme)[1].fold_w  # below 16 rows an expert: the fitted tiles
        # int4 from half a row to 16 rows an expert: the paired products; int8 and fewer rows not
        pairs = QuantKnobs(gate_up=True, w_convert="pairs", pdl=True)
        assert [tiles(T, "int4_w4a16")[1] == pairs for T in (3, 4, 16, 127, 128)] == [False, True, True, True, False]
        assert tiles(16, "int8_w8a16")[1] == QuantKnobs()  # int8 at 0.5-16 rows an expert: the fitted tiles
        # below half a row an expert: narrow GEMM1 tiles, GEMM2 split in two (int4 converted in PTX)
        few = QuantKnobs(gate_up=True, split_k=2, pdl=True)
        assert tiles(3, "int4_w4a16")[1] == replace(few, w_convert="ptx") and tiles(1, "int8_w8a16")[1] == few
        assert tiles(1, "int4_w4a16", group_size=64)[0].gemm1.BLOCK_SIZE_K == 64
        cfg, knobs = tiles(16, "int4_w4a16", group_size=32)
        assert knobs == pairs and cfg.gemm1.BLOCK_SIZE_K == cfg.gemm2.BLOCK_SIZE_K == 32
        cfg, knobs = tiles(4096, "int4_w4a16", group_size=32)  # K tiles within the groups
        assert knobs == folded and cfg.gemm1.BLOCK_SIZE_K == cfg.gemm2.BLOCK_SIZE_K == 32
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
        assert [tiles(T, "int4_w4a16") for T in (128, 512, 4096)] == off_hopper

    @pytest.mark.parametrize("scheme", ["fp8_w8a8", "fp8_w8a8_channel", "int8_w8a8", "fp8_w8a8_block128"])
    def test_fitted_8bit_tiles_hold_at_most_128_accumulator_registers(scheme):
        sch = get_scheme(scheme)
        for _, E, k, H, I in (("mixtral", 8, 2, 4096, 14336), ("olmoe", 64, 8, 2048, 1024), ("gpt-oss", 32, 4, 2880, 2880),
                              ("dsv3", 256, 8, 7168, 2048), ("odd", 12, 3, 1000, 333)):
            for T in (1, 16, 64, 256, 1024, 4096, 16384):
                for device in (None, "NVIDIA_H200"):
                    cfg = quant_config(tuning.get_config(T, E, k, H, I, torch.bfloat16, device), modes_of(sch))
                    for t, accumulators in ((cfg.gemm1, 2), (cfg.gemm2, 1)):
                        regs = accumulators * t.BLOCK_SIZE_M * t.BLOCK_SIZE_N / (32 * t.num_warps)
                        assert regs <= 128, (scheme, E, T, device, t)

    @pytest.mark.parametrize("scheme,kw,match", [
        ("fp8_w8a8_block128", dict(rows=96), "row tile must be one of"),
        ("fp8_w8a8", {}, "128 x 128 fp8 weight blocks"),
        ("fp8_w8a8_block128", dict(static=True), "128 x 128 fp8 weight blocks"),
        ("fp8_w8a8_block128", dict(x_dtype=torch.float32), "bfloat16 or float16"),
        ("fp8_w8a8_block128", dict(activation="gelu"), "silu"),
        ("fp8_w8a8_block128", dict(has_bias=True), "no biases"),
        ("fp8_w8a8_block128", dict(on_input=True), "router weight on the input"),
        ("fp8_w8a8_block128", dict(I=384), "multiples of 256"),
        ("fp8_w8a8_block128", {}, "compute capability 9.x, got cpu|no Gluon Hopper module"),
    ])
    def test_gluon_kernels_say_why_they_cannot_run_a_call(scheme, kw, match):
        from moekit.kernels import gluon_block  # noqa: PLC0415

        args = dict(x_dtype=torch.bfloat16, device=torch.device("cpu"), activation="silu", has_bias=False,
                    on_input=False, static=False, H=1024, I=512, rows=128)
        args.update(kw)
        assert re.search(match, gluon_block.refusal(get_scheme(scheme), **args))

    def test_file_names_follow_the_large_engines():
        names = {s: quant_file_name(8, 14336, "NVIDIA_H200", get_scheme(s)) for s in
                 ("fp8_w8a8", "fp8_w8a8_channel", "fp8_w8a8_block128", "int8_w8a8", "int8_w8a16", "int4_w4a16")}
        assert names["fp8_w8a8"] == names["fp8_w8a8_channel"] == "E=8,N=14336,device_name=NVIDIA_H200,dtype=fp8_w8a8.json"
        assert names["fp8_w8a8_block128"] == "E=8,N=14336,device_name=NVIDIA_H200,dtype=fp8_w8a8,block_shape=[128,128].json"
        assert names["int4_w4a16"].endswith("dtype=int4_w4a16.json")
        assert names["int8_w8a16"].endswith("dtype=int8_w8a16.json")
        assert names["int8_w8a8"].endswith("dtype=int8_w8a8.json")

    def _entry(bm, bn, knobs=None):
        e = {"BLOCK_SIZE_M": bm, "BLOCK_SIZE_N": bn, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 8, "num_warps": 4,
             "num_stages": 4, "gemm2": {"BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 8, "num_warps": 4,
                                        "num_stages": 3}}
        if knobs:
            e["quant"] = knobs
        return e

    def test_tuned_table_nearest_m_from_the_user_folder(tmp_path, monkeypatch):
        scheme = get_scheme("fp8_w8a8_block128")
        table = {"16": _entry(16, 64, {"split_k": 4}), "4096": _entry(128, 64, {"gate_up": True})}
        (tmp_path / quant_file_name(256, 2048, "GPU_X", scheme)).write_text(json.dumps(table))
        monkeypatch.setattr(tuning, "settings", replace(tuning.settings, tuned_config_dir=str(tmp_path)))
        quant_tuning.load_quant_configs.cache_clear()
        try:
            cfg, knobs = lookup_quant_config(64, 256, 2048, "GPU_X", scheme)
            assert cfg.block_m == 16 and knobs == QuantKnobs(split_k=4)
            cfg, knobs = lookup_quant_config(3000, 256, 2048, "GPU_X", scheme)
            assert cfg.block_m == 128 and knobs.gate_up and cfg.gemm2.BLOCK_SIZE_N == 64
            assert lookup_quant_config(64, 256, 2048, None, scheme) is None  # no device: no files
            assert lookup_quant_config(64, 128, 2048, "GPU_X", scheme) is None  # another E
        finally:
            quant_tuning.load_quant_configs.cache_clear()

    def test_malformed_tables_name_the_file_and_key():
        with pytest.raises(ValueError, match=r"f\.json\[16\]\.quant"):
            parse_quant_configs(json.dumps({"16": _entry(16, 64, {"splits": 2})}), "f.json")
        with pytest.raises(ValueError, match="token counts"):
            parse_quant_configs(json.dumps({"many": _entry(16, 64)}), "f.json")
        with pytest.raises(ValueError, match="not valid JSON"):
            parse_quant_configs("{", "f.json")

    def test_tiles_are_checked_against_the_scheme():
        block = modes_of(get_scheme("fp8_w8a8_block128"))
        check_tiles(MoEConfig(TileConfig(16, 64, 128), TileConfig(16, 64, 64)), block)
        with pytest.raises(ValueError, match="gemm2.BLOCK_SIZE_K must divide"):
            check_tiles(MoEConfig(TileConfig(16, 64, 128), TileConfig(16, 64, 256)), block)
        with pytest.raises(ValueError, match=">= 32"):
            check_tiles(MoEConfig(TileConfig(16, 64, 16), TileConfig(16, 64, 64)), modes_of(get_scheme("fp8_w8a8")))
        with pytest.raises(ValueError, match="SPLIT_K"):
            check_tiles(MoEConfig(TileConfig(16, 64, 128), TileConfig(16, 64, 64, SPLIT_K=2)), block)

    def test_static_prefill_knob_round_trips_and_is_checked():
        pre = MoEConfig(TileConfig(128, 128, 128, 8, 8, 3), TileConfig(128, 256, 128, 8, 4, 3),
                        tuning.PrefillConfig(tma=2, programs_per_sm=1, tail=1, act_tma=1, x_tma=1, ws=1, gu1=1))
        knobs = QuantKnobs(gate_up=True, static_prefill=pre)
        assert knobs.to_json() == {"gate_up": True, "static_prefill": pre.to_json()}
        assert QuantKnobs.from_json(json.loads(json.dumps(knobs.to_json()))) == knobs
        table = parse_quant_configs(json.dumps({"4096": _entry(128, 64, knobs.to_json())}), "f.json")
        assert table[4096][1].static_prefill == pre and table[4096][0].prefill is None
        with pytest.raises(ValueError, match="static_prefill must be a MoEConfig with prefill knobs"):
            QuantKnobs(static_prefill=MoEConfig(TileConfig(128, 128, 128), TileConfig(128, 128, 128)))
        with pytest.raises(ValueError, match="BLOCK_SIZE_M / prefill tail >= 64"):
            QuantKnobs(static_prefill=MoEConfig(TileConfig(128, 128, 128), TileConfig(128, 128, 128),
                                                tuning.PrefillConfig(tail=4)))
        with pytest.raises(ValueError, match=r"f\.json\[16\]\.quant\.static_prefill"):
            parse_quant_configs(json.dumps({"16": _entry(16, 64, {"static_prefill": {"BLOCK_SIZE_M": 3}})}), "f.json")
        # prefill tiles run fp8 with per-tensor activations only, on tiles of 64 rows or more
        check_tiles(pre, modes_of(get_scheme("fp8_w8a8")))
        for name in ("fp8_w8a8_block128", "fp8_w8a8_channel", "int8_w8a16", "int4_w4a16"):
            with pytest.raises(ValueError, match="config.prefill runs the unquantized kernels, or fp8"):
                check_tiles(pre, modes_of(get_scheme(name)))
        with pytest.raises(ValueError, match="BLOCK_SIZE_M / prefill tail >= 64"):
            check_tiles(MoEConfig(TileConfig(64, 64, 128), TileConfig(64, 64, 128), tuning.PrefillConfig(tail=2)),
                        modes_of(get_scheme("fp8_w8a8")))

    def test_swapped_products_are_offered_and_checked():
        g1, g2 = quant_search_space(16, 128, 8, 0, False, False, False)
        swapped1 = [(t, kn) for t, kn in g1 if kn.get("swap1")]
        swapped2 = [t for bm in g2 for t, kn in g2[bm] if kn.get("swap2")]
        assert swapped1 and swapped2
        rows = [(t.BLOCK_SIZE_N * (2 if kn.get("gate_up") else 1), t.num_warps) for t, kn in swapped1]
        rows += [(t.BLOCK_SIZE_N, t.num_warps) for t in swapped2]
        assert all(n % 64 == 0 and n >= 16 * w for n, w in rows)
        # 32 gate and 32 up columns fill one 64-row product; 32 columns alone do not
        assert any(t.BLOCK_SIZE_N == 32 and kn.get("gate_up") for t, kn in swapped1)
        assert not any(t.BLOCK_SIZE_N == 32 and not kn.get("gate_up") for t, kn in swapped1)
        assert quant_tuning.swap_fits(TileConfig(32, 32, 128), gate_up=True)
        assert not quant_tuning.swap_fits(TileConfig(32, 32, 128))
        g1, g2 = quant_search_space(16, 128, 8, 128, False, False, True)  # 128x128 blocks: K-group scales
        assert not any(kn.get("swap1") for _, kn in g1)
        assert QuantKnobs.from_json({"swap1": True, "swap2": True}) == QuantKnobs(swap1=True, swap2=True)

    def test_row_blocks_take_turns_in_the_search_space():
        """A search that times only the first candidates sees every row block; at a few rows per
        expert fp8 gets whole 64-row warpgroup tiles (no swapped products there) beside the short ones."""
        g1, g2 = quant_search_space(256, 128, 8, 0, False, False, False)  # 16 rows per expert
        assert [t.BLOCK_SIZE_M for t, _ in g1[:3]] == [16, 32, 64] and set(g2) == {16, 32, 64}
        assert not any(kn.get("swap1") for t, kn in g1 if t.BLOCK_SIZE_M == 64)
        assert any(kn.get("swap1") for t, kn in g1 if t.BLOCK_SIZE_M == 32)
        for T, bms in ((16, {16}), (1024, {32, 64})):  # 1 and 64 rows per expert
            g1, g2 = quant_search_space(T, 128, 8, 0, False, False, False)
            assert {t.BLOCK_SIZE_M for t, _ in g1} == bms == set(g2)
        # weight-only at 16 rows per expert: 64-row tiles too, for the weights dequantized before the product
        g1, _ = quant_search_space(256, 128, 8, 128, True, True, True)
        assert {t.BLOCK_SIZE_M for t, _ in g1} == {16, 32, 64}
        assert any(kn.get("fold_w") for t, kn in g1 if t.BLOCK_SIZE_M == 64)
        g1, _ = quant_search_space(64, 128, 8, 128, True, True, True)  # 4 rows per expert: no folding
        assert {t.BLOCK_SIZE_M for t, _ in g1} == {16} and not any(kn.get("fold_w") for _, kn in g1)

    @pytest.mark.parametrize("scheme, tiles, knobs, match", [
        ("int4_w4a16", (16, 64, 128), QuantKnobs(swap1=True), "multiplies fp8 activations with scales constant"),
        ("fp8_w8a8_block128", (16, 64, 128), QuantKnobs(swap2=True), "multiplies fp8 activations"),
        ("fp8_w8a8", (16, 32, 128), QuantKnobs(swap1=True), "BLOCK_SIZE_N a multiple of 64"),
        ("fp8_w8a8", (16, 16, 128), QuantKnobs(swap1=True, gate_up=True), r"2 \* BLOCK_SIZE_N \(gate and up"),
    ])
    def test_swap_knobs_refuse_what_they_cannot_run(scheme, tiles, knobs, match):
        from moekit.kernels.launch_quant import fused_moe_quant  # noqa: PLC0415
        from moekit.quant import quantize_experts  # noqa: PLC0415

        E, H, I = 4, 256, 128
        wts = quantize_experts(torch.randn(E, 2 * I, H), torch.randn(E, H, I), scheme)
        x, w, ids = torch.randn(3, H).bfloat16(), torch.rand(3, 2), torch.zeros(3, 2, dtype=torch.int32)
        s = wts.scales
        cfg = MoEConfig(TileConfig(*tiles, 8, 4, 3), TileConfig(*tiles, 8, 4, 3))
        with pytest.raises(ValueError, match=match):
            fused_moe_quant(x, wts.w13, wts.w2, None, None, s["w13_scale"], s["w2_scale"], s.get("w13_zero"),
                            s.get("w2_zero"), None, None, w, ids, None, get_scheme(scheme), "silu", config=cfg,
                            knobs=knobs, out_dtype=x.dtype)

    @pytest.mark.parametrize("K,bk,split,expected", [
        (768, 128, 1, (1, 768)), (768, 128, 4, (3, 256)),  # 6 tiles: 2 per split, 3 splits
        (768, 128, 8, (6, 128)), (14336, 128, 8, (8, 1792)), (40, 32, 2, (2, 32))])
    def test_k_splits_give_every_split_a_tile(K, bk, split, expected):
        assert _k_splits(K, bk, split) == expected

    def test_small_buffers_are_stored_to_stay_in_l2():
        from moekit.kernels.triton_moe import KEEP_IN_L2_BYTES, store_policy  # noqa: PLC0415

        assert store_policy(torch.empty(KEEP_IN_L2_BYTES // 2, dtype=torch.bfloat16, device="meta")) == "evict_last"
        assert store_policy(torch.empty(KEEP_IN_L2_BYTES // 2 + 1, dtype=torch.bfloat16, device="meta")) == ""
        assert store_policy(torch.empty(16384 * 8, 2048, dtype=torch.bfloat16, device="meta")) == ""  # prefill rows

    def test_sum_blocks_fill_the_gpu():
        assert _sum_block(16384, 2048) == 1024
        assert _sum_block(16, 2048) == 128  # 16 rows: narrow blocks, more programs
        assert _sum_block(1, 48) == 128

    @pytest.mark.parametrize("T,E,k,scheme", [(16, 8, 2, "int4_w4a16"), (64, 128, 8, "int8_w8a16"), (256, 64, 8, "int4_w4a16"),
                                              (16, 256, 8, "fp8_w8a8_block128"), (16384, 128, 8, "fp8_w8a8")])
    def test_search_space_fits_the_scheme(T, E, k, scheme):
        modes = modes_of(get_scheme(scheme))
        g1, g2 = quant_search_space(T, E, k, modes.kgroup, modes.act_dtype is None, modes.w_int4,
                                    modes.a_kscale or modes.w_kscale)
        assert g1 and all(bm in g2 for bm in {t.BLOCK_SIZE_M for t, _ in g1})
        for t, knobs in g1 + [c for cands in g2.values() for c in cands]:
            QuantKnobs(**knobs)
            check_tiles(MoEConfig(t, t), modes)
        if modes.act_dtype is None:
            assert {"prefetch1": True} in [kn for _, kn in g1]
            assert max(kn.get("split_k", 1) for cands in g2.values() for _, kn in cands) == 8
            folded = [t.BLOCK_SIZE_M for t, kn in g1 if kn.get("fold_w")]
            assert (64 in folded) == (T * k / E >= 16) and bool(folded) == (T * k / E >= 16)

else:
    from hypothesis import given
    from hypothesis import settings as hyp_settings
    from hypothesis import strategies as st

    import moekit.kernels.launch as launch
    from moekit.kernels.launch_quant import fused_moe_quant
    from moekit.quant import TOLERANCE, emulated_experts, quantize_experts, scheme_of

    def _weights(scheme, opts, E, H, I, gen):
        w13 = torch.randn(E, 2 * I, H, generator=gen) * H ** -0.5
        w2 = torch.randn(E, H, I, generator=gen) * I ** -0.5
        opts = dict(opts)
        if opts.pop("static", False):
            opts.update(a13_scale=torch.rand(E, generator=gen) * 0.004 + 0.008,
                        a2_scale=torch.rand(E, generator=gen) * 0.002 + 0.004)
        return quantize_experts(w13, w2, scheme, **opts)

    def _run(wts, x, w, ids, emap, config, knobs):
        s = wts.scales
        return fused_moe_quant(x, wts.w13, wts.w2, None, None, s["w13_scale"], s["w2_scale"], s.get("w13_zero"),
                               s.get("w2_zero"), s.get("a13_scale"), s.get("a2_scale"), w, ids, emap, scheme_of(wts),
                               "silu", config=config, knobs=knobs, out_dtype=x.dtype)

    def _case(scheme, opts, H, I, T, E, k, config, knobs, gen, n_remote=0):
        wts = _weights(scheme, opts, E, H, I, gen)
        emap = random_expert_map(E, n_remote, gen)
        ids = torch.stack([torch.randperm(E + n_remote, generator=gen)[:k] for _ in range(T)]).to(torch.int32)
        w = torch.rand(T, k, generator=gen) + 0.05
        x = torch.randn(T, H, generator=gen).half()
        out = _run(wts, x, w, ids, emap, config, knobs)
        ref = emulated_experts(x, wts, w, ids, expert_map=emap, act_dtype=triton_act_dtype(wts, x))
        assert out.dtype == x.dtype and torch.isfinite(out).all()
        err = rel_err(out, ref)
        assert err <= TOLERANCE[get_scheme(wts.quant).precision], err

    def _tiles(bm, bn1, bk1, bn2, bk2):
        return MoEConfig(TileConfig(bm, bn1, bk1, 8, 4, 2), TileConfig(bm, bn2, bk2, 8, 4, 2))

    # (scheme, options, H, I, tiles, knobs): each knob on a scheme it changes; odd T, expert maps.
    VARIANTS = [
        ("int4_w4a16", {"group_size": 32}, 64, 64, (16, 32, 32, 16, 32),
         dict(gate_up=True, prefetch1=True, prefetch2=True, split_k=2)),
        ("int4_w4a16", {"group_size": 32, "symmetric": False}, 64, 96, (16, 16, 32, 32, 32),
         dict(split_k=2)),                                                     # 3 K tiles over 2 splits
        ("int4_w4a16", {"group_size": 64, "symmetric": False}, 64, 64, (16, 32, 64, 32, 32),
         dict(w_convert="cast", gate_up=True, split_k=8)),                     # more splits than K tiles
        ("int8_w8a16", {"group_size": 32}, 64, 64, (16, 32, 32, 16, 32), dict(prefetch1=True, split_k=2)),
        ("int8_w8a16", {"group_size": 32, "symmetric": False}, 64, 32, (16, 16, 32, 32, 32),
         dict(gate_up=True, prefetch2=True)),
        # weight-only weights dequantized with their group scales before the product
        ("int4_w4a16", {"group_size": 32, "symmetric": False}, 64, 64, (16, 32, 32, 16, 32),
         dict(fold_w=True, gate_up=True, split_k=2)),
        ("int4_w4a16", {"group_size": 64}, 128, 64, (32, 32, 64, 32, 64), dict(fold_w=True, prefetch1=True)),
        ("int8_w8a16", {"group_size": 32, "symmetric": False}, 64, 64, (16, 32, 32, 16, 32),
         dict(fold_w=True, prefetch2=True)),
        ("int8_w8a16", {"group_size": 64}, 128, 64, (32, 32, 64, 32, 64), dict(fold_w=True, gate_up=True)),
        # paired int4 products (the bit-operation twin of the PTX): whole groups a K loop, the
        # offsets corrected per group from the rows' sums; GEMM1's tiles wider and narrower
        # than a group (sums of GEMM2's rows per group or per tile), split K over groups
        ("int4_w4a16", {"group_size": 32}, 64, 64, (16, 64, 32, 16, 32), dict(w_convert="pairs_bits", gate_up=True)),
        ("int4_w4a16", {"group_size": 64, "symmetric": False}, 64, 128, (16, 16, 32, 32, 32),
         dict(w_convert="pairs_bits", split_k=2)),
        ("int4_w4a16", {"group_size": 32, "symmetric": False}, 96, 64, (16, 32, 32, 32, 32),
         dict(w_convert="pairs_bits", gate_up=True, split_k=3)),
        ("fp8_w8a8_block128", {}, 128, 128, (16, 32, 64, 32, 64), dict(gate_up=True, split_k=2)),
        ("fp8_w8a8_block128", {}, 256, 128, (16, 64, 128, 256, 128), dict(fuse_x_quant=False)),  # 2 blocks a tile
        ("fp8_w8a8", {"static": True}, 48, 40, (16, 16, 32, 16, 32), dict(gate_up=True, split_k=2)),  # K masks
        ("fp8_w8a8", {"static": True}, 48, 40, (16, 16, 32, 16, 32), dict(fuse_x_quant=False)),
        ("fp8_w8a8", {}, 48, 40, (16, 16, 32, 16, 32), dict(split_k=3)),       # dynamic per tensor, not fused
        ("fp8_w8a8_channel", {}, 40, 24, (16, 16, 32, 16, 32), dict(gate_up=True)),
        ("int8_w8a8", {}, 40, 24, (16, 16, 32, 16, 32), dict(split_k=2)),
        # swapped products; 32 gate and 32 up columns in one 64-row product
        ("fp8_w8a8", {"static": True}, 64, 64, (32, 32, 32, 64, 32), dict(swap1=True, gate_up=True, swap2=True)),
    ]

    @hyp_settings(max_examples=10, deadline=None)
    @given(T=st.integers(1, 40), E=st.integers(1, 6), k=st.integers(1, 3), n_remote=st.integers(0, 2),
           group=st.sampled_from([32, 64]), h_groups=st.integers(1, 3), i_groups=st.integers(1, 3),
           symmetric=st.booleans(), bn1=st.sampled_from([16, 32, 64]), bn2=st.sampled_from([16, 32]),
           bm=st.sampled_from([16, 32]), gate_up=st.booleans(), split_k=st.integers(1, 3), seed=st.integers(0, 2**31 - 1))
    def test_paired_products_property(T, E, k, n_remote, group, h_groups, i_groups, symmetric, bn1, bn2, bm, gate_up,
                                      split_k, seed):
        """Paired int4 products (the twin of the PTX) on any routing and shape the groups allow:
        GEMM1 tiles wider or narrower than a group, K tiles of 32 within groups of 32 or 64,
        experts without tokens, non-local slots, split K over whole groups."""
        g = torch.Generator().manual_seed(seed)
        k = min(k, E + n_remote)
        knobs = dict(w_convert="pairs_bits", gate_up=gate_up, split_k=split_k)
        _case("int4_w4a16", {"group_size": group, "symmetric": symmetric}, group * h_groups, group * i_groups, T, E, k,
              _tiles(bm, bn1, 32, bn2, 32), QuantKnobs(**knobs), g, n_remote)

    @pytest.mark.parametrize("T,n_remote", [(1, 0), (7, 3)], ids=["T1", "T7-expert-map"])
    @pytest.mark.parametrize("scheme,opts,H,I,tiles,knobs", VARIANTS,
                             ids=[f"{v[0]}-{'-'.join(f'{k}={x}' for k, x in v[5].items())}" for v in VARIANTS])
    def test_variant_matches_emulated_reference(scheme, opts, H, I, tiles, knobs, T, n_remote, gen):
        _case(scheme, opts, H, I, T, 4, 2, _tiles(*tiles), QuantKnobs(**knobs), gen, n_remote)

    @pytest.mark.parametrize("scheme,opts", [("fp8_w8a8_block128", {}), ("fp8_w8a8", {"static": True}),
                                             ("fp8_w8a8_channel", {})])
    def test_x_quantized_in_the_chunked_alignment(scheme, opts, gen, monkeypatch):
        monkeypatch.setattr(launch, "ALIGN_SMALL_MAX", 0)  # two-launch alignment, x in its first
        _case(scheme, opts, 128, 128, 19, 5, 3, _tiles(16, 32, 64, 32, 64), QuantKnobs(split_k=2), gen, 2)

    @pytest.mark.parametrize("scheme", ["int4_w4a16", "int8_w8a16"])
    def test_folded_weight_scales_round_the_weights_once(scheme, gen):
        # fold_w multiplies weights rounded to x's dtype: other bits than the scaled integer
        # products, both within the scheme's bound
        wts = _weights(scheme, {"group_size": 32}, 4, 64, 64, gen)
        ids = torch.stack([torch.randperm(4, generator=gen)[:2] for _ in range(9)]).to(torch.int32)
        w, x = torch.rand(9, 2, generator=gen) + 0.05, torch.randn(9, 64, generator=gen).half()
        tiles = _tiles(16, 32, 32, 16, 32)
        ref = emulated_experts(x, wts, w, ids, act_dtype=triton_act_dtype(wts, x))
        outs = [_run(wts, x, w, ids, None, tiles, QuantKnobs(fold_w=f)) for f in (False, True)]
        assert not torch.equal(outs[0], outs[1])
        for out in outs:
            assert rel_err(out, ref) <= TOLERANCE[get_scheme(scheme).precision]

    def test_knob_misuse_is_refused(gen):
        wts = _weights("fp8_w8a8_block128", {}, 2, 128, 128, gen)
        x, w, ids = torch.randn(2, 128).half(), torch.rand(2, 1), torch.zeros(2, 1, dtype=torch.int32)
        with pytest.raises(ValueError, match="int4"):
            _run(wts, x, w, ids, None, None, QuantKnobs(w_convert="bits"))
        with pytest.raises(ValueError, match="int4"):
            _run(wts, x, w, ids, None, None, QuantKnobs(w_convert="ptx"))
        with pytest.raises(ValueError, match="knobs.fold_w dequantizes the weights of weight-only schemes"):
            _run(wts, x, w, ids, None, None, QuantKnobs(fold_w=True))
        with pytest.raises(ValueError, match="int4"):
            _run(wts, x, w, ids, None, None, QuantKnobs(w_convert="pairs_bits"))
        int4 = _weights("int4_w4a16", {}, 2, 128, 128, gen)
        with pytest.raises(ValueError, match="needs a CUDA GPU"):
            _run(int4, x, w, ids, None, None, QuantKnobs(w_convert="ptx"))
        with pytest.raises(ValueError, match="needs a CUDA GPU.*'pairs_bits' computes the same values"):
            _run(int4, x, w, ids, None, None, QuantKnobs(w_convert="pairs"))
        for other in ("fold_w", "prefetch1", "prefetch2"):
            with pytest.raises(ValueError, match=f"knobs.{other} does not combine with knobs.w_convert='pairs_bits'"):
                _run(int4, x, w, ids, None, None, QuantKnobs(w_convert="pairs_bits", **{other: True}))
        wts = _weights("fp8_w8a8", {}, 2, 48, 40, gen)
        with pytest.raises(ValueError, match="prefetch1 needs K=48"):
            _run(wts, torch.randn(2, 48).half(), w, ids, None, _tiles(16, 16, 32, 16, 32), QuantKnobs(prefetch1=True))
        with pytest.raises(ValueError, match="pdl needs a CUDA GPU"):
            _run(wts, torch.randn(2, 48).half(), w, ids, None, None, QuantKnobs(pdl=True))
        with pytest.raises(TypeError, match="knobs"):
            _run(wts, torch.randn(2, 48).half(), w, ids, None, None, {"split_k": 2})
        block = _weights("fp8_w8a8_block128", {}, 2, 256, 256, gen)
        with pytest.raises(ValueError, match="knobs.gluon=128 cannot run this call on the Gluon kernels"):
            _run(block, torch.randn(2, 256).half(), w, ids, None, None, QuantKnobs(gluon=128))

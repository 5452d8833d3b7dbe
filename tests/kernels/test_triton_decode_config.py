"""The decode knobs of the tile configs (SPLIT_K, GEMV, PDL): JSON round trips that leave the
shipped files valid, their checks, and how `moekit tune` searches and compiles them."""

import json
import os
from dataclasses import replace

import pytest
import torch

pytest.importorskip("triton")

from moekit.kernels.tuning import (  # noqa: E402
    DECODE_MAX, SHIPPED_DIR, MoEConfig, TileConfig, compile_variant, late_variants, parse_configs, search_space,
    use_direct,
)

BASE = {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 32, "BLOCK_SIZE_K": 256, "GROUP_SIZE_M": 1, "num_warps": 4, "num_stages": 3}


def test_knobs_at_defaults_are_left_out_of_the_json():
    cfg = MoEConfig(TileConfig(16, 32, 256, 1, 4, 3), TileConfig(16, 32, 256, 1, 4, 3))
    entry = cfg.to_json()
    assert set(entry) == set(BASE) | {"gemm2"} and set(entry["gemm2"]) == set(BASE) - {"BLOCK_SIZE_M"}


def test_knobs_round_trip_and_gemm2_does_not_inherit_gemm1s():
    cfg = MoEConfig(TileConfig(16, 32, 256, GEMV=1), TileConfig(16, 16, 512, SPLIT_K=8, GEMV=0, PDL=1))
    entry = cfg.to_json()
    assert entry["GEMV"] == 1 and "GEMV" not in entry["gemm2"] and entry["gemm2"]["SPLIT_K"] == 8
    assert parse_configs(json.dumps({"1": entry}), "f.json")[1] == cfg


def test_fused_knob_round_trips_and_engine_style_entries_stay_valid():
    cfg = MoEConfig(TileConfig(16, 64, 128, 1, 8, 4, GEMV=1, FUSED=1), TileConfig(16, 64, 128, 1, 4, 3, PDL=1))
    entry = cfg.to_json()
    assert entry["FUSED"] == 1 and "FUSED" not in entry["gemm2"]
    assert parse_configs(json.dumps({"1": entry}), "f.json")[1] == cfg


def test_engine_style_entry_shares_its_knobs_with_gemm2():
    table = parse_configs(json.dumps({"1": dict(BASE, GEMV=1)}), "f.json")
    assert table[1].gemm1.GEMV == table[1].gemm2.GEMV == 1


def test_shipped_files_carry_only_known_keys():
    for name in os.listdir(SHIPPED_DIR):
        if name.endswith(".json"):
            with open(os.path.join(SHIPPED_DIR, name), encoding="utf-8") as fh:
                table = parse_configs(fh.read(), name)
            for cfg in table.values():
                assert MoEConfig.from_json(cfg.to_json()) == cfg


@pytest.mark.parametrize("build,match", [
    (lambda: TileConfig(16, 16, 16, SPLIT_K=0), "SPLIT_K must be an int >= 1"),
    (lambda: TileConfig(16, 16, 16, GEMV=2), "GEMV must be 0 or 1"),
    (lambda: TileConfig(16, 16, 16, PDL=True), "PDL must be 0 or 1"),  # a bool is not a JSON int
    (lambda: MoEConfig(TileConfig(16, 16, 16, SPLIT_K=2), TileConfig(16, 16, 16)), "gemm1.SPLIT_K must be 1"),
    (lambda: MoEConfig(TileConfig(16, 16, 16, PDL=1), TileConfig(16, 16, 16)), "gemm1.PDL must be 0"),
    (lambda: parse_configs(json.dumps({"1": dict(BASE, gemm2={"SPLITK": 2})}), "f.json"), "gemm2 must hold"),
    (lambda: TileConfig(16, 16, 16, FUSED=2), "FUSED must be 0 or 1"),
    (lambda: MoEConfig(TileConfig(16, 16, 16), TileConfig(16, 16, 16, FUSED=1)), "gemm2.FUSED must be 0"),
    (lambda: MoEConfig(TileConfig(16, 16, 16, FUSED=1), TileConfig(16, 16, 16, SPLIT_K=2)),
     "gemm1.FUSED=1 has no GEMM2 launch to split"),
    (lambda: TileConfig(16, 16, 16, GEMV=1, PRE=3), "PRE must be 0, 1 or 2"),
    (lambda: MoEConfig(TileConfig(16, 16, 16, GEMV=1, PRE=1), TileConfig(16, 16, 16)), "gemm1.PRE must be 0"),
])
def test_bad_knobs_are_errors_naming_them(build, match):
    with pytest.raises(ValueError, match=match):
        build()


def test_direct_search_space_has_every_variant():
    g1, g2 = search_space(1, 128, 8)
    assert {c.GEMV for c in g1} == {0, 1}
    assert {(c.GEMV, c.SPLIT_K) for c in g2[16]} == {(v, s) for v in (0, 1) for s in (1, 2, 4, 8, 16)}
    # CUDA-core tiles stay small enough for registers: <= 32 (GEMM1, two tiles) / 64 weights a thread.
    assert all(c.BLOCK_SIZE_N * c.BLOCK_SIZE_K <= 32 * 32 * c.num_warps for c in g1 if c.GEMV)
    assert all(c.BLOCK_SIZE_N * c.BLOCK_SIZE_K <= 64 * 32 * c.num_warps for c in g2[16] if c.GEMV)
    assert not any(c.PDL for c in g1 + g2[16])  # PDL is a late variant


@pytest.mark.parametrize("T,E,k", [(16, 128, 8), (256, 64, 8), (256, 8, 2)])
def test_sorted_decode_space_splits_gemm2_only(T, E, k):
    assert not use_direct(T, k, E)
    g1, g2 = search_space(T, E, k)
    assert all(c.SPLIT_K == 1 and not c.GEMV for c in g1)
    for tiles in g2.values():
        assert {c.SPLIT_K for c in tiles} == {1, 2, 4} and not any(c.GEMV for c in tiles)
    # 32 rows per expert: a 64-row block holds them all (weights read once)
    assert (64 in {c.BLOCK_SIZE_M for c in g1}) == (T * k / E >= 32)


@pytest.mark.parametrize("T", [DECODE_MAX + 1, 4096])
def test_no_decode_knobs_above_decode_sizes(T):
    g1, g2 = search_space(T, 64, 8)
    assert all(c == TileConfig(*[getattr(c, n) for n in BASE]) for c in g1 + sum(g2.values(), []))


def test_late_variants_and_compile_variants():
    cfg = MoEConfig(TileConfig(16, 32, 256), TileConfig(16, 16, 512, SPLIT_K=8))
    pdl, pre1, pre2, *fused = late_variants(cfg, 1, 128, 8)
    assert pdl.gemm2.PDL == 1 and pdl.gemm1 == cfg.gemm1
    # GEMM2 also loads its first weight tiles before it waits for GEMM1 (PRE).
    assert (pre1.gemm2, pre2.gemm2) == (replace(pdl.gemm2, PRE=1), replace(pdl.gemm2, PRE=2))
    assert len(fused) == 10 and all(c.gemm1.FUSED and c.gemm2.SPLIT_K == 1 for c in fused)
    assert {c.gemm2.PDL for c in fused} == {0, 1}
    assert late_variants(pdl, 1, 128, 8) == [pre1, pre2] + fused and late_variants(pre1, 1, 128, 8) == fused
    assert late_variants(fused[0], 1, 128, 8) == []
    assert late_variants(cfg, 16, 128, 8) == []  # the sorted path: four launches, PDL not searched
    assert compile_variant(cfg).gemm2.SPLIT_K == 2 and compile_variant(pdl).gemm2.PDL == 1
    plain = MoEConfig(cfg.gemm1, TileConfig(16, 16, 512))
    assert compile_variant(plain) == plain


def test_tune_plans_compile_every_kernel_variant():
    from moekit.cli.tune import plan_shape

    plans, jobs = plan_shape(128, 8, 2048, 768, torch.bfloat16, (1,))
    entries = [MoEConfig.from_json(j[5]) for j in jobs]
    assert {e.gemm2.SPLIT_K for e in entries} == {1, 2}  # one compile serves every split count
    # every candidate is compiled also with PDL (a late variant of whichever wins)
    default, stage1, g2s = plans[1]
    for c in stage1 + [MoEConfig(default.gemm1, g2) for g2 in g2s[16]]:
        assert any(e.gemm1 == c.gemm1 and e.gemm2 == replace(c.gemm2, SPLIT_K=min(c.gemm2.SPLIT_K, 2), PDL=1)
                   for e in entries)

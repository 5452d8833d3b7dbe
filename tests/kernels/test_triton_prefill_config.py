"""Prefill knobs of the tile configs (kernels/tuning.py PrefillConfig): JSON round trips that
leave defaults out, files without them, validation, and the candidates `moekit tune` sweeps."""

import json

import pytest

pytest.importorskip("triton")

from moekit.kernels.tuning import (  # noqa: E402
    MoEConfig, PrefillConfig, TileConfig, parse_configs, prefill_space, search_space,
)

G1, G2 = TileConfig(128, 128, 64, 8, 8, 3), TileConfig(128, 256, 64, 8, 8, 3)


def test_json_holds_only_knobs_off_their_defaults_and_round_trips():
    cfg = MoEConfig(G1, G2, PrefillConfig(tma=0, programs_per_sm=1, tail=4))
    entry = cfg.to_json()
    assert entry["prefill"] == {"tma": 0, "tail": 4}
    assert parse_configs(json.dumps({"4096": entry}), "f.json")[4096] == cfg
    ws = MoEConfig(G1, G2, PrefillConfig(tma=2, tail=1, act_tma=1, ws=1))
    assert ws.to_json()["prefill"] == {"tma": 2, "tail": 1, "act_tma": 1, "ws": 1}
    assert parse_configs(json.dumps({"4096": ws.to_json()}), "f.json")[4096] == ws
    both = MoEConfig(G1, G2, PrefillConfig(tma=2, tail=1, flatten=1, act_tma=1))
    assert both.to_json()["prefill"] == {"tma": 2, "tail": 1, "flatten": 1, "act_tma": 1}
    assert parse_configs(json.dumps({"4096": both.to_json()}), "f.json")[4096] == both
    default = MoEConfig(G1, G2, PrefillConfig())
    assert default.to_json()["prefill"] == {}
    assert parse_configs(json.dumps({"1": default.to_json()}), "f.json")[1] == default


def test_entries_without_prefill_keep_the_sorted_kernels():
    entry = MoEConfig(G1, G2).to_json()
    assert "prefill" not in entry
    assert parse_configs(json.dumps({"1": entry}), "f.json")[1].prefill is None


@pytest.mark.parametrize("knobs,match", [
    (dict(tail=3), "tail must be one of"),
    (dict(tma=3), "tma must be one of"),
    (dict(tma=True), "tma must be one of"),            # a bool is not a 0/1 knob
    (dict(programs_per_sm=-1), "programs_per_sm must be an int >= 0"),
    (dict(flatten=1), "flatten=1 needs tail=1"),                       # tail 2 has a loop per tile size
    (dict(flatten=1, tail=1, programs_per_sm=0), "programs_per_sm >= 1"),  # nothing to flatten
    (dict(act_tma=1, tma=1), "act_tma=1 .* needs tma=2"),             # descriptors per tile height
    (dict(act_tma=2, tma=2), "act_tma must be one of"),
    (dict(x_tma=1, tma=0), "x_tma=1 .* needs tma=2"),
    (dict(ws=1, tma=2, tail=1), "ws=1 needs .*act_tma=1"),           # the producer loads by TMA only
    (dict(ws=1, tma=2, act_tma=1), "ws=1 needs .*tail=1"),           # one loop per tile
    (dict(ws=1, tma=2, act_tma=1, tail=1, programs_per_sm=0), "ws=1 needs .*programs_per_sm >= 1"),
    (dict(ws=2, tma=2, act_tma=1, tail=1), "ws must be one of"),
    (dict(gu1=1, tma=1), "gu1=1 .* needs tma=2"),                    # [2, BN, BK] blocks built in the kernel
])
def test_bad_knobs_are_errors(knobs, match):
    with pytest.raises(ValueError, match=match):
        PrefillConfig(**knobs)


@pytest.mark.parametrize("text,match", [
    (json.dumps({"1": dict(MoEConfig(G1, G2).to_json(), prefill={"stages": 3})}), r"f.json\[1\].prefill"),
    (json.dumps({"1": dict(MoEConfig(G1, G2).to_json(), prefill=[1])}), "must be an object"),
])
def test_bad_prefill_entries_name_the_key(text, match):
    with pytest.raises(ValueError, match=match):
        parse_configs(text, "f.json")


def test_row_granule_is_block_m_over_tail_and_at_least_16():
    assert MoEConfig(G1, G2, PrefillConfig(tail=4)).row_granule == 32
    assert MoEConfig(G1, G2).row_granule == 128
    small = TileConfig(32, 64, 64)
    with pytest.raises(ValueError, match="BLOCK_SIZE_M >= 64"):
        MoEConfig(small, small, PrefillConfig(tail=4))


def test_candidates_by_rows_per_expert():
    assert prefill_space(64, 8, 2) == []           # direct or few rows per expert: no prefill tiles
    assert prefill_space(1024, 256, 4) == []       # 16 rows per expert
    few = prefill_space(1024, 256, 8)              # 32 rows per expert: BLOCK_SIZE_M = 64 only
    assert few and {c.block_m for c in few} == {64}
    many = prefill_space(16384, 8, 2)              # 4096 rows per expert: BLOCK_SIZE_M = 128 only
    assert many and {c.block_m for c in many} == {128}
    mid = prefill_space(4096, 128, 8)
    assert {c.block_m for c in mid} == {64, 128}
    knobs = {(c.prefill.tma, c.prefill.programs_per_sm, c.prefill.tail) for c in mid}
    assert knobs == {(t, p, tail) for t in (0, 1) for p in (0, 1, 2) for tail in (1, 2, 4)} | \
        {(2, p, tail) for p in (0, 1, 2) for tail in (1, 2, 4)}
    # descriptors built in the kernel: weights alone on persistent grids; rows by TMA on both grids
    assert all(c.prefill.programs_per_sm for c in mid if c.prefill.tma == 2 and not c.prefill.act_tma)
    rows = {(c.prefill.act_tma, c.prefill.x_tma, c.prefill.flatten) for c in mid if c.prefill.tma == 2}
    assert rows == {(0, 0, 0), (1, 0, 0), (1, 1, 0), (1, 0, 1), (1, 1, 1)}
    flat = [c.prefill for c in mid if c.prefill.flatten]
    assert flat and all(f.tail == 1 and f.programs_per_sm >= 1 for f in flat)
    plain = [c for c in mid if not c.prefill.ws]
    assert {c.prefill.programs_per_sm for c in plain if c.gemm1.num_warps == 4 and c.block_m == 128} == {0, 2}
    # warp-specialized GEMM2 loops: 128-row tiles, one consumer warpgroup's num_warps, both x modes
    ws = [c for c in mid if c.prefill.ws]
    assert ws and {c.prefill.x_tma for c in ws} == {0, 1}
    assert all(c.block_m == 128 and c.gemm1.num_warps == 8 and c.gemm2.num_warps == 4 and c.prefill.tail == 1
               and c.prefill.act_tma and c.prefill.programs_per_sm == 1 for c in ws)
    assert not [c for c in prefill_space(1024, 256, 8) if c.prefill.ws]  # 32 rows per expert
    # gate and up in one product: descriptors built in the kernel only, both ways everywhere
    one = [c for c in mid if c.prefill.gu1]
    assert one and all(c.prefill.tma == 2 and c.prefill.act_tma for c in one)
    assert {c.prefill.ws for c in one} == {0, 1} and {c.prefill.tail for c in one} == {1, 2, 4}
    assert not [c for c in prefill_space(4096, 128, 8, elem_bytes=1) if c.prefill.ws]
    for cfg in mid:  # every candidate is a valid config that fits the SM90 limits
        assert cfg.row_granule >= 16 and MoEConfig.from_json(cfg.to_json()) == cfg
    # the sorted kernels' search space is unchanged by the prefill candidates
    assert search_space(4096, 128, 8)[0]

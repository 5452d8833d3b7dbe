"""Tile configs of the Triton experts: file names, parsing, nearest-M lookup, the user folder,
the shipped files, the heuristics and search space; the backend's refusals on CPU."""

import dataclasses
import json
import os
import re

import pytest
import torch

pytest.importorskip("triton")

from moekit.config import settings  # noqa: E402
from moekit.experts.base import ExpertsProblem  # noqa: E402
from moekit.experts.triton_experts import TritonBackend  # noqa: E402
from moekit.kernels import tuning  # noqa: E402
from moekit.kernels.tuning import (  # noqa: E402
    SHIPPED_DIR, MoEConfig, TileConfig, config_file_name, default_config, get_config, parse_configs, search_space,
    use_direct,
)
from moekit.oracle import PRIORITIES, explain  # noqa: E402
from moekit.quant import get_scheme  # noqa: E402

ENTRY = {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 1, "num_warps": 4, "num_stages": 4}


def test_file_name_format():
    assert config_file_name(8, 14336, "NVIDIA_H200") == "E=8,N=14336,device_name=NVIDIA_H200.json"
    assert (config_file_name(64, 1024, "NVIDIA_H200", "float32", (128, 128))
            == "E=64,N=1024,device_name=NVIDIA_H200,dtype=float32,block_shape=[128,128].json")


def test_parse_engine_style_file_uses_one_config_for_both_gemms():
    table = parse_configs(json.dumps({"1": ENTRY, "64": dict(ENTRY, BLOCK_SIZE_M=32)}), "f.json")
    assert sorted(table) == [1, 64]
    assert table[1].gemm1 == table[1].gemm2 == TileConfig(16, 64, 128, 1, 4, 4)
    assert table[64].block_m == 32


def test_engine_file_with_its_triton_version_loads():
    """The engines' tuners write the Triton version beside the entries; it is not a token count."""
    text = json.dumps({"triton_version": "3.4.0", "1": ENTRY, "64": dict(ENTRY, BLOCK_SIZE_M=32)})
    assert sorted(parse_configs(text, "f.json")) == [1, 64]
    with pytest.raises(ValueError, match="non-empty"):  # the version alone is no table
        parse_configs(json.dumps({"triton_version": "3.4.0"}), "f.json")
    with pytest.raises(ValueError, match="keys must be token counts"):  # only as a version string
        parse_configs(json.dumps({"triton_version": ENTRY, "1": ENTRY}), "f.json")


def test_parse_moekit_file_with_own_gemm2_tiles_round_trips():
    cfg = MoEConfig(TileConfig(64, 128, 64, 8, 8, 3), TileConfig(64, 256, 64, 8, 8, 4))
    assert parse_configs(json.dumps({"4096": cfg.to_json()}), "f.json")[4096] == cfg


@pytest.mark.parametrize("text,match", [
    ("not json", "not valid JSON"),                                     # garbage
    ("{}", "non-empty object"),                                         # empty table
    (json.dumps({"x": ENTRY}), "keys must be token counts"),            # key not an int
    (json.dumps({"1": {"BLOCK_SIZE_M": 16}}), "lacks"),                 # missing fields
    (json.dumps({"1": dict(ENTRY, BLOCK_SIZE_N=48)}), "power of two"),  # bad tile
    (json.dumps({"1": dict(ENTRY, gemm2={"BLOCK_SIZE_M": 32})}), "gemm2"),  # gemm2 may not change rows
])
def test_parse_errors_name_the_problem(text, match):
    with pytest.raises(ValueError, match=match):
        parse_configs(text, "f.json")


@pytest.mark.parametrize("entry,pattern,quant", [
    (dict(ENTRY, BLOCK_SIZE_N=48), r"\[64\]: BLOCK_SIZE_N must be a power of two", None),
    (dict(ENTRY, num_warps="4"), r"\[64\]: num_warps must be an int", None),
    (dict(ENTRY, gemm2={"BLOCK_SIZE_K": 24}), r"\[64\]\.gemm2: BLOCK_SIZE_K", None),
    (dict(ENTRY, SPLIT_K=2), r"\[64\]: gemm1\.SPLIT_K must be 1", None),
    (dict(ENTRY, prefill={"tma": 3}), r"\[64\]\.prefill: prefill tma", None),
    (dict(ENTRY, quant={"split_k": 0}), r"\[64\]\.quant: split_k", "quant"),
    (dict(ENTRY, quant={"fold_w": 1}), r"\[64\]\.quant: fold_w must be a bool", "quant"),
])
def test_bad_values_in_a_user_file_name_the_file_and_key(entry, pattern, quant, tmp_path, monkeypatch):
    from moekit.kernels import quant_tuning

    name = config_file_name(7, 96, "Fake_GPU", "int8_w8a16" if quant else None)
    (tmp_path / name).write_text(json.dumps({"1": ENTRY, "64": entry}))
    monkeypatch.setattr(tuning, "settings", dataclasses.replace(settings, tuned_config_dir=str(tmp_path)))
    tuning.load_configs.cache_clear()
    quant_tuning.load_quant_configs.cache_clear()
    try:
        with pytest.raises(ValueError, match=re.escape(str(tmp_path / name)) + pattern):
            if quant:
                quant_tuning.load_quant_configs(7, 96, "Fake_GPU", "int8_w8a16", None)
            else:
                tuning.load_configs(7, 96, "Fake_GPU", None)
    finally:
        tuning.load_configs.cache_clear()
        quant_tuning.load_quant_configs.cache_clear()


def test_a_user_file_that_is_not_text_names_the_file(tmp_path, monkeypatch):
    path = tmp_path / config_file_name(7, 96, "Fake_GPU")
    path.write_bytes(b'{"1": \xff\xfe}')
    monkeypatch.setattr(tuning, "settings", dataclasses.replace(settings, tuned_config_dir=str(tmp_path)))
    tuning.load_configs.cache_clear()
    try:
        with pytest.raises(ValueError, match=re.escape(str(path)) + " is not UTF-8 text"):
            tuning.load_configs(7, 96, "Fake_GPU", None)
    finally:
        tuning.load_configs.cache_clear()


def test_mismatched_row_blocks_are_an_error():
    with pytest.raises(ValueError, match="gemm2.BLOCK_SIZE_M"):
        MoEConfig(TileConfig(16, 64, 64), TileConfig(32, 64, 64))


def test_nearest_m_lookup_and_user_folder_first(tmp_path, monkeypatch):
    table = {"1": ENTRY, "64": dict(ENTRY, BLOCK_SIZE_M=32), "4096": dict(ENTRY, BLOCK_SIZE_M=128)}
    (tmp_path / config_file_name(7, 96, "Fake_GPU")).write_text(json.dumps(table))
    monkeypatch.setattr(tuning, "settings", dataclasses.replace(settings, tuned_config_dir=str(tmp_path)))
    tuning.load_configs.cache_clear()
    try:
        get = lambda T: get_config(T, 7, 2, 32, 96, torch.bfloat16, "Fake_GPU").block_m  # noqa: E731
        assert [get(1), get(30), get(40), get(1000), get(100000)] == [16, 16, 32, 32, 128]
        # float32 files carry a dtype: none here, so the heuristic answers.
        assert get_config(4096, 7, 2, 32, 96, torch.float32, "Fake_GPU") == default_config(4096, 7, 2, 32, 96, 4)
    finally:
        tuning.load_configs.cache_clear()


def test_shipped_files_parse_and_are_named_for_the_h200():
    from moekit.kernels.quant_tuning import parse_quant_configs

    names = [n for n in os.listdir(SHIPPED_DIR) if n.endswith(".json")]
    float_names = [n for n in names if re.fullmatch(r"E=\d+,N=\d+,device_name=NVIDIA_H200\.json", n)]
    assert len(float_names) == 5  # the five PERF.md shapes
    for name in names:
        quant = re.fullmatch(r"E=\d+,N=\d+,device_name=NVIDIA_H200,dtype=(fp8_w8a8|int8_w8a16|int4_w4a16)"
                             r"(,block_shape=\[128,128\])?\.json", name)
        assert name in float_names or quant, name
        with open(os.path.join(SHIPPED_DIR, name), encoding="utf-8") as fh:
            text = fh.read()
        assert (parse_configs if name in float_names else parse_quant_configs)(text, name)


@pytest.mark.parametrize("T,E,k,expected", [
    (1, 8, 2, True),        # one token is always direct
    (2, 128, 8, True),      # 16 assignments over 128 experts: few collisions
    (2, 8, 2, False),       # 4 assignments over 8 experts: collisions are likely
    (64, 128, 8, False),
])
def test_direct_path_rule(T, E, k, expected):
    assert use_direct(T, k, E) is expected


@pytest.mark.parametrize("T", [1, 16, 256, 4096, 65536])
def test_heuristics_and_search_space_fit_the_gpu(T):
    for E, k in ((8, 2), (128, 8)):
        cfg = default_config(T, E, k, 4096, 1024)
        assert cfg.gemm1.smem_bytes(2, 2) <= 220 * 1024 and cfg.gemm2.smem_bytes(2, 1) <= 220 * 1024
        g1, g2 = search_space(T, E, k)
        assert g1 and g2
        assert all(c.smem_bytes(2, 2) <= 220 * 1024 for c in g1)
        assert {c.BLOCK_SIZE_M for c in g1} <= set(g2)


def test_the_rules_follow_the_capability_of_the_named_gpu(monkeypatch):
    names, caps = ["NVIDIA A100-SXM4-80GB", "NVIDIA H200"], [(8, 0), (9, 0)]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=None: names[i or 0])
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=None: caps[i or 0])  # current: the A100
    tuning._index_of.cache_clear()
    try:
        assert tuning.on_hopper("NVIDIA_H200") and not tuning.on_hopper("NVIDIA_A100-SXM4-80GB")
        assert not tuning.on_hopper("NO_SUCH_GPU") and not tuning.on_hopper(None)  # unknown name: the current GPU
    finally:
        tuning._index_of.cache_clear()


def test_expert_parallel_calls_look_tiles_up_by_their_share_of_the_tokens(monkeypatch):
    from moekit.kernels import launch, launch_quant  # noqa: PLC0415
    from moekit.kernels.launch import config_tokens  # noqa: PLC0415
    from moekit.quant import quantize_experts  # noqa: PLC0415

    emap = torch.full((64,), -1, dtype=torch.int32)
    emap[8:16] = torch.arange(8, dtype=torch.int32)  # 8 of 64 experts local
    assert config_tokens(4096, 8, None) == 4096 and config_tokens(4096, 8, emap) == 512
    assert config_tokens(3, 8, emap) == 1 and config_tokens(4096, 64, torch.arange(64, dtype=torch.int32)) == 4096

    class Looked(Exception):
        pass

    def spy(T, *args, **kwargs):
        raise Looked(T)

    monkeypatch.setattr(launch, "get_config", spy)
    monkeypatch.setattr(launch_quant, "quant_tiles", spy)
    T, H, I = 1024, 64, 32
    x, w = torch.randn(T, H, dtype=torch.bfloat16), torch.rand(T, 4)
    ids = torch.randint(0, 64, (T, 4), dtype=torch.int32)
    w13, w2 = torch.randn(8, 2 * I, H), torch.randn(8, H, I)
    for emap_arg, expected in ((None, T), (emap, T // 8)):
        with pytest.raises(Looked) as got:
            launch.fused_moe(x, w13.bfloat16(), w2.bfloat16(), None, None, w, ids, emap_arg, "silu")
        assert got.value.args[0] == expected
        q = quantize_experts(w13, w2, "fp8_w8a8")
        with pytest.raises(Looked) as got:
            launch_quant.fused_moe_quant(x, q.w13, q.w2, None, None, q.scales["w13_scale"], q.scales["w2_scale"], None,
                                         None, None, None, w, ids, emap_arg, get_scheme("fp8_w8a8"), "silu",
                                         out_dtype=x.dtype)
        assert got.value.args[0] == expected


def test_a_missing_table_is_said_once_at_info(caplog):
    tuning.load_configs.cache_clear()
    with caplog.at_level("INFO", logger="moekit"):
        for _ in range(3):
            assert get_config(256, 6, 2, 512, 300, torch.bfloat16, "NO_SUCH_GPU") == default_config(256, 6, 2, 512, 300)
    said = [r.getMessage() for r in caplog.records if "no tuned Triton table" in r.getMessage()]
    assert len(said) == 1 and config_file_name(6, 300, "NO_SUCH_GPU") in said[0] and "moekit tune" in said[0]


def test_untuned_16bit_calls_on_hopper_take_the_prefill_kernels(monkeypatch):
    # rows an expert T * k / E on an untuned shape (E = 64, k = 8: T / 8 rows)
    cfg = lambda T, dtype=torch.bfloat16, H=2048, I=1408, dev="NO_SUCH_GPU", **kw: get_config(  # noqa: E731
        T, 64, 8, H, I, dtype, dev, **kw)
    off_hopper = [cfg(T) for T in (64, 128, 512, 4096)]
    assert off_hopper == [default_config(T, 64, 8, 2048, 1408) for T in (64, 128, 512, 4096)]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    mid, large = tuning._HOPPER_MID, tuning._HOPPER_LARGE
    assert [cfg(T) for T in (64, 127, 128, 511, 512, 4096)] == [
        default_config(64, 64, 8, 2048, 1408), default_config(127, 64, 8, 2048, 1408), mid, mid, large, large]
    assert cfg(4096, dtype=torch.float16) == large
    assert cfg(4096, dtype=torch.float32) == default_config(4096, 64, 8, 2048, 1408, 4)  # fp32: no rule
    assert cfg(4096, I=1404) == default_config(4096, 64, 8, 2048, 1404)  # rows TMA cannot read
    assert cfg(4096, dev=None) == default_config(4096, 64, 8, 2048, 1408)  # no CUDA device name
    assert cfg(4096, untuned_prefill=False) == default_config(4096, 64, 8, 2048, 1408)  # the quantized kernels
    # a tuned table wins
    assert get_config(4096, 8, 2, 4096, 14336, torch.bfloat16, "NVIDIA_H200") == \
        tuning.load_configs(8, 14336, "NVIDIA_H200", None)[4096]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    assert [cfg(T) for T in (64, 128, 512, 4096)] == off_hopper


def test_backend_says_why_not_on_cpu_without_interpreter():
    p = ExpertsProblem("cpu", torch.float32, torch.float32, "silu", False, False, False, 8, 64, 32, 2)
    reason = TritonBackend().unsupported(p)
    if settings.triton_interpret:
        assert reason is None
    else:
        assert "TRITON_INTERPRET=1" in reason
    q = dataclasses.replace(p, device="cuda", quant="fp8")  # a precision, not a scheme name
    assert "not registered" in TritonBackend().unsupported(q)
    assert "differs" in TritonBackend().unsupported(dataclasses.replace(p, device="cuda", weight_dtype=torch.float16))


def test_oracle_prefers_triton_on_cuda():
    assert PRIORITIES["unquantized"]["cuda"][0] == "triton"
    p = ExpertsProblem("cuda", torch.bfloat16, torch.bfloat16, "silu", False, False, False, 8, 64, 32, 2)
    assert explain(p)[0][0] == "triton"


def test_tune_plans_compile_jobs_and_writes_a_readable_file(tmp_path):
    from moekit.cli.tune import plan_shape, write_configs

    plans, jobs = plan_shape(8, 2, 64, 32, torch.bfloat16, (1, 256))
    assert sorted(plans) == [1, 256]
    default, stage1, g2s = plans[256]
    assert stage1[0] == default and all(c.block_m in g2s for c in stage1)
    assert {j[4] for j in jobs} == {True, False}  # direct for M = 1, sorted for M = 256
    path = write_configs({M: plans[M][0] for M in plans}, 8, 32, "Fake_GPU", torch.bfloat16, str(tmp_path))
    assert os.path.basename(path) == "E=8,N=32,device_name=Fake_GPU.json"
    with open(path, encoding="utf-8") as fh:
        assert parse_configs(fh.read(), path) == {M: plans[M][0] for M in plans}


@pytest.mark.parametrize("argv,match", [
    (["tune", "--experts", "8"], "give --shape or all of"),         # incomplete shape
    (["tune", "--shape", "olmoe-1b-7b", "--batch-sizes", "x"], "--batch-sizes must be comma-separated"),
])
def test_tune_cli_errors(argv, match, capsys):
    from moekit.cli.main import main

    assert main(argv) == 2
    assert match in capsys.readouterr().err


def test_budgeted_timings_measure_each_candidate_once_within_the_budget():
    from moekit.cli.tune import BudgetedTimings

    calls, lines = [], []
    timed = BudgetedTimings(16, lambda c: calls.append(c) or float(len(c)), str.upper, str, budget_s=None,
                            step=lines.append)
    assert [timed(c) for c in ("ab", "abc", "ab")] == [2.0, 3.0, 2.0]
    assert calls == ["ab", "abc"] and timed.items == {"AB": "ab", "ABC": "abc"}
    assert lines == ["M=16 ab: 2.0 us", "M=16 abc: 3.0 us"]  # one line per candidate timed
    spent = BudgetedTimings(16, lambda c: 1.0, str, str, budget_s=-1.0)
    assert spent("x") == 1.0 and spent("y") == float("inf")  # the first always times; then out of budget


def test_tune_times_the_tiles_calls_take_now_as_its_baseline():
    from moekit.cli.tune import plan_shape

    plans, jobs = plan_shape(8, 2, 4096, 14336, torch.bfloat16, (128, 4096), device="NVIDIA_H200")
    table = tuning.load_configs(8, 14336, "NVIDIA_H200", None)
    for M in (128, 4096):
        current, stage1, _ = plans[M]
        assert current == table[M] and stage1[0] == default_config(M, 8, 2, 4096, 14336)
        assert current.to_json() in [job[-1] for job in jobs]  # compiled with the candidates


def test_tune_search_dry_run_off_the_gpu_keeps_the_heuristic():
    from moekit.cli.tune import plan_shape, search_shape

    plans, _ = plan_shape(8, 2, 64, 32, torch.float32, (64,))
    table, info = search_shape(8, 2, 64, 32, torch.float32, plans, budget_s=1.0, device="cpu")
    assert info[64]["tried"] == 0 and info[64]["us"] == float("inf")
    assert table[64] in plans[64][1]


def test_tune_confirms_the_fastest_by_median_of_interleaved_rounds():
    from moekit.cli.tune import confirm_fastest

    first = {"a": 10.0, "b": 10.4, "c": 11.0, "d": 30.0, "failed": float("inf")}
    later = {"a": [12.0, 12.1, 11.9], "b": [10.3, 10.5, 10.4], "c": [10.9, 11.2, 11.0]}
    order = []

    def measure(key):
        order.append(key)
        return later[key][sum(1 for k in order if k == key) - 1]

    winner, times = confirm_fastest(first, measure, top=3, rounds=3)
    assert winner == "b"                                  # a's first timing was the lucky one
    assert set(times) == {"a", "b", "c"}                  # the three fastest finite ones only
    assert times["b"] == [10.4, 10.3, 10.5, 10.4]
    assert order == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]  # each round starts one later
    # one runnable candidate: nothing to confirm; none: an error
    assert confirm_fastest({"x": 5.0, "y": float("inf")}, measure) == ("x", {"x": [5.0]})
    with pytest.raises(ValueError, match="no candidate ran"):
        confirm_fastest({"y": float("inf")}, measure)


def test_quantized_tune_plans_searches_and_writes_a_readable_table(tmp_path):
    # moekit tune --quant: candidates per M (the prefill kernels only for static fp8 scales and
    # 32 rows or more per expert), compile jobs, a dry run off the GPU (nothing times: the
    # current choice stays), and a table that reads back with its knobs.
    from moekit.benchmarks.gpu import quant_entry
    from moekit.cli.tune_quant import plan_quant, search_quant, write_quant_configs
    from moekit.kernels.quant_tuning import QuantKnobs, parse_quant_configs

    plans, jobs = plan_quant(8, 2, 256, 128, (16, 1024), "fp8_w8a8", True)
    assert sorted(plans) == [16, 1024]
    assert plans[16]["prefill"] == [] and plans[1024]["prefill"]
    assert all(c.prefill is not None for c in plans[1024]["prefill"])
    assert all(cfg.block_m in plans[1024]["g2"] for cfg, _ in plans[1024]["g1"])
    assert len({json.dumps(j, sort_keys=True) for j in jobs}) == len(jobs)  # each kernel set compiled once per M
    assert {tuple(j[:4]) for j in jobs} == {("fp8_w8a8", True, 256, 128)} and {j[4] for j in jobs} == {16, 64}
    # GEMM1 candidates of the current choice's rows per tile run beside its GEMM2 and GEMM2 knobs
    from moekit.cli.tune_quant import gemm1_candidate
    from moekit.kernels.tuning import MoEConfig, TileConfig
    g2s = plans[16]["g2"]
    cur = (MoEConfig(TileConfig(16, 64, 128), TileConfig(16, 64, 128, 8, 4, 4)), QuantKnobs(swap2=True, pdl=True))
    cfg, kn = gemm1_candidate(TileConfig(16, 32, 128), {"gate_up": True, "swap1": True}, g2s, cur)
    assert cfg.gemm2 == cur[0].gemm2 and kn == QuantKnobs(gate_up=True, swap1=True, swap2=True)
    g2s = plans[1024]["g2"]  # rows per tile 64 and 128; a current choice of 64: 128-row candidates
    cur = (MoEConfig(TileConfig(64, 64, 128), TileConfig(64, 128, 128)), QuantKnobs(split_k=2))
    cfg, kn = gemm1_candidate(TileConfig(128, 64, 128), {"gate_up": True}, g2s, cur)
    assert cfg.gemm2 == g2s[128][0][0] and kn == QuantKnobs(gate_up=True)  # ... take the first of theirs
    dyn, _ = plan_quant(8, 2, 256, 128, (1024,), "fp8_w8a8_block128", False)
    assert dyn[1024]["prefill"] == []
    with pytest.raises(ValueError, match="static activation scales take a per-tensor fp8 scheme"):
        plan_quant(8, 2, 256, 128, (16,), "int4_w4a16", True)

    table, info = search_quant(8, 2, 256, 128, {16: plans[16]}, "fp8_w8a8", True, device="cpu")
    assert table[16] == plans[16]["default"] and info[16]["tried"] == 0
    pre = plans[1024]["prefill"][0]
    table = {16: table[16], 1024: (plans[1024]["g1"][0][0], QuantKnobs(gate_up=True, static_prefill=pre))}
    path = write_quant_configs(table, 8, 128, "Fake_GPU", "fp8_w8a8", str(tmp_path))
    assert os.path.basename(path) == "E=8,N=128,device_name=Fake_GPU,dtype=fp8_w8a8.json"
    with open(path, encoding="utf-8") as fh:
        back = parse_quant_configs(fh.read(), path)
    assert back == table
    assert quant_entry(*back[1024])["quant"]["static_prefill"] == pre.to_json()
    # an entry with static_prefill is timed as a call without a config runs it: on its prefill config
    from moekit.cli.tune_quant import as_called
    assert as_called(*back[1024]) == (pre, back[1024][1])
    assert as_called(*back[16]) == back[16]


def test_quantized_tune_cli_checks_its_flags():
    from moekit.cli.main import main

    assert main(["tune", "--shape", "olmoe-1b-7b", "--quant", "int8_w8a16", "--static-scales"]) == 2
    with pytest.raises(SystemExit):
        main(["tune", "--shape", "olmoe-1b-7b", "--quant", "fp9"])  # not a scheme: argparse refuses


def test_backend_refuses_rocm_builds_with_the_reason(monkeypatch):
    # A ROCm torch calls its GPUs "cuda"; the kernels are NVIDIA's, so the oracle must not pick them there.
    import moekit.experts.triton_experts as te

    monkeypatch.setattr(te, "settings", dataclasses.replace(settings, triton_interpret=False))
    monkeypatch.setattr(torch.version, "hip", "6.2.41133", raising=False)
    reason = TritonBackend().available()
    assert reason is not None and "ROCm build (6.2.41133)" in reason


def test_shipped_quantized_entries_pass_the_launchers_checks():
    # Every M entry of the shipped quantized tables as a call on the H200 reads it (quant_tiles),
    # for every scheme that reads its file, on its shape's sizes: tiles and knobs the launcher
    # would refuse on the GPU are refused here. Weight-only tables serve every group size, so a
    # group finer than the tuned K tiles gets them cut to its groups.
    from moekit.benchmarks.gpu import GPU_SHAPES
    from moekit.kernels.launch_quant import check_knobs, check_tiles, fit_knobs, quant_tiles
    from moekit.kernels.quant_rows import modes_of
    from moekit.kernels.quant_tuning import parse_quant_configs, quant_file_name
    from moekit.quant import get_scheme

    schemes = [get_scheme(n) for n in ("fp8_w8a8", "fp8_w8a8_channel", "fp8_w8a8_block128", "int8_w8a16")]
    schemes += [get_scheme("int4_w4a16", group_size=g) for g in (32, 64, 128)]
    schemes += [get_scheme("int8_w8a16", group_size=64, symmetric=False)]
    checked = refit = 0
    for _, E, k, H, I in GPU_SHAPES:
        for scheme in schemes:
            path = os.path.join(SHIPPED_DIR, quant_file_name(E, I, "NVIDIA_H200", scheme))
            if not os.path.exists(path):
                continue
            with open(path, encoding="utf-8") as fh:
                table = parse_quant_configs(fh.read(), path)
            modes = modes_of(scheme)
            for M, (tuned_cfg, tuned_knobs) in table.items():
                cfg, knobs = quant_tiles(M, E, k, H, I, torch.bfloat16, "NVIDIA_H200", scheme, modes)
                assert knobs == tuned_knobs and cfg.gemm1.BLOCK_SIZE_N == tuned_cfg.gemm1.BLOCK_SIZE_N
                if modes.kgroup:
                    assert modes.kgroup % cfg.gemm1.BLOCK_SIZE_K == 0 and modes.kgroup % cfg.gemm2.BLOCK_SIZE_K == 0
                check_knobs(cfg, knobs, scheme, modes, knobs.gate_up, H, I)
                # the same entry for an activation without gate and up rows: what it cannot take is off
                plain = fit_knobs(cfg, knobs, scheme, modes, False, H, I)
                check_knobs(cfg, plain, scheme, modes, False, H, I)
                refit += plain != knobs
                if knobs.static_prefill is not None:
                    check_tiles(knobs.static_prefill, modes_of(get_scheme("fp8_w8a8")))
                checked += 1
    assert checked >= 60 and refit  # swapped 32-column gate_up tiles lose swap1 there


def test_tuned_knobs_are_fitted_explicit_ones_refused():
    from moekit.kernels.launch_quant import check_knobs, fit_knobs
    from moekit.kernels.quant_rows import modes_of
    from moekit.kernels.quant_tuning import QuantKnobs
    from moekit.quant import get_scheme

    cfg = MoEConfig(TileConfig(16, 32, 128), TileConfig(16, 64, 128))
    fp8, int4 = get_scheme("fp8_w8a8"), get_scheme("int4_w4a16")
    knobs = QuantKnobs(gate_up=True, swap1=True, swap2=True, prefetch1=True, pdl=True)
    assert fit_knobs(cfg, knobs, fp8, modes_of(fp8), True, 256, 128) == knobs
    assert fit_knobs(cfg, knobs, fp8, modes_of(fp8), False, 256, 128) == dataclasses.replace(knobs, swap1=False)
    assert fit_knobs(cfg, knobs, fp8, modes_of(fp8), True, 200, 128) == dataclasses.replace(knobs, prefetch1=False)
    assert fit_knobs(cfg, knobs, int4, modes_of(int4), True, 256, 128) == dataclasses.replace(knobs, swap1=False, swap2=False)
    with pytest.raises(ValueError, match="knobs.swap1 needs config.gemm1's BLOCK_SIZE_N a multiple of 64"):
        check_knobs(cfg, knobs, fp8, modes_of(fp8), False, 256, 128)
    with pytest.raises(ValueError, match="knobs.w_convert='ptx' applies to int4 weights"):
        check_knobs(cfg, QuantKnobs(w_convert="ptx"), fp8, modes_of(fp8), True, 256, 128)

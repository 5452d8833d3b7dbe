"""The scripts under bench/ (GPU benchmarks and A/Bs run on an H200) keep working as the package
changes: each imports, two entry A/Bs complete their CPU dry runs under Triton's interpreter,
and the Nsight Compute summary maps kernels to points."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
SCRIPTS = sorted(BENCH.glob("*.py"))


def _load(path: Path):
    spec = importlib.util.spec_from_file_location(f"bench_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(BENCH))  # scripts that import a sibling
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCH))
    return module


@pytest.mark.parametrize("path", SCRIPTS, ids=[p.stem for p in SCRIPTS])
def test_bench_script_imports(path):
    # Top-level code only (main() is guarded): a helper the script imports from moekit that was
    # renamed or removed fails here rather than on the GPU machine.
    _load(path)


def _dry_run(script: str, args: list, tmp_path: Path) -> dict:
    out = tmp_path / "out.json"
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT / "src"))
    proc = subprocess.run([sys.executable, str(BENCH / script), "--device", "cpu", "--rounds", "1", "--out", str(out),
                           *args], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(out.read_text())


TINY_ENTRY = json.dumps({"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 32, "BLOCK_SIZE_K": 32, "GROUP_SIZE_M": 8,
                         "num_warps": 4, "num_stages": 2})


def test_entry_ab_dry_run(tmp_path):
    result = _dry_run("entry_ab_h200.py", ["--point", "tiny:16", "--entry", TINY_ENTRY, "--default"], tmp_path)
    variants = result["rows"][0]["variants"]
    assert set(variants) == {"A", "B", "default"}
    for v in variants.values():
        assert v["within_bf16_bound"] and v["us"] > 0


def test_quant_entry_ab_dry_run(tmp_path):
    result = _dry_run("quant_entry_ab_h200.py", ["--point", "tiny:fp8_w8a8:s:5", "--entry", TINY_ENTRY, "--bf16"],
                      tmp_path)
    variants = result["rows"][0]["variants"]
    assert set(variants) == {"A", "B"}
    assert all(v["rel_err_vs_A"] < 0.05 and v["us"] > 0 for v in variants.values())
    assert result["rows"][0]["bf16_us"] > 0


def test_ncu_summary_maps_kernels_to_their_points(tmp_path):
    summary = _load(BENCH / "ncu_summary.py")
    names = ["ID", "Kernel Name", "gpu__time_duration.sum", "dram__bytes_read.sum", "dram__bytes_write.sum",
             "smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio"]
    units = ["", "", "us", "Gbyte", "Mbyte", "inst"]
    rows = [["0", "gemm1_kernel", "100.0", "0.4", "2.0", "5.5"],
            ["1", "gemm2_kernel", "50.0", "0.2", "1,000.0", "3.0"],
            ["2", "reduce_kernel", "250.0", "1.0", "0.0", "1.0"]]
    raw = tmp_path / "raw.csv"
    raw.write_text("\n".join(",".join(f'"{c}"' for c in r) for r in [names, units] + rows) + "\n")
    log = tmp_path / "log.txt"
    log.write_text('==PROF== Profiling "gemm1_kernel" - 0\n==PROF== Profiling "gemm2_kernel" - 1\n'
                   "profiled qwen3:fp8_w8a8:16:static\n==PROF== Profiling \"reduce_kernel\" - 2\nprofiled the read\n")
    out = summary.summarize(str(raw), str(log))
    assert [r["point"] for r in out] == ["qwen3:fp8_w8a8:16:static", "qwen3:fp8_w8a8:16:static", "the read"]
    assert out[0]["dram_tb_s"] == pytest.approx((0.4 + 0.002) / 100e-6 / 1e12 * 1e9)  # GB over us, in TB/s
    assert out[1]["dram_write_mb"] == 1000.0  # thousands separators
    assert out[0]["stalls_per_issue"] == {"long_scoreboard": 5.5}


def test_sass_offline_compiles_a_call_for_sm90(tmp_path):
    """bench/sass_offline.py compiles each Triton kernel of a call for an H200 without a GPU (in its
    own process: it points Triton at a CUDA target) and reports its resources and the program
    order of its memory instructions."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT / "src")
    proc = subprocess.run([sys.executable, str(BENCH / "sass_offline.py"), "--point", "olmoe-1b-7b:bf16:16",
                           "--out", str(tmp_path)], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    report = json.loads((tmp_path / "sass-offline.json").read_text())
    assert report["arch"] == "sm_90a"
    kernels = report["points"][0]["kernels"]
    assert [k["kernel"] for k in kernels] == ["align_expert_kernel", "gemm1_kernel", "gemm2_kernel", "sum_k_kernel"]
    for k in kernels:
        assert 0 < k["registers"] <= 255 and k["instructions"] > 50
        assert (tmp_path / k["sass"]).read_text().count("EXIT") >= 1
    gemm1 = kernels[1]
    assert gemm1["shared_bytes"] > 0  # its pipelined weight tiles
    assert any("MMA" in line for line in gemm1["order"]) and any("LDGSTS" in line for line in gemm1["order"])


def test_merge_swap_probe_matches_torch_under_the_interpreter():
    # The probe's kernel (a tile's rows plus tail rows as a swapped product) against torch on
    # tiny fp32 problems, gated and not, with and without a tail.
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT / "src"))
    proc = subprocess.run([sys.executable, str(BENCH / "merge_swap_probe_h200.py"), "--check"], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert proc.stdout.count("max err") == 6


@pytest.mark.parametrize("script,report_name", [("fp8_block_gluon_probe_h200.py", "block_fp8_offline.json"),
                                                ("fp8_block_gluon_gemm2_probe_h200.py", "block_gemm2_offline.json")])
def test_gluon_block_fp8_probes_keep_a_product_in_flight(script, report_name, tmp_path):
    # The Gluon block-scaled fp8 GEMMs (the dense probe's, and moekit's GEMM1 and GEMM2 over sorted
    # rows; run on Hopper only) compiled for sm_90a here: no spill, and inside the K loop each product is waited
    # for only down to one in flight, so the previous one is promoted while the next multiplies
    # (a copied in-flight accumulator made ptxas wait for all of them after each).
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT / "src")
    proc = subprocess.run([sys.executable, str(BENCH / script), "--sass", str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=900)
    if "has no Gluon Hopper module" in proc.stderr + proc.stdout:
        pytest.skip("this triton has no Gluon Hopper module")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    report = json.loads((tmp_path / report_name).read_text())
    assert report
    for tile, r in report.items():
        assert r["local_bytes"] == 0 and r["registers"] <= 255, tile
        # two steps a loop iteration, each waited for down to its own products in flight (GEMM1: a
        # gate and an up product a step)
        assert r["products"] == (16 if tile.startswith("gemm1") else 8) and r["overlapped"] == 2, (tile, r)


def test_gluon_gemm2_probe_reference_on_cpu():
    # The GEMM2 probe's fp32 reference (what its Gluon kernel is checked against on the H200),
    # against a row-by-row product, on moekit's alignment and row quantization under the interpreter.
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT / "src"))
    proc = subprocess.run([sys.executable, str(BENCH / "fp8_block_gluon_gemm2_probe_h200.py"), "--check"], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "rows written 80 of 80" in proc.stdout


def test_balance_probe_routing_is_balanced_and_valid():
    import torch

    probe = _load(BENCH / "balance_probe_h200.py")
    for M, E, k in ((256, 8, 2), (16, 128, 8), (3, 6, 4)):
        for x, w, ids in probe.balanced_sets(M, E, k, 32, 2, torch.float32, "cpu"):
            assert x.shape == (M, 32) and w.shape == ids.shape == (M, k) and ids.dtype == torch.int32
            assert torch.equal(torch.bincount(ids.flatten().long(), minlength=E), torch.full((E,), M * k // E))
            assert all(len(set(row.tolist())) == k for row in ids)  # k distinct experts a token
            torch.testing.assert_close(w.sum(1), torch.ones(M))
    with pytest.raises(ValueError, match="multiple of E"):
        probe.balanced_sets(5, 8, 2, 32, 1, torch.float32, "cpu")


def test_host_time_us_warms_then_times_every_set_per_pass():
    from moekit.benchmarks.gpu import host_time_us

    seen = []
    us = host_time_us(seen.append, [(i,) for i in range(4)], reps=2, warm=3, device="cpu")
    assert seen == [0, 1, 2] + [0, 1, 2, 3] * 2 and 0 < us < 1e6


def test_cpu_quant_variants_are_checked_before_any_weights_are_built():
    import torch

    cpu_quant = _load(BENCH / "cpu_quant.py")
    gen = torch.Generator().manual_seed(0)
    with pytest.raises(ValueError, match="baseline 'bf16 cpu'"):
        cpu_quant.make_variants(gen, 1, 1, only=("int4_w4a16 cpu_wo",))
    with pytest.raises(ValueError, match="unknown: \\['int3 cpu'\\]"):
        cpu_quant.make_variants(gen, 1, 1, only=("bf16 cpu", "int3 cpu"))

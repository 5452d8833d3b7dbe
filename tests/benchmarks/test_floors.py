"""Floors reproduce PERF.md's H200 table; the CPU bench driver runs end to end on a tiny shape."""

import pytest

from moekit.benchmarks.cpu import run_cpu_bench
from moekit.benchmarks.floors import H200_CEILINGS, distinct_experts, floor_seconds

# (E, k, H, I, M, floor us bf16) from PERF.md "Floors on one H200"
PERF_TABLE = [
    (8, 2, 4096, 14336, 1, 164), (8, 2, 4096, 14336, 16384, 14614),
    (128, 8, 2048, 768, 1, 17.6), (128, 8, 2048, 768, 4096, 391),
    (256, 8, 7168, 2048, 64, 4557), (64, 8, 2048, 1024, 16, 165), (32, 4, 2880, 2880, 1024, 373),
]


@pytest.mark.parametrize("E,k,H,I,M,us", PERF_TABLE)
def test_floor_matches_perf_table(E, k, H, I, M, us):
    got = floor_seconds(M, E, k, H, I, 2, H200_CEILINGS) * 1e6
    assert got == pytest.approx(us, rel=0.02)


def test_distinct_experts_limits():
    assert distinct_experts(1, 64, 8) == pytest.approx(8)
    assert distinct_experts(100000, 64, 8) == pytest.approx(64)
    assert distinct_experts(0, 64, 8) == 0


def test_cpu_bench_tiny_shape_runs():
    res = run_cpu_bench([("tiny", 4, 2, 64, 32)], Ms=(1, 8), reps=2, budget_s=1.0)
    assert len(res["records"]) == 2
    # the measured floor's compute ceiling is the faster GEMM: on AVX2 hosts torch's bf16 one is
    # emulated (0.3 GFLOP/s on Zen 3), and a floor from it read as 7000 % there
    ceilings = res["ceilings_measured"]
    assert ceilings["gemm_flops"] == max(ceilings["gemm_flops_by_dtype"].values()) > 0
    for r in res["records"]:
        assert {"moekit_auto", "moekit_grouped_mm", "torch_grouped_gemm"} <= set(r["impls"])
        assert r["impls"]["moekit_auto"]["ms"] > 0
        assert "speedup_vs_torch_grouped_gemm" in r

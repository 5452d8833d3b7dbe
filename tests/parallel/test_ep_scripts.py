"""The expert-parallel scripts: bench/ep_nccl.py's logic on 2 gloo ranks at tiny sizes, and
examples/ep_torchrun.py under torchrun (it must pass, and fail when a rank is corrupted)."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dist_harness import run_world

ROOT = Path(__file__).resolve().parents[2]


def _bench(rank, size, out):
    spec = importlib.util.spec_from_file_location("ep_nccl_bench", ROOT / "bench" / "ep_nccl.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    code = bench.main(["--device", "cpu", "--shapes", "tiny", "--tokens", "1", "6", "--layer-tokens", "3",
                       "--iters", "2", "--warmup", "1", "--reps", "1", "--out", out,
                       "--profile", "--profile-shape", "tiny", "--profile-tokens", "0", "5"])
    return [] if code == 0 else [f"rank {rank}: exit code {code}"]


@pytest.mark.slow
def test_bench_logic_on_gloo(tmp_path):
    out = str(tmp_path / "ep.json")
    results = run_world(2, _bench, out, timeout_s=120)
    failures = [f for r in sorted(results) for f in results[r]]
    assert not failures, "\n".join(failures)
    data = json.loads(Path(out).read_text())
    assert data["world_size"] == 2 and data["backend"] == "gloo" and "command" in data and "date" in data
    rows = data["results"]
    # 2 token counts x 3 dispatchers (no CUDA graph on CPU) + 1 eager layer decode step
    comm = [r for r in rows if not r["mode"].startswith("layer")]
    assert sorted((r["tokens_per_rank"], r["dispatcher"]) for r in comm) == sorted(
        (t, d) for t in (1, 6) for d in ("all_to_all", "static_all_to_all", "allgather_reducescatter"))
    for r in comm:
        assert r["us"] > 0 and r["raw_us"] > 0 and r["bytes_per_rank"] > 0
        assert r["check_rel_err"] < 1e-5, r  # combine(dispatch(x)) under the stand-in experts
        assert r["kernels"] == "torch" and r["config"] == "default"  # no Triton kernels on CPU
        assert "error" not in r and r.get("bitwise_equal_torch", True), r
        # the dynamic path is also compared with the raw pair after a count exchange
        assert (r["dispatcher"] == "all_to_all") == ("raw_sync_us" in r) and r.get("raw_sync_us", 1) > 0
    layer = [r for r in rows if r["mode"].startswith("layer")]
    assert len(layer) == 1 and layer[0]["finite"] and layer[0]["us"] > 0
    # --profile: top ops of 10 dispatch + combine calls (CPU only here) at each profiled T
    profiles = data["profiles"]
    assert [p["tokens_per_rank"] for p in profiles] == [0, 5]
    for p in profiles:
        assert p["kernels"] == "torch" and p["by_device"] == [] and p["by_cpu"] and "c10d::" in p["table"]
        assert set(p["cpu_us_per_call"]) == {"ep.dispatch", "ep.combine"}


def _torchrun(*args):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(ROOT / "examples" / "ep_torchrun.py"), "--hidden", "32", "--intermediate", "16", "--shared", "16",
           "--tokens", "6", "--iters", "2", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=150, env=env)


@pytest.mark.slow
def test_example_under_torchrun():
    ok = _torchrun("--empty-rank")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    for name in ("all_to_all", "allgather_reducescatter", "static_all_to_all"):
        assert any(line.strip().startswith(name) and line.rstrip().endswith("match") for line in ok.stdout.splitlines())
    bad = _torchrun("--corrupt-rank", "1", "--dispatchers", "all_to_all")
    assert bad.returncode != 0 and "MISMATCH" in bad.stdout, bad.stdout + bad.stderr


@pytest.mark.slow
def test_example_refuses_p2p_on_cpu():
    """--dispatchers p2p_all_to_all on CPU ended in a traceback on every rank from inside the layer."""
    import torch  # noqa: PLC0415

    if torch.cuda.is_available():
        pytest.skip("p2p_all_to_all runs where CUDA is")
    run = _torchrun("--dispatchers", "p2p_all_to_all")
    assert run.returncode != 0
    assert "ep_torchrun.py: error: --dispatchers p2p_all_to_all maps GPU memory" in run.stderr, run.stderr
    assert "Traceback" not in run.stderr.split("ep_torchrun.py: error")[0]

"""`moekit eplb plan` and `moekit eplb simulate`."""

import json
import re

import numpy as np
import pytest
import torch

from moekit.cli.eplb import read_load, synthetic_load
from moekit.cli.main import main
from moekit.eplb.policy import balancedness, gpu_loads, rebalance_experts

FIXTURE_LOAD = [[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
                [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27]]


@pytest.mark.parametrize("fmt", ["npy", "pt", "json-list", "json-object"])
def test_plan_writes_the_fixture_placement(tmp_path, capsys, fmt):
    path = tmp_path / ("load." + fmt.split("-")[0])
    if fmt == "npy":
        np.save(path, np.array(FIXTURE_LOAD, dtype=np.int64))
    elif fmt == "pt":
        torch.save(torch.tensor(FIXTURE_LOAD), path)
    else:
        path.write_text(json.dumps(FIXTURE_LOAD if fmt == "json-list" else {"load": FIXTURE_LOAD}))
    out = tmp_path / "placement.json"
    rc = main(["eplb", "plan", "--load", str(path), "--gpus", "8", "--nodes", "2", "--redundant", "4",
               "--groups", "4", "--out", str(out)])
    assert rc == 0
    plan = json.loads(out.read_text())
    assert plan["phy2log"] == [[5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
                               [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1]]
    assert plan["replica_count"] == [[1, 2, 1, 1, 2, 2, 1, 1, 1, 1, 2, 1], [1, 2, 1, 1, 1, 2, 2, 1, 2, 1, 1, 1]]
    assert plan["policy"] == "hierarchical" and plan["num_physical_experts"] == 16
    # The printed balancedness is the one recomputed from the placement.
    _, after = balancedness(gpu_loads(torch.tensor(FIXTURE_LOAD), torch.tensor(plan["phy2log"]), 8))
    assert plan["balancedness"]["overall_after"] == pytest.approx(after, abs=1e-6)
    text = capsys.readouterr().out
    assert "before -> after" in text and f"{after:.4f}" in text


def test_plan_plot(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "load.json"
    path.write_text(json.dumps(FIXTURE_LOAD))
    plot = tmp_path / "gpus.png"
    assert main(["eplb", "plan", "--load", str(path), "--gpus", "4", "--nodes", "1", "--redundant", "0",
                 "--plot", str(plot)]) == 0
    assert plot.stat().st_size > 1000


def test_plan_more_gpus_than_experts_and_unwritable_plot(tmp_path, capsys):
    path = tmp_path / "load.json"
    path.write_text(json.dumps([[5, 1, 1, 1]]))
    out = tmp_path / "placement.json"
    # 8 slots on 8 GPUs for 4 experts: the static "before" leaves GPUs 4..7 empty
    assert main(["eplb", "plan", "--load", str(path), "--gpus", "8", "--nodes", "1", "--redundant", "4",
                 "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["balancedness"]["overall_before"] == pytest.approx(1 / 8 * 8 / 5)  # mean 1, max 5
    assert sorted(report["phy2log"][0]).count(0) == 5  # the hot expert on five GPUs
    assert main(["eplb", "plan", "--load", str(path), "--gpus", "2", "--nodes", "1", "--redundant", "0",
                 "--out", str(tmp_path / "missing" / "p.json")]) == 2
    assert "No such file or directory" in capsys.readouterr().err


@pytest.mark.parametrize("content,args,message", [
    ([[1, 2, 3]], ["--gpus", "2", "--nodes", "1", "--redundant", "0"],
     r"--gpus 2 must divide the 3 physical slots \(E=3 experts \+ --redundant 0\)"),
    ([1, 2, 3], ["--gpus", "1", "--nodes", "1", "--redundant", "0"], r"\[L, E\] with L, E >= 1"),
    ([[]], ["--gpus", "1", "--nodes", "1", "--redundant", "0"], r"with L, E >= 1, got shape \(1, 0\)"),
    ([[1, 2], [3]], ["--gpus", "1", "--nodes", "1", "--redundant", "0"], "rectangular"),
    ([[1, 2, 3, 4]], ["--gpus", "4", "--nodes", "3", "--redundant", "0"], "--nodes 3 must divide --gpus 4"),
    ([[1, 2, 3, 4]], ["--gpus", "2", "--nodes", "1", "--redundant", "0", "--groups", "3"],
     "--groups 3 must divide the E=4 experts"),
    ([[1, 2, 3, 4]], ["--gpus", "0", "--nodes", "1", "--redundant", "0"], "--gpus must be an int >= 1, got 0"),
    ([[True, False, 3, 4]], ["--gpus", "1", "--nodes", "1", "--redundant", "0"], "got true/false entries"),
], ids=["slots-not-divisible", "one-dimensional", "no-experts", "ragged", "gpus-not-divisible-by-nodes",
        "experts-not-divisible-by-groups", "no-gpus", "booleans-read-as-counts"])
def test_plan_errors(tmp_path, capsys, content, args, message):
    path = tmp_path / "load.json"
    path.write_text(json.dumps(content))
    assert main(["eplb", "plan", "--load", str(path), *args]) == 2
    assert re.search(message, capsys.readouterr().err)


def test_plan_from_the_current_placement_keeps_layers_it_would_worsen(tmp_path, capsys):
    """--current re-plans as EplbState does: layer 0's greedy plan is worse than the placement in
    use (busiest GPU 7 -> 7.5 tokens) and is kept; layer 1's is better and moves."""
    load = tmp_path / "load.json"
    load.write_text(json.dumps([[3, 3, 0, 4, 1, 3], [1, 1, 1, 1, 30, 1]]))
    current = tmp_path / "current.json"
    start = [[0, 1, 2, 3, 4, 5, 0, 1]] * 2
    current.write_text(json.dumps({"phy2log": start}))
    out = tmp_path / "plan.json"
    args = ["eplb", "plan", "--load", str(load), "--gpus", "2", "--nodes", "1", "--redundant", "2",
            "--current", str(current), "--out", str(out)]
    assert main(args) == 0
    report = json.loads(out.read_text())
    assert report["kept_layers"] == [0] and report["phy2log"][0] == start[0] and report["phy2log"][1] != start[1]
    before, _ = balancedness(gpu_loads(torch.tensor([[3, 3, 0, 4, 1, 3], [1, 1, 1, 1, 30, 1]]), torch.tensor(start), 2))
    assert report["balancedness"]["before"] == pytest.approx(before.tolist(), abs=1e-6)
    assert report["balancedness"]["after"][0] == report["balancedness"]["before"][0]
    assert report["balancedness"]["after"][1] > report["balancedness"]["before"][1]
    assert sum(report["replica_count"][0]) == 8 and report["log2phy"][0][0][:2] == [0, 6]
    assert "kept: the plan is no better" in capsys.readouterr().out
    assert main(args + ["--min-improvement", "0.5"]) == 0  # layer 1's busiest GPU: 32 -> 22 tokens, < half off
    assert json.loads(out.read_text())["kept_layers"] == [0, 1]
    capsys.readouterr()
    current.write_text(json.dumps([[0, 1, 2, 3, 4, 5, 0]]))
    assert main(args) == 2
    assert "--current: expected integer expert ids [L=2, R=8]" in capsys.readouterr().err


def test_read_load_rejects_unknown_extension(tmp_path):
    path = tmp_path / "load.csv"
    path.write_text("1,2")
    with pytest.raises(ValueError, match=r"\.npy, \.pt or \.json"):
        read_load(str(path))


def test_simulate(tmp_path, capsys):
    out = tmp_path / "sim.json"
    assert main(["eplb", "simulate", "--experts", "32", "--layers", "4", "--gpus", "8", "--nodes", "2",
                 "--redundant", "0,8", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]
    assert [r["redundant"] for r in rows] == [0, 8]
    assert rows[1]["overall_after"] >= rows[0]["overall_after"] > rows[0]["overall_before"]
    assert "redundant  slots" in capsys.readouterr().out
    assert main(["eplb", "simulate", "--experts", "32", "--gpus", "8", "--redundant", "4"]) == 2  # 36 % 8


def test_synthetic_loads():
    zipf = synthetic_load("zipf", 3, 16, 10_000, alpha=1.0, seed=1)
    assert zipf.shape == (3, 16)
    # Zipf: the sorted weights of every layer follow 1 / rank.
    top = zipf.sort(-1, descending=True).values
    assert torch.allclose(top[:, 0] / top[:, 3], torch.full((3,), 4.0, dtype=torch.float64), rtol=0.01)
    lognormal = synthetic_load("lognormal", 61, 256, 1_000_000, sigma=1.0, seed=0)
    phy2log = rebalance_experts(lognormal, 288, 1, 1, 32)[0]
    assert balancedness(gpu_loads(lognormal, phy2log, 32))[1] >= 0.93
    with pytest.raises(ValueError, match="dist must be one of"):
        synthetic_load("uniform", 1, 4, 10)


@pytest.mark.parametrize("name, content", [
    ("load.json", b""), ("load.json", b"{not json"), ("load.pt", b"not a torch file"),
    ("load.npy", b"not a numpy file"), ("load.npy", None),
], ids=["empty-json", "broken-json", "garbage-pt", "garbage-npy", "npy-of-strings"])
def test_plan_unreadable_load_files_are_named(tmp_path, capsys, name, content):
    """Each used to end in a traceback (or an error naming neither --load nor the file)."""
    path = tmp_path / name
    if content is None:
        np.save(path, np.array([["a", "b"]]))
    else:
        path.write_bytes(content)
    assert main(["eplb", "plan", "--load", str(path), "--gpus", "1", "--nodes", "1", "--redundant", "0"]) == 2
    assert capsys.readouterr().err.startswith(f"moekit eplb plan: error: --load: cannot read {path}")


def test_simulate_large_sigma_is_skewed_not_overflowed(capsys):
    """exp(sigma * N(0, 1)) overflowed to inf at sigma = 1000, and the error blamed --redundant."""
    load = synthetic_load("lognormal", 2, 8, 1000, sigma=1000.0, seed=0)
    assert torch.isfinite(load).all() and (load.max(-1).values == 1000).all()
    assert main(["eplb", "simulate", "--experts", "8", "--layers", "2", "--gpus", "2", "--nodes", "1",
                 "--redundant", "0", "--sigma", "inf"]) == 2
    assert "sigma must be finite and > 0, got inf" in capsys.readouterr().err


@pytest.mark.parametrize("command", [["plan", "--gpus", "2", "--nodes", "1", "--redundant", "0"],
                                     ["simulate", "--layers", "2", "--experts", "8", "--gpus", "2", "--nodes", "1"]])
def test_plot_without_matplotlib_is_refused_before_the_report(tmp_path, capsys, monkeypatch, command):
    """Without matplotlib, --plot was refused only after the whole report had been printed."""
    import sys  # noqa: PLC0415

    path = tmp_path / "load.json"
    path.write_text(json.dumps([[5, 1, 1, 1]]))
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    load = ["--load", str(path)] if command[0] == "plan" else []
    assert main(["eplb", *command, *load, "--plot", str(tmp_path / "p.png")]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "--plot needs matplotlib: pip install moekit[cli]" in err

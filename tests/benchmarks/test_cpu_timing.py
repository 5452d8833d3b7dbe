"""The CPU benchmark's interleaved timing: every implementation leads equally often."""

from moekit.benchmarks.cpu import time_interleaved


def test_every_implementation_goes_first_equally_often():
    calls = []
    fns = {name: (lambda *a, name=name: calls.append(name)) for name in ("a", "b", "c")}
    reps = 6
    times = time_interleaved(fns, lambda: (), reps, budget_s=1e9)
    assert {n: len(t) for n, t in times.items()} == {"a": reps, "b": reps, "c": reps}
    timed = calls[3:]  # after one warm-up call each
    firsts = [timed[i] for i in range(0, len(timed), 3)]
    assert firsts == ["a", "b", "c", "a", "b", "c"]
    for i in range(0, len(timed), 3):  # each repetition still runs every implementation once
        assert sorted(timed[i:i + 3]) == ["a", "b", "c"]


def test_an_implementation_drops_out_after_its_budget():
    fns = {"a": lambda: None, "b": lambda: None}
    times = time_interleaved(fns, lambda: (), reps=5, budget_s=0.0)
    assert {n: len(t) for n, t in times.items()} == {"a": 1, "b": 1}

"""The scenario of examples/elastic_ep.py (gloo, CPU processes), run once and checked from many sides.

Spawning workers is slow, so one run serves every test here: 4 -> 2 ranks, a failed join,
2 -> 3 ranks, a rank SIGKILLed in the middle of a batch, all while a thread submits batches.
An observer, called by the example after each step, snapshots every rank's slots and bytes,
tries invalid requests against the live controller, adds a transition whose joiner is
killed right after prepare (redistribute fails, the old members roll back), and at the end
makes recovery impossible (too few survivors for the capacity rule) to see the error.
"""

import importlib.util
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from moekit.elastic import ElasticError
from moekit.elastic.model import layer_prefix

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 3.0  # gloo and heartbeat timeouts of the run


def _load_example():
    spec = importlib.util.spec_from_file_location("elastic_ep_example", ROOT / "examples" / "elastic_ep.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Observer:
    """Called as observe(step, controller) by the example after each step."""

    def __init__(self):
        self.checkpoint, self.spec = None, None
        self.snapshots, self.generations, self.failed = {}, {}, {}
        self.invalid, self.impossible = {}, None

    def __call__(self, step, ctl):
        if self.checkpoint is None:
            self.checkpoint, self.spec = load_file(ctl.config.checkpoint), ctl.config.spec
        self.snapshots[step] = (ctl.members, ctl.phy2log, ctl.inspect())
        self.generations[step] = ctl.generation
        self.failed[step] = dict(ctl.failed)
        if step == "scale_down":
            self._invalid_requests(ctl)
        if step == "failed_join":
            self._rollback(ctl)
            self(step="rollback", ctl=ctl)
        if step == "end":
            self._impossible_recovery(ctl)

    def _rollback(self, ctl):
        """Kill the joiner as soon as prepare succeeded: redistribute fails, the old world must come back."""
        first, before = len(ctl.events), ctl.members

        def kill_joiner():
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                if any(e.stage == "prepare" and e.ok for e in ctl.events[first:]):
                    try:
                        joiner = next(w for w in ctl.workers if w not in before)
                        os.kill(ctl.worker_pid(joiner), signal.SIGKILL)
                    except (RuntimeError, StopIteration, ValueError):  # the pool changed under us: look again
                        continue
                    self.rollback_victim = joiner
                    return
                time.sleep(0.001)

        killer = threading.Thread(target=kill_joiner, daemon=True)
        killer.start()
        self.rollback = ctl.scale_up(1)
        killer.join(timeout=10)

    def _invalid_requests(self, ctl):
        before = (ctl.members, ctl.generation, len(ctl.events), len(ctl.failed))
        requests = {
            "unknown": lambda: ctl.scale_down(["w9"]),
            "unknown_keep": lambda: ctl.transition(["w0", "w42"]),
            "empty": lambda: ctl.transition([], 0),
            "too_small": lambda: ctl.scale_down([ctl.members[0]]),  # 1 rank cannot hold 10 slots (max 5)
            "repeated": lambda: ctl.transition([ctl.members[0], ctl.members[0]]),
            "negative": lambda: ctl.scale_up(-1),
            "not_a_list": lambda: ctl.scale_down("w0"),
        }
        for name, request in requests.items():
            try:
                request()
                self.invalid[name] = None
            except (ValueError, TypeError) as err:
                self.invalid[name] = (type(err), str(err))
        self.invalid["unchanged"] = before == (ctl.members, ctl.generation, len(ctl.events), len(ctl.failed))

    def _impossible_recovery(self, ctl):
        victim = ctl.members[0]
        os.kill(ctl.worker_pid(victim), signal.SIGKILL)
        ctl.submit(torch.randn(3, ctl.config.spec.hidden_size))
        try:
            ctl.serve(timeout_s=60)
        except ElasticError as err:
            self.impossible = (victim, str(err), ctl.pending)
            try:
                ctl.serve(timeout_s=1)
            except ElasticError as again:
                self.impossible += (str(again),)


@pytest.fixture(scope="module")
def scenario():
    example = _load_example()
    observer = Observer()
    args = example.parse(["--batches", "30", "--timeout", str(TIMEOUT_S), "--interval", "0.04"])
    summary = example.run(args, observe=observer)
    return args, summary, observer


def test_every_batch_completes_once_and_matches(scenario):
    args, s, _ = scenario
    assert s["lost"] == 0 and s["repeated"] == 0 and s["mismatched"] == 0, s
    assert s["completed"] == args.batches
    assert s["submitted"] == args.batches + 1  # + the batch left queued by the impossible recovery
    assert s["max_rel_err"] <= 1e-5
    assert s["killed"]["batch"] is not None  # killed while a batch ran (it may still have finished first)
    assert s["submitted_during_transitions"] >= 1


def _checkpoint_rows(ckpt, spec, layer, expert):
    return {name: ckpt[layer_prefix(layer) + key][expert].contiguous().view(torch.uint8).reshape(-1)
            for name, key in spec.expert_keys().items()}


def test_every_rank_holds_the_checkpoint_bytes_of_its_experts(scenario):
    _, _, obs = scenario
    sizes = {step: len(members) for step, (members, _, _) in obs.snapshots.items()}
    assert sizes == {"start": 4, "scale_down": 2, "failed_join": 2, "rollback": 2, "scale_up": 3, "end": 2}
    for step, (members, phy2log, ranks) in obs.snapshots.items():
        assert list(ranks) == list(members)
        S = len(phy2log[0]) // len(members)
        assert S <= 5, f"{step}: {S} slots per rank exceed max_slots_per_rank"
        for layer, row in enumerate(phy2log):
            assert set(row) == set(range(8)), f"{step}: layer {layer} lost an expert"
        for w, info in ranks.items():
            r = info["rank"]
            assert info["holdings"] == tuple(tuple(row[r * S:(r + 1) * S]) for row in phy2log), f"{step}: {w}"
            for layer, tensors in enumerate(info["tensors"]):
                for slot, e in enumerate(info["holdings"][layer]):
                    want = _checkpoint_rows(obs.checkpoint, obs.spec, layer, e)
                    for name, got in tensors.items():
                        assert torch.equal(torch.from_numpy(got[slot]), want[name]), \
                            f"{step}: {w} layer {layer} slot {slot} (expert {e}) {name} differs from the checkpoint"


FULL = ["prepare", "redistribute", "switch", "cleanup"]


def test_stages_are_recorded_in_order(scenario):
    _, s, _ = scenario
    expected = [  # kind, ok, failed stage, stages, each stage's ok
        ("start", True, None, FULL, [True] * 4),
        ("scale_down", True, None, FULL, [True] * 4),
        ("scale_up", False, "prepare", ["prepare"], [False]),
        ("scale_up", False, "redistribute", FULL, [True, False, True, True]),  # then rolled back
        ("scale_up", True, None, FULL, [True] * 4),
        ("recover", True, None, ["detect", "redistribute", "switch", "cleanup"], [True] * 4),
    ]
    assert [(r.kind, r.ok, r.failed_stage) for r in s["reports"]] == [e[:3] for e in expected]
    for r, (_, _, _, stages, oks) in zip(s["reports"], expected):
        assert [e.stage for e in r.events] == stages, r
        assert [e.ok for e in r.events] == oks, r
        assert all(e.end >= e.start for e in r.events)
        for a, b in zip(r.events, r.events[1:]):
            assert b.start >= a.end
    start, down, _, rolled_back, up, recover = s["reports"]
    assert [e.kind for e in rolled_back.events] == ["scale_up", "scale_up", "rollback", "rollback"]
    assert start.members_after == ("w0", "w1", "w2", "w3")
    assert down.members_after == ("w0", "w1") and down.counts["loaded"] == 0 and down.counts["received"] > 0
    assert up.members_after == ("w0", "w1", "w6") and up.counts["loaded"] == 0 and up.counts["received"] > 0
    assert recover.members_before == up.members_after
    assert s["killed"]["worker"] not in recover.members_after and len(recover.members_after) == 2


def test_failed_redistribute_rolls_back_to_the_old_world(scenario):
    _, s, obs = scenario
    r = obs.rollback
    assert not r.ok and r.failed_stage == "redistribute" and obs.rollback_victim in r.reason
    assert r.members_before == r.members_after == ("w0", "w1")
    assert obs.generations["rollback"] != obs.generations["failed_join"]  # a new group ...
    before, after = obs.snapshots["failed_join"], obs.snapshots["rollback"]
    assert before[1] == after[1]  # ... over the same placement and the untouched live weights
    for w in before[2]:
        assert before[2][w]["holdings"] == after[2][w]["holdings"]
        for a, b in zip(before[2][w]["tensors"], after[2][w]["tensors"]):
            assert all((a[n] == b[n]).all() for n in a)
    assert obs.rollback_victim in obs.failed["rollback"]


def test_failed_prepare_leaves_the_old_world_serving(scenario):
    _, s, obs = scenario
    failed = s["failed_join"]
    assert not failed.ok and failed.failed_stage == "prepare"
    assert "did not announce themselves alive within 0.01 s" in failed.reason
    assert failed.members_before == failed.members_after == ("w0", "w1")
    assert obs.generations["failed_join"] == obs.generations["scale_down"]  # the same group kept serving
    before, after = obs.snapshots["scale_down"], obs.snapshots["failed_join"]
    assert before[1] == after[1] and {w: i["holdings"] for w, i in before[2].items()} == \
        {w: i["holdings"] for w, i in after[2].items()}
    assert "w4" in obs.failed["failed_join"], "the joiner that never showed up is stopped"


def test_invalid_requests_are_rejected_before_anything_changes(scenario):
    _, _, obs = scenario
    inv = obs.invalid
    assert inv["unchanged"]
    assert inv["unknown"][0] is ValueError and "unknown worker ids ['w9']" in inv["unknown"][1]
    assert inv["unknown_keep"][0] is ValueError and "['w42']" in inv["unknown_keep"][1]
    assert inv["empty"][0] is ValueError and "target world is empty" in inv["empty"][1]
    assert inv["too_small"][0] is ValueError and "max_slots_per_rank=5" in inv["too_small"][1]
    assert "smallest world that fits has 2 ranks" in inv["too_small"][1]
    assert inv["repeated"][0] is ValueError and "more than once" in inv["repeated"][1]
    assert inv["negative"][0] is ValueError and "add must be an int >= 0" in inv["negative"][1]
    assert inv["not_a_list"][0] is TypeError


def test_a_killed_rank_is_detected_quickly_and_its_experts_come_back(scenario):
    _, s, obs = scenario
    assert s["detect_s"] is not None and s["detect_s"] < TIMEOUT_S, s["detect_s"]
    victim = s["killed"]["worker"]
    assert "process ended" in obs.failed["end"][victim] or "exited" in obs.failed["end"][victim]
    recover = s["reports"][-1]
    assert victim in recover.reason
    assert recover.counts["loaded"] + recover.counts["received"] > 0


def test_recovery_that_cannot_fit_is_a_clear_error(scenario):
    _, _, obs = scenario
    assert obs.impossible is not None, "serve() should raise ElasticError"
    victim, message, pending, again = obs.impossible
    assert victim in message and "cannot rebuild on the 1 surviving workers" in message
    assert "max_slots_per_rank=5" in message
    assert pending == 1, "the batch that could not run stays queued"
    assert again == message

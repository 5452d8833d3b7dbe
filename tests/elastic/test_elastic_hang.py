"""A worker that hangs (SIGSTOP) instead of dying: found by its stopped heartbeat, fenced, and the
survivor serves alone (a world of one rank: no process group traffic, every expert local, the
hung worker's experts read back from the checkpoint)."""

import os
import signal
import threading
import time

import pytest
import torch

from conftest import TOL, rel_err
from moekit.elastic import ElasticConfig, ElasticController, ModelSpec, ReferenceModel, write_checkpoint

pytestmark = pytest.mark.slow

HEARTBEAT_S, COLLECTIVE_S = 2.0, 2.0


def test_a_hung_worker_is_fenced_and_the_survivor_serves_alone(tmp_path, gen):
    spec = ModelSpec(4, 16, 8, 2, num_layers=1)
    checkpoint = write_checkpoint(spec, tmp_path / "model.safetensors", seed=int(torch.randint(0, 1000, (1,))))
    reference = ReferenceModel(spec, checkpoint, backend="reference")
    config = ElasticConfig(spec, str(checkpoint), max_slots_per_rank=4, collective_timeout_s=COLLECTIVE_S,
                           heartbeat_interval_s=0.2, heartbeat_timeout_s=HEARTBEAT_S, command_timeout_s=30.0)
    xs = [torch.randn(int(T), 16, generator=gen) for T in torch.randint(0, 9, (12,), generator=gen)]
    stopped = {}
    with ElasticController(config) as ctl:
        ctl.start(2)
        for x in xs[:4]:
            ctl.submit(x)
        ctl.serve()

        def stop_one():
            while ctl.in_flight is None:
                time.sleep(0.001)
            stopped.update(worker="w1", pid=ctl.worker_pid("w1"), at=time.monotonic())
            os.kill(stopped["pid"], signal.SIGSTOP)

        stopper = threading.Thread(target=stop_one, daemon=True)
        stopper.start()
        for x in xs[4:]:
            ctl.submit(x)
        ctl.serve(timeout_s=60)
        stopper.join(timeout=5)
        assert ctl.members == ("w0",)
        # the first batch sent to the stopped worker cannot finish: it runs again, once, on the rebuilt world
        assert ctl.interrupted == 1 and sorted(ctl.batches.attempts.values())[-2:] == [1, 2]
        assert "heartbeat stopped" in ctl.failed["w1"] or "no reply" in ctl.failed["w1"], ctl.failed
        with pytest.raises(ProcessLookupError):
            os.kill(stopped["pid"], 0)  # fenced: killed and reaped, it cannot come back
        detect = next(e for e in ctl.events if e.stage == "detect")
        assert detect.start - stopped["at"] < HEARTBEAT_S + COLLECTIVE_S + 3.0
        recover = ctl.reports[-1]
        assert recover.kind == "recover" and recover.ok and recover.counts["loaded"] == 2  # w1's two experts
        assert [len(ctl.phy2log[0])] == [4]
        held = ctl.inspect()["w0"]["holdings"]
        assert sorted(held[0]) == [0, 1, 2, 3]
    assert sorted(ctl.completion_log) == list(range(len(xs)))
    for bid, x in enumerate(xs):
        assert rel_err(ctl.results[bid], reference(x)) <= TOL[torch.float32], bid

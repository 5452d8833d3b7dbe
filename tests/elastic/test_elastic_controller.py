"""Controller pieces that need no worker processes: configuration checks, batch bookkeeping, and the
errors of a rebuild that cannot happen (run on a controller whose pool is a stand-in)."""

import dataclasses

import pytest
import torch

from moekit.elastic import BatchFailed, ElasticConfig, ElasticController, ElasticError, ModelSpec, write_checkpoint
from moekit.elastic.batches import BatchQueue
from moekit.elastic.worker import Reply


@pytest.fixture
def config(tmp_path):
    spec = ModelSpec(8, 16, 8, 2)
    return ElasticConfig(spec, str(write_checkpoint(spec, tmp_path / "m.safetensors")), max_slots_per_rank=4)


@pytest.mark.parametrize("field,value,match", [
    ("max_slots_per_rank", 0, "max_slots_per_rank must be an int >= 1"),
    ("num_redundant", -1, "num_redundant must be an int >= 0"),
    ("num_groups", 3, "num_groups=3 must divide the number of experts 8"),
    ("collective_timeout_s", 0, "collective_timeout_s must be a number > 0"),
    ("heartbeat_timeout_s", True, "heartbeat_timeout_s must be a number > 0"),
    ("checkpoint", "/nonexistent/m.safetensors", "checkpoint must be an existing safetensors file"),
])
def test_config_errors_name_the_field(config, field, value, match):
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(config, **{field: value})


def test_config_type_errors(config):
    with pytest.raises(TypeError, match="spec must be a ModelSpec, got str"):
        dataclasses.replace(config, spec="mixtral")
    with pytest.raises(TypeError, match="config must be an ElasticConfig"):
        ElasticController({"spec": config.spec})


def test_model_spec_errors():
    with pytest.raises(ValueError, match="top_k=9 is larger than the number of experts 8"):
        ModelSpec(8, 16, 8, 9)
    with pytest.raises(ValueError, match="num_layers must be an int >= 1"):
        ModelSpec(8, 16, 8, 2, num_layers=0)
    with pytest.raises(ValueError, match="dtype must be one of"):
        ModelSpec(8, 16, 8, 2, dtype=torch.int8)
    # Regression: an unknown backend was accepted and failed later, in every worker's first switch.
    with pytest.raises(ValueError, match=r"backend must be 'auto' or one of \[.*\], got 'cuda'"):
        ModelSpec(8, 16, 8, 2, backend="cuda")
    assert ModelSpec(8, 16, 8, 2, backend="reference").backend == "reference"


def test_batches_complete_exactly_once_in_order_of_resubmission():
    q = BatchQueue(4)
    ids = [q.submit(torch.randn(t, 4)) for t in (3, 0, 1)]
    assert ids == [0, 1, 2] and q.pending == 3 and q.submitted == 3
    bid, x = q.next()
    assert bid == 0 and q.in_flight == 0 and x.shape == (3, 4)
    q.requeue(bid)  # interrupted: back at the front
    assert q.in_flight is None and q.interrupted == 1
    bid, x = q.next()
    assert bid == 0 and q.attempts[0] == 2
    q.complete(bid, x * 2)
    with pytest.raises(RuntimeError, match="batch 0 completed twice"):
        q.complete(0, x)
    assert q.completion_log == [0] and q.pending == 2
    with pytest.raises(ValueError, match=r"x must be a float tensor \[T, H=4\]"):
        q.submit(torch.randn(2, 5))
    with pytest.raises(ValueError, match="float tensor"):
        q.submit(torch.ones(2, 4, dtype=torch.int64))
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        q.submit([[0.0] * 4])
    with pytest.raises(ValueError, match="x must be finite"):  # it would fail on every world
        q.submit(torch.tensor([[0.0, 1.0, float("nan"), 2.0]]))
    with pytest.raises(ValueError, match="with data"):
        q.submit(torch.empty(2, 4, device="meta"))
    x = torch.ones(2, 4)
    bid = q.submit(x)
    x.zero_()  # the caller reuses its tensor: the queued batch is a copy
    assert q._inputs[bid].sum() == 8


class _StandInPool:
    """Running workers and their holdings, nothing else: _rebuild must refuse before it sends anything."""

    def __init__(self, holdings):
        self.holdings = holdings
        self.running = tuple(holdings)
        self.failed = {}


def test_impossible_rebuilds_are_clear_errors(config, tmp_path):
    ctl = ElasticController(config)
    ctl.pool = _StandInPool({"a": ((0, 1, 2, 3),), "b": ((4, 5, 6, 7),)})
    with pytest.raises(ElasticError, match="no worker is left to serve"):
        ctl._rebuild(0, "recover", ["c"], "c failed")
    ctl._broken = None
    # E=8 on one rank needs 8 slots, more than max_slots_per_rank=4
    with pytest.raises(ElasticError, match=r"b failed; cannot rebuild on the 1 surviving workers \['a'\].*"
                                           r"max_slots_per_rank=4"):
        ctl._rebuild(0, "recover", ["a"], "b failed")
    with pytest.raises(ElasticError, match="cannot rebuild"):
        ctl.serve()  # the deployment stays broken: every later call says why
    ctl._broken = None
    ctl.pool = _StandInPool({"a": ((0, 1, 2, 3),), "b": ((),), "c": ((),)})  # 4..7 died with their holder
    (tmp_path / "m.safetensors").unlink()
    with pytest.raises(ElasticError, match="no surviving copy and the checkpoint .* cannot be read"):
        ctl._rebuild(0, "recover", ["a", "b"], "d failed")


class _ReplyingPool:
    """Members that stay alive and answer every Run: an error for batches holding a 7, else 2 x."""

    def __init__(self, members):
        self.running, self.failed, self.holdings = tuple(members), {}, {}
        self._seq = 0

    def next_seq(self):
        self._seq += 1
        return self._seq

    def check(self, members):
        pass

    def exchange(self, commands, timeout_s):
        replies = {}
        for w, cmd in commands.items():
            bad = (cmd.x == 7).any()
            replies[w] = Reply(w, cmd.seq, not bad, None if bad else cmd.x * 2, "ValueError: a 7" if bad else "", ())
        return replies, {}


def test_a_batch_that_always_fails_is_dropped_and_serving_goes_on(config):
    ctl = ElasticController(config)
    ctl.pool = _ReplyingPool(["a", "b"])
    ctl.members, ctl.generation = ("a", "b"), 1
    rebuilds = []
    ctl._recover = rebuilds.append  # the world rebuilt after each failed run (stand-in)
    good, bad, after = torch.ones(3, 16), torch.full((2, 16), 7.0), torch.ones(1, 16)
    ids = [ctl.submit(t) for t in (good, bad, after)]
    with pytest.raises(BatchFailed, match=r"batch 1 failed on every one of its runs.*last: a: ValueError: a 7"):
        ctl.serve(timeout_s=30)
    assert len(rebuilds) == config.max_attempts
    assert list(ctl.batch_errors) == [1] and "ValueError: a 7" in ctl.batch_errors[1]
    ctl.serve(timeout_s=30)  # the deployment still serves the batches after it
    assert sorted(ctl.results) == [ids[0], ids[2]] and ctl.pending == 0
    assert torch.equal(ctl.results[ids[2]], after * 2)


def test_requests_need_a_serving_world(config):
    ctl = ElasticController(config)
    with pytest.raises(ElasticError, match="call start"):
        ctl.scale_up(1)
    with pytest.raises(ValueError, match="num_workers=1 refused: .*max_slots_per_rank=4"):
        ctl.start(1)
    with pytest.raises(ValueError, match="num_workers must be an int >= 1"):
        ctl.start(0)


class _SpawnRecordingPool(_ReplyingPool):
    """Records spawn() calls: a refused request must start no process."""

    def __init__(self, members):
        super().__init__(members)
        self.spawned = []

    def spawn(self):
        self.spawned.append(f"w{len(self.spawned) + 10}")
        return self.spawned[-1]


@pytest.mark.parametrize("value", [-1, 0, "5", True, float("nan")])
def test_bad_join_timeout_is_refused_before_anything_starts(config, value):
    """Regression: join_timeout_s=-1 started a joiner and failed the prepare stage; "5" failed with a
    bare TypeError from the clock arithmetic after the joiner had started."""
    ctl = ElasticController(config)
    ctl.pool = _SpawnRecordingPool(["a", "b"])
    ctl.members, ctl.generation = ("a", "b"), 1
    with pytest.raises(ValueError, match=r"join_timeout_s must be a number of seconds > 0, got"):
        ctl.scale_up(1, join_timeout_s=value)
    assert ctl.pool.spawned == [] and ctl.events == [] and ctl.members == ("a", "b")


def test_bad_serve_arguments_are_refused(config):
    ctl = ElasticController(config)
    ctl.pool = _ReplyingPool(["a", "b"])
    ctl.members, ctl.generation = ("a", "b"), 1
    ctl.submit(torch.ones(2, 16))
    with pytest.raises(ValueError, match=r"timeout_s must be a number of seconds > 0, got -1"):
        ctl.serve(timeout_s=-1)  # was a TimeoutError "not done after -1 s"
    with pytest.raises(TypeError, match=r"until must be a callable returning bool, or None, got 'x'"):
        ctl.serve(until="x")
    assert ctl.pending == 1
    ctl.serve(timeout_s=30)
    assert ctl.pending == 0


@pytest.mark.parametrize("activation", ["silu", "relu2_no_mul"])
def test_reference_model_loads_the_checkpoint_workers_read(tmp_path, activation):
    """Regression: a non-gated model's checkpoint stored its [E, I, H] experts as experts.gate_up_proj,
    which the single-process ReferenceModel (load_fused_moe, transformers' names) refused: non-gated
    stacked experts are experts.up_proj there."""
    from moekit.elastic import ReferenceModel, read_experts

    spec = ModelSpec(4, 16, 8, 2, num_layers=2, activation=activation)
    path = write_checkpoint(spec, tmp_path / "m.safetensors", seed=3)
    model = ReferenceModel(spec, path, backend="reference")
    for i, layer in enumerate(model.layers):
        rows = read_experts(path, spec, i, range(4))  # what the workers load
        assert torch.equal(layer.experts.w13, rows["w13"]) and torch.equal(layer.experts.w2, rows["w2"])
    assert model(torch.randn(3, 16)).shape == (3, 16)

"""EPLB load recorder: exact counts, padding rows skipped, sliding window, dummy steps, no host sync."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from moekit.eplb.maps import map_to_physical
from moekit.eplb.policy import rebalance_experts
from moekit.eplb.recorder import LoadRecorder


def _count_loop(ids, num_real, R):
    counts = [0] * R
    for t in range(min(num_real, ids.shape[0])):
        for e in ids[t].tolist():
            counts[e] += 1
    return counts


@pytest.mark.parametrize("T,num_real", [(0, 0), (1, 1), (1, 0), (20, 20), (20, 13), (20, 100)],
                         ids=["no-tokens", "one-token", "one-padding-row", "no-padding", "padding", "more-than-T"])
def test_counts_exact_and_padding_ignored(T, num_real):
    L, R, k = 2, 12, 3
    rec = LoadRecorder(L, R, window_size=4)
    ids = torch.randint(0, R, (T, k), dtype=torch.int32)
    rec.set_num_tokens(num_real)
    rec.record(1, ids)
    assert rec.current[1].tolist() == _count_loop(ids, num_real, R)
    assert rec.current[0].tolist() == [0] * R  # other layers untouched
    rec.end_step()
    assert rec.window_load()[1].tolist() == _count_loop(ids, num_real, R)


def test_rows_numbered_across_chunks_of_a_step():
    R, k = 8, 2
    rec = LoadRecorder(1, R, window_size=2)
    ids = torch.randint(0, R, (30, k))
    rec.set_num_tokens(torch.tensor([17]))  # a device tensor, as a CUDA graph would use
    for chunk in ids.split(8):  # four calls: rows 0-7, 8-15, 16-23, 24-29
        rec.record(0, chunk)
    assert rec.current[0].tolist() == _count_loop(ids, 17, R)


def test_sliding_window_and_dummy_steps():
    R = 4
    rec = LoadRecorder(1, R, window_size=3)
    steps = [torch.full((s + 1, 1), s % R) for s in range(5)]  # step s: s+1 tokens to slot s % R
    for s, ids in enumerate(steps):
        rec.record(0, ids)
        rec.end_step()
        if s == 2:  # a dummy step in between records nothing and keeps the window
            rec.record(0, torch.zeros(50, 1, dtype=torch.int64))
            rec.end_step(dummy=True)
    # The window keeps the last 3 real steps: s = 2, 3, 4 -> slot 2: 3, slot 3: 4, slot 0: 5.
    assert rec.window_load()[0].tolist() == [5, 0, 3, 4]
    assert rec.current.sum() == 0
    rec.clear(0)
    assert rec.window_load().sum() == 0


def test_recorder_argument_errors():
    with pytest.raises(ValueError, match="window_size must be an int >= 1"):
        LoadRecorder(1, 4, window_size=0)
    with pytest.raises(ValueError, match="num_tokens must be"):
        LoadRecorder(1, 4, window_size=1).set_num_tokens(-1)


@pytest.mark.parametrize("num_tokens", [torch.tensor([2.7]), torch.tensor([True]), torch.tensor([2, 3])],
                         ids=["float_truncated", "bool", "two_values"])
def test_recorder_num_tokens_tensor_must_be_one_integer(num_tokens):
    """A float tensor used to be truncated silently (2.7 -> 2) and a [2] one failed inside reshape."""
    rec = LoadRecorder(1, 4, window_size=1)
    with pytest.raises(ValueError, match=r"num_tokens as a tensor must be a \[1\] integer tensor"):
        rec.set_num_tokens(num_tokens)
    rec.set_num_tokens(torch.tensor(3))  # a 0-d integer tensor is one value
    assert rec.num_real_tokens.tolist() == [3]


class _OpLog(TorchDispatchMode):
    """Records every aten op that runs."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


# Ops that read device values on the host or give data-dependent shapes.
HOST_SYNC_OPS = {"aten._local_scalar_dense", "aten.item", "aten.nonzero", "aten.masked_select", "aten.unique",
                 "aten._unique2", "aten.unique_consecutive", "aten.is_nonzero", "aten.equal",
                 "aten.repeat_interleave", "aten.bincount"}


def _map_and_record(device):
    E, R, k, T = 6, 10, 2, 9
    _, log2phy, count = rebalance_experts(torch.rand(1, E), R, 1, 1, 2)
    rec = LoadRecorder(1, R, window_size=2, device=device)
    rec.set_num_tokens(torch.tensor([5], device=device))
    ids = torch.randint(0, E, (T, k), dtype=torch.int32).to(device)
    log2phy, count = log2phy[0].to(device), count[0].to(device)

    def run():
        physical = map_to_physical(ids, log2phy, count)
        rec.record(0, physical)
        return physical

    return run, rec


def test_map_and_record_use_no_host_sync_ops():
    run, _ = _map_and_record("cpu")
    with _OpLog() as log:
        run()
    assert log.ops, "the dispatch log saw no op"
    assert not HOST_SYNC_OPS.intersection(log.ops), sorted(HOST_SYNC_OPS.intersection(log.ops))


def test_map_and_record_run_on_meta_tensors():
    """Meta tensors hold no data: any host read (.item(), .tolist(), nonzero) would raise here."""
    run, rec = _map_and_record("meta")
    physical = run()
    assert physical.device.type == "meta" and physical.shape == (9, 2)
    assert rec.current.device.type == "meta"


def test_record_argument_errors():
    """layer=-1 used to count into the last layer (Python indexing) and 1-D ids failed in unpacking."""
    rec = LoadRecorder(2, 4, window_size=1)
    with pytest.raises(ValueError, match=r"layer must be an int in \[0, 2\), got -1"):
        rec.record(-1, torch.tensor([[0, 1]]))
    with pytest.raises(ValueError, match=r"layer must be an int in \[0, 2\), got 2"):
        rec.record(2, torch.tensor([[0, 1]]))
    with pytest.raises(ValueError, match=r"physical_ids must be \[T, k\], got shape \(2,\)"):
        rec.record(0, torch.tensor([0, 1]))
    assert rec.current.sum() == 0

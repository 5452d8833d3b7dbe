"""Weight rearrangement plans, checked with a fake group (pure index math, no processes)."""

import pytest
import torch

from moekit.eplb.policy import rebalance_experts
from moekit.eplb.rearrange import StagedLayer, commit_layer, exchange_layer, plan_layer, rearrange_layer


def _execute(old, new, P):
    """Apply every rank's plan to a fake world whose slot contents are expert ids."""
    S = len(old) // P
    world = [old[r * S:(r + 1) * S] for r in range(P)]
    plans = plan_layer(old, new, P)
    after = [list(w) for w in world]
    sends = {(src, e, r): slot for src, p in enumerate(plans) for e, r, slot in p.sends}
    for r, p in enumerate(plans):
        for dst, src in p.local:
            assert world[r][src] == new[r * S + dst]
            after[r][dst] = world[r][src]
        received = [e for e, _, _ in p.recvs]
        assert len(received) == len(set(received)), "an expert was received twice by one rank"
        for e, src, dst_slots in p.recvs:
            assert e not in world[r], "received an expert the rank already holds"
            slot = sends.pop((src, e, r))  # the matching send exists
            assert world[src][slot] == e
            for d in dst_slots:
                after[r][d] = world[src][slot]
    assert not sends, f"sends without a receive: {sends}"
    return [e for w in after for e in w], plans


@pytest.mark.parametrize("E,R,P", [(12, 16, 8), (8, 16, 2), (6, 12, 4), (5, 10, 1), (16, 32, 4)])
def test_plans_produce_the_new_placement(E, R, P):
    for _ in range(5):
        old = rebalance_experts(torch.rand(1, E) ** 2, R, 1, 1, P)[0][0].tolist()
        new = rebalance_experts(torch.rand(1, E) ** 2, R, 1, 1, P)[0][0].tolist()
        result, plans = _execute(old, new, P)
        assert result == new
        changed = {g for g in range(R) if old[g] != new[g]}
        S = R // P
        assert {r * S + s for r, p in enumerate(plans) for s in p.changed_slots} == changed


def test_nothing_planned_when_nothing_changes():
    old = list(range(8)) * 2
    assert all(not p.local and not p.recvs and not p.sends for p in plan_layer(old, old, 4))


def test_local_copy_preferred_and_senders_spread():
    # 4 ranks x 2 slots. Expert 0 lives on ranks 0 and 1; ranks 2 and 3 both need it, and rank 0
    # also needs a second copy of expert 1, which it already holds.
    old = [0, 1, 0, 2, 3, 4, 5, 6]
    new = [1, 1, 0, 2, 0, 4, 0, 6]
    plans = plan_layer(old, new, 4)
    assert plans[0].local == ((0, 1),) and not plans[0].recvs
    assert plans[2].recvs == ((0, 0, (0,)),)  # first receiver: rank 0 (no sends yet, lowest rank)
    assert plans[3].recvs == ((0, 1, (0,)),)  # second receiver: rank 1, which has sent least
    assert plans[0].sends == ((0, 2, 0),) and plans[1].sends == ((0, 3, 0),)


def test_one_message_per_expert_for_several_slots():
    # Rank 1 needs expert 0 in both its slots: one receive, written twice.
    plans = plan_layer([0, 1, 2, 3], [0, 1, 0, 0], 2)
    assert plans[1].recvs == ((0, 0, (0, 1)),)
    assert plans[0].sends == ((0, 1, 0),)


def test_single_process_rearrange_moves_every_tensor_bytewise():
    E, R = 5, 8
    logical = {"w13": torch.randn(E, 6, 4), "w2": torch.randn(E, 4, 3).to(torch.bfloat16),
               "scale": torch.rand(E), "zeros": torch.randint(-8, 8, (E, 2), dtype=torch.int8),
               "fp8": torch.randn(E, 4, 3).to(torch.float8_e4m3fn)}  # no index_copy_ kernel for fp8 in torch
    old = torch.tensor([0, 1, 2, 3, 4, 0, 1, 2])
    new = torch.tensor([4, 4, 3, 0, 1, 2, 4, 3])
    tensors = [t[old].clone() for t in logical.values()]
    addresses = [t.data_ptr() for t in tensors]
    assert rearrange_layer(tensors, old, new, rank=0, num_ranks=1) == 8  # every slot changes
    for t, ref in zip(tensors, logical.values()):
        assert torch.equal(t.view(torch.uint8), ref[new].view(torch.uint8))
    assert [t.data_ptr() for t in tensors] == addresses  # moved in place
    assert rearrange_layer(tensors, new, new, rank=0, num_ranks=1) == 0


def test_exchange_does_not_write_and_errors():
    tensors = [torch.arange(4.0).view(4, 1)]
    plan = plan_layer([0, 1, 2, 3], [3, 1, 2, 0], 1)[0]
    staged = exchange_layer(tensors, plan)
    assert tensors[0].view(-1).tolist() == [0.0, 1.0, 2.0, 3.0]  # staging only reads
    commit_layer(tensors, staged)
    assert tensors[0].view(-1).tolist() == [3.0, 1.0, 2.0, 0.0]
    commit_layer(tensors, StagedLayer(torch.zeros(0, dtype=torch.int64), (tensors[0][:0],)))
    two_rank = plan_layer([0, 1, 2, 3], [2, 1, 0, 3], 2)[0]
    with pytest.raises(ValueError, match="no process group"):
        exchange_layer([torch.zeros(2, 1)], two_rank)
    with pytest.raises(ValueError, match="needs a process group"):
        rearrange_layer([torch.zeros(2, 1)], torch.arange(4), torch.arange(4), rank=0, num_ranks=2)
    with pytest.raises(ValueError, match="S=4 rows first"):
        rearrange_layer([torch.zeros(3, 1)], torch.arange(4), torch.arange(4), rank=0, num_ranks=1)


@pytest.mark.parametrize("new", [[9, 1, 2, 3], [-1, 1, 2, 3], [4, 1, 2, 3]], ids=["beyond_E", "negative", "unheld"])
def test_new_placement_with_an_expert_nobody_holds_is_refused(new):
    """Such a plan used to fail with a bare KeyError (no rank holds the expert to send it)."""
    with pytest.raises(ValueError, match=r"new_phy2log places expert\(s\) \[-?\d\] that no slot of old_phy2log"):
        plan_layer([0, 1, 2, 3], new, 2)
    tensors = [torch.arange(4.0).view(4, 1)]
    with pytest.raises(ValueError, match="no slot of old_phy2log holds"):
        rearrange_layer(tensors, torch.arange(4), torch.tensor(new), rank=0, num_ranks=1)
    assert tensors[0].view(-1).tolist() == [0.0, 1.0, 2.0, 3.0]  # nothing written


def test_rearrange_layer_argument_errors():
    tensors = [torch.arange(4.0).view(4, 1)]
    with pytest.raises(ValueError, match=r"rank must be an int in \[0, num_ranks=1\), got 1"):  # was IndexError
        rearrange_layer(tensors, torch.arange(4), torch.tensor([1, 0, 2, 3]), rank=1, num_ranks=1)
    with pytest.raises(TypeError, match="must be integer tensors, got torch.float32"):  # 1.5 was truncated to 1
        rearrange_layer(tensors, torch.arange(4.0), torch.tensor([1.5, 0, 2, 3]), rank=0, num_ranks=1)
    assert tensors[0].view(-1).tolist() == [0.0, 1.0, 2.0, 3.0]

"""EPLB policy: the EPLB.md fixture, the readable loop reference, invariants, preserve-slots."""

import pytest
import torch

from moekit.eplb.policy import (balanced_packing, balancedness, gpu_loads, improves, preserve_slots, rebalance_experts,
                                rebalance_experts_loop, replicate_experts, static_gpu_loads)

from hypothesis_or_skip import given, settings, st

FIXTURE_LOAD = [[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
                [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27]]
FIXTURE_PHY2LOG = [[5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
                   [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1]]
FIXTURE_COUNTS = [[1, 2, 1, 1, 2, 2, 1, 1, 1, 1, 2, 1],
                  [1, 2, 1, 1, 1, 2, 2, 1, 2, 1, 1, 1]]


def check_invariants(phy2log, log2phy, count, E, R, P):
    """Every property a placement must have, checked element by element."""
    L = phy2log.shape[0]
    assert phy2log.shape == (L, R) and count.shape == (L, E) and log2phy.shape == (L, E, R - E + 1)
    assert bool((count >= 1).all()) and bool((count.sum(-1) == R).all())
    for layer in range(L):
        row = phy2log[layer].tolist()
        assert all(0 <= e < E for e in row)
        for e in range(E):
            slots = [s for s in range(R) if row[s] == e]
            assert len(slots) == count[layer, e]
            listed = log2phy[layer, e].tolist()
            assert sorted(listed[:len(slots)]) == slots  # every replica listed once
            assert listed[len(slots):] == [-1] * (R - E + 1 - len(slots))  # padding
    # R / P slots per GPU is the layout itself: the per-GPU load must account for every token.
    if L:
        loads = torch.rand(L, E, dtype=torch.float64)
        assert torch.allclose(gpu_loads(loads, phy2log, P).sum(-1), loads.sum(-1))


def test_fixture_exactly():
    phy2log, log2phy, count = rebalance_experts(torch.tensor(FIXTURE_LOAD), 16, 4, 2, 8)
    assert phy2log.tolist() == FIXTURE_PHY2LOG
    assert count.tolist() == FIXTURE_COUNTS
    check_invariants(phy2log, log2phy, count, 12, 16, 8)
    # The readable loop reaches the same answer.
    loop_phy, loop_cnt = rebalance_experts_loop(torch.tensor(FIXTURE_LOAD), 16, 4, 2, 8)
    assert loop_phy.tolist() == FIXTURE_PHY2LOG and loop_cnt.tolist() == FIXTURE_COUNTS


def test_fixture_log2phy_replica_order():
    """Replica r of an expert is the r-th slot replication created (DeepSeek's order)."""
    _, log2phy, _ = rebalance_experts(torch.tensor(FIXTURE_LOAD, dtype=torch.float32), 16, 4, 2, 8)
    # Layer 0: expert 5 was replicated first (load 165) and lives in slots 0 and 2; expert 1 in 13 and 15.
    assert log2phy[0, 5, :2].tolist() in ([0, 2], [2, 0])
    assert sorted(log2phy[0, 1, :2].tolist()) == [13, 15]


CONFIGS = [
    # (E, R, G, N, P) and the edge each one covers
    pytest.param(12, 16, 4, 2, 8, id="hierarchical-fixture-shape"),
    pytest.param(16, 24, 4, 2, 4, id="hierarchical-2-nodes"),
    pytest.param(12, 16, 3, 2, 4, id="groups-not-divisible-by-nodes-global"),
    pytest.param(10, 10, 1, 1, 5, id="no-redundant"),
    pytest.param(7, 13, 1, 1, 1, id="one-gpu-odd-sizes"),
    pytest.param(8, 16, 8, 4, 8, id="one-group-per-expert"),
    pytest.param(6, 12, 2, 2, 12, id="one-slot-per-gpu"),
    pytest.param(1, 4, 1, 1, 2, id="one-expert"),
]


@pytest.mark.parametrize("E,R,G,N,P", CONFIGS)
@pytest.mark.parametrize("kind", ["float", "few-integers-with-ties", "zeros-and-ones"])
def test_matches_loop_reference(E, R, G, N, P, kind):
    L = 5
    if kind == "float":
        load = torch.rand(L, E) * 100
    elif kind == "few-integers-with-ties":
        load = torch.randint(0, 4, (L, E))
    else:
        load = (torch.rand(L, E) < 0.3).to(torch.int64)
    phy2log, log2phy, count = rebalance_experts(load, R, G, N, P)
    ref_phy, ref_cnt = rebalance_experts_loop(load, R, G, N, P)
    assert torch.equal(phy2log, ref_phy)
    assert torch.equal(count, ref_cnt)
    check_invariants(phy2log, log2phy, count, E, R, P)


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_invariants_random(data):
    P = data.draw(st.sampled_from([1, 2, 4, 8]), label="P")
    N = data.draw(st.sampled_from([n for n in (1, 2, 4) if P % n == 0]), label="N")
    G = data.draw(st.sampled_from([1, 2, 4, 8]), label="G")
    E = G * data.draw(st.integers(1, 4), label="experts per group")
    R = P * data.draw(st.integers(-(-E // P), -(-E // P) + 3), label="slots per gpu")
    L = data.draw(st.integers(1, 3), label="L")
    values = data.draw(st.lists(st.integers(0, 50), min_size=L * E, max_size=L * E), label="load")
    load = torch.tensor(values, dtype=torch.int64).view(L, E)
    phy2log, log2phy, count = rebalance_experts(load, R, G, N, P)
    check_invariants(phy2log, log2phy, count, E, R, P)
    ref_phy, ref_cnt = rebalance_experts_loop(load, R, G, N, P)
    assert torch.equal(phy2log, ref_phy) and torch.equal(count, ref_cnt)
    if G % N == 0:  # hierarchical: a group's experts and all their replicas stay on one node
        node_of_slot = torch.arange(R) // (R // N)
        for layer in range(L):
            for g in range(G):
                members = torch.isin(phy2log[layer], torch.arange(g * (E // G), (g + 1) * (E // G)))
                assert node_of_slot[members].unique().numel() == 1


def test_empty_layers():
    phy2log, log2phy, count = rebalance_experts(torch.zeros(0, 8), 12, 1, 1, 4)
    assert phy2log.shape == (0, 12) and log2phy.shape == (0, 8, 5) and count.shape == (0, 8)


def test_balanced_packing_against_hand_worked_example():
    # Weights 5,1,4,2 into 2 packs of 2: 5 -> pack 0; 4 -> pack 1; 2 -> pack 1 (total 4 < 5); 1 -> pack 0.
    pack, rank = balanced_packing(torch.tensor([[5.0, 1.0, 4.0, 2.0]], dtype=torch.float64), 2)
    assert pack.tolist() == [[0, 0, 1, 1]]
    assert rank.tolist() == [[0, 1, 0, 1]]
    # Equal weights: visited lower index first, ties between packs go to the lowest pack.
    pack, rank = balanced_packing(torch.ones(1, 4, dtype=torch.float64), 2)
    assert pack.tolist() == [[0, 1, 0, 1]] and rank.tolist() == [[0, 0, 1, 1]]


def test_replicate_experts_hand_worked_example():
    # Loads 6, 3 with 4 slots: 6/1 -> expert 0 (count 2); 6/2=3 ties 3/1 -> first index, expert 0.
    phy2log, rank, count = replicate_experts(torch.tensor([[6.0, 3.0]], dtype=torch.float64), 4)
    assert phy2log.tolist() == [[0, 1, 0, 0]]
    assert rank.tolist() == [[0, 0, 1, 2]]
    assert count.tolist() == [[3, 1]]


@pytest.mark.parametrize("args,message", [
    (((2, 12), 16, 5, 1, 8), "num_groups=5 must divide the number of experts E=12"),
    (((2, 12), 16, 4, 3, 8), "num_nodes=3 must divide num_gpus=8"),
    (((2, 12), 18, 4, 2, 8), "num_gpus=8 must divide num_replicas=18"),
    (((2, 12), 8, 4, 2, 8), "must be >= the number of experts E=12"),
    (((12,), 16, 4, 2, 8), "load must be 2-D"),
    (((2, 12), 16, 0, 2, 8), "num_groups must be an int >= 1"),
    (((2, 12), 16.0, 4, 2, 8), "num_replicas must be an int >= 1"),
])
def test_precondition_errors(args, message):
    shape, *rest = args
    with pytest.raises(ValueError, match=message):
        rebalance_experts(torch.ones(shape), *rest)


def test_bad_load_values():
    with pytest.raises(ValueError, match="non-negative"):
        rebalance_experts(torch.tensor([[1.0, -1.0]]), 2, 1, 1, 1)
    with pytest.raises(ValueError, match="finite"):
        rebalance_experts(torch.tensor([[1.0, float("nan")]]), 2, 1, 1, 1)
    with pytest.raises(TypeError, match="torch.Tensor"):
        rebalance_experts([[1, 2]], 2, 1, 1, 1)


def test_balancedness_and_static_loads():
    load = torch.tensor([[4.0, 0.0, 2.0, 2.0], [1.0, 1.0, 1.0, 1.0]])
    static = static_gpu_loads(load, 2)  # GPU 0: experts 0, 1; GPU 1: experts 2, 3
    assert static.tolist() == [[4.0, 4.0], [2.0, 2.0]]
    per_layer, overall = balancedness(torch.tensor([[1.0, 3.0], [2.0, 2.0], [0.0, 0.0]]))
    assert per_layer.tolist() == [pytest.approx(2 / 3), 1.0, 1.0]
    assert overall == pytest.approx((2 + 2 + 0) / (3 + 2 + 0))
    assert static_gpu_loads(torch.ones(1, 5), 2).tolist() == [[3.0, 2.0]]  # first E % P GPUs one more
    # A replicated expert's load is split evenly over its replicas.
    assert gpu_loads(torch.tensor([[6.0, 2.0]]), torch.tensor([[0, 1, 0, 0]]), 2).tolist() == [[4.0, 4.0]]


def test_rebalancing_improves_skewed_load():
    load = (torch.randn(8, 64) * 1.5).exp()
    phy2log, _, _ = rebalance_experts(load, 80, 1, 1, 8)
    _, before = balancedness(static_gpu_loads(load, 8))
    _, after = balancedness(gpu_loads(load, phy2log, 8))
    assert after > before and after > 0.9


# -- preserve slots -----------------------------------------------------------------------

def _check_preserved(old, new, out, P):
    L, R = new.shape
    S = R // P
    for layer in range(L):
        for g in range(P):
            o = old[layer, g * S:(g + 1) * S].tolist()
            n = new[layer, g * S:(g + 1) * S].tolist()
            r = out[layer, g * S:(g + 1) * S].tolist()
            assert sorted(r) == sorted(n)  # the GPU hosts exactly the new experts
            kept = sum(min(o.count(e), n.count(e)) for e in set(o))
            unchanged = sum(1 for a, b in zip(o, r) if a == b)
            assert unchanged == kept  # every expert that stays keeps a slot: the fewest copies
            # Each stayed expert keeps its first old slots; newcomers fill the freed slots in order.
            left = {e: min(o.count(e), n.count(e)) for e in set(o)}
            freed = []
            for s, e in enumerate(o):
                if left.get(e, 0) > 0:
                    assert r[s] == e
                    left[e] -= 1
                else:
                    freed.append(s)
            need = {e: max(0, n.count(e) - o.count(e)) for e in set(n)}
            newcomers = []
            seen = {}
            for e in n:  # the copies beyond the old count, in the new order
                seen[e] = seen.get(e, 0) + 1
                if seen[e] > n.count(e) - need[e]:
                    newcomers.append(e)
            assert [r[s] for s in freed] == newcomers


@pytest.mark.parametrize("E,R,P", [(12, 16, 8), (8, 16, 2), (5, 10, 1), (6, 12, 4)])
def test_preserve_slots_properties(E, R, P):
    L = 6
    old = rebalance_experts(torch.rand(L, E), R, 1, 1, P)[0]
    new = rebalance_experts(torch.rand(L, E), R, 1, 1, P)[0]
    out = preserve_slots(old, new, P)
    _check_preserved(old, new, out, P)


def test_preserve_slots_hand_worked_example():
    # One GPU of 4 slots: old [3, 1, 1, 2], new [1, 5, 3, 5]: 3 stays in slot 0, one 1 stays in
    # slot 1; slots 2 and 3 are freed and take the newcomers 5, 5 in order.
    out = preserve_slots(torch.tensor([[3, 1, 1, 2]]), torch.tensor([[1, 5, 3, 5]]), 1)
    assert out.tolist() == [[3, 1, 5, 5]]


def test_preserve_slots_identity_cases():
    old = rebalance_experts(torch.rand(3, 12), 16, 1, 1, 4)[0]
    assert torch.equal(preserve_slots(old, old, 4), old)
    shuffled = old.view(3, 4, 4)[:, :, torch.randperm(4)].reshape(3, 16)  # moved only within GPUs
    assert torch.equal(preserve_slots(old, shuffled, 4), old)


def test_preserve_slots_errors():
    with pytest.raises(ValueError, match="one shape"):
        preserve_slots(torch.zeros(2, 8, dtype=torch.int64), torch.zeros(2, 4, dtype=torch.int64), 2)
    with pytest.raises(ValueError, match="must divide"):
        preserve_slots(torch.zeros(2, 8, dtype=torch.int64), torch.zeros(2, 8, dtype=torch.int64), 3)


def test_gpu_loads_argument_errors():
    load = torch.ones(1, 4)
    with pytest.raises(ValueError, match="num_gpus must be an int >= 1, got 0"):  # was ZeroDivisionError
        gpu_loads(load, torch.tensor([[0, 1, 2, 3]]), 0)
    with pytest.raises(ValueError, match=r"phy2log entries must lie in \[0, E=4\), got values in \[0, 9\]"):
        gpu_loads(load, torch.tensor([[0, 1, 2, 3, 0, 9]]), 2)  # was an index error from gather


def test_improves_compares_the_busiest_gpu():
    """DeepSeek's greedy plan for this load is less balanced than the contiguous placement."""
    load = torch.tensor([[6, 3, 6, 1, 6, 8, 8, 8, 0]], dtype=torch.float64)
    start = torch.arange(9).view(1, 9)  # GPU loads 15, 15, 16
    plan, _, _ = rebalance_experts(load, 9, 1, 1, 3)
    assert gpu_loads(load, plan, 3).tolist() == [[17.0, 15.0, 14.0]]
    assert improves(load, start, plan, 3).tolist() == [False]
    assert improves(load, plan, start, 3).tolist() == [True]  # 17 -> 16: a 5.9 % lower peak
    assert improves(load, plan, start, 3, min_improvement=0.05).tolist() == [True]
    assert improves(load, plan, start, 3, min_improvement=0.06).tolist() == [False]
    assert improves(torch.zeros(1, 9), plan, start, 3).tolist() == [False]  # no load: nothing to gain

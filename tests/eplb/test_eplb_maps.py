"""EPLB maps: the routing-time replica choice and the placement tables, against plain loops."""

import pytest
import torch

from moekit.eplb.maps import (initial_placement, map_to_physical, maps_from_phy2log, physical_expert_map,
                              physical_to_logical_load)
from moekit.eplb.policy import rebalance_experts


def _map_loop(ids, log2phy, count):
    T, k = ids.shape
    out = [[0] * k for _ in range(T)]
    for t in range(T):
        for j in range(k):
            e = int(ids[t, j])
            out[t][j] = int(log2phy[e, (t * k + j) % int(count[e])])
    return torch.tensor(out, dtype=torch.int32).view(T, k)


@pytest.mark.parametrize("T,k", [(0, 2), (1, 1), (1, 4), (37, 3), (64, 8)],
                         ids=["no-tokens", "one-token-k1", "one-token", "odd", "k8"])
def test_map_to_physical_matches_loop(T, k):
    E, R = 10, 16
    _, log2phy, count = rebalance_experts(torch.rand(1, E), R, 1, 1, 4)
    ids = torch.randint(0, E, (T, k), dtype=torch.int32)
    out = map_to_physical(ids, log2phy[0], count[0])
    assert out.dtype == torch.int32 and out.shape == (T, k)
    assert torch.equal(out, _map_loop(ids, log2phy[0], count[0]))


def test_map_spreads_over_replicas():
    # Expert 0 has 3 replicas: consecutive assignments f = 0..5 go to replicas 0,1,2,0,1,2.
    phy2log = torch.tensor([[0, 1, 0, 0]])
    log2phy, count = maps_from_phy2log(phy2log, 2, 3)
    ids = torch.zeros(6, 1, dtype=torch.int32)
    assert map_to_physical(ids, log2phy[0], count[0]).view(-1).tolist() == [0, 2, 3, 0, 2, 3]


def _maps_loop(phy2log, E, width):
    L, R = phy2log.shape
    log2phy = torch.full((L, E, width), -1, dtype=torch.int64)
    count = torch.zeros(L, E, dtype=torch.int64)
    for layer in range(L):
        for s in range(R):
            e = int(phy2log[layer, s])
            log2phy[layer, e, count[layer, e]] = s
            count[layer, e] += 1
    return log2phy, count


def test_maps_from_phy2log_matches_loop():
    E, R = 9, 15
    phy2log = rebalance_experts(torch.rand(4, E) ** 3, R, 1, 1, 5)[0]
    log2phy, count = maps_from_phy2log(phy2log, E, R - E + 1)
    ref_l2p, ref_cnt = _maps_loop(phy2log, E, R - E + 1)
    assert torch.equal(log2phy, ref_l2p) and torch.equal(count, ref_cnt)


def test_maps_from_phy2log_errors():
    with pytest.raises(ValueError, match="at least one slot"):
        maps_from_phy2log(torch.tensor([[0, 0, 1]]), 3, 3)
    with pytest.raises(ValueError, match="width=1"):
        maps_from_phy2log(torch.tensor([[0, 0, 1]]), 2, 1)
    with pytest.raises(ValueError, match=r"lie in \[0, 2\)"):
        maps_from_phy2log(torch.tensor([[0, 2, 1]]), 2, 2)


def test_initial_placement_and_expert_map():
    assert initial_placement(2, 3, 5).tolist() == [[0, 1, 2, 0, 1]] * 2
    assert physical_expert_map(6, 3, 1).tolist() == [-1, -1, 0, 1, -1, -1]
    with pytest.raises(ValueError, match="must divide"):
        physical_expert_map(7, 3, 1)


def test_physical_to_logical_load():
    load = torch.tensor([[5, 1, 2, 7]])
    phy2log = torch.tensor([[1, 0, 1, 2]])
    assert physical_to_logical_load(load, phy2log, 3).tolist() == [[1, 7, 7]]


def test_initial_placement_needs_an_expert():
    with pytest.raises(ValueError, match="num_logical must be >= 1, got 0"):  # was ZeroDivisionError
        initial_placement(1, 0, 3)


def test_physical_to_logical_load_shape_error():
    """A load with fewer slots than phy2log failed inside scatter_add_ with torch's index message."""
    with pytest.raises(ValueError, match=r"load must be \[L, R\] like phy2log \(1, 6\), got \(1, 5\)"):
        physical_to_logical_load(torch.ones(1, 5), torch.tensor([[0, 1, 2, 3, 0, 1]]), 4)

"""Elastic transition plans, checked on expert ids (pure index math, no processes).

`_execute` below runs a plan on a fake world whose slots hold expert ids, checking each rule
of moekit.elastic.plan on the way, independently of plan.apply_plan (which is also checked,
and must reject broken plans).
"""

import dataclasses
import random
from collections import Counter

import pytest
import torch

from moekit.eplb.policy import balancedness, gpu_loads, rebalance_experts
from moekit.elastic.plan import (apply_plan, assign_packs, check_world, num_slots, place, plan_transition,
                                 smallest_world, validate_request, world_problem)


def _holdings_from(phy2log, members):
    """Each member's slots of a placement [L][R]: worker -> per layer tuple of experts."""
    L, P = len(phy2log), len(members)
    S = len(phy2log[0]) // P
    return {w: tuple(tuple(phy2log[l][r * S:(r + 1) * S]) for l in range(L)) for r, w in enumerate(members)}


def _execute(holdings, plan):
    """Run the plan on expert ids; assert every rule on the way. Returns worker -> new holdings."""
    union, members = plan.union, plan.members
    L = len(plan.phy2log)
    assert union[:len(members)] == members
    out = {}
    for layer in range(L):
        holders = {e for w in union for e in holdings[w][layer]}
        sends = Counter((src, e, r) for src, w in enumerate(union)
                        for e, r, _ in plan.workers[w].layers[layer].sends)
        recvs = Counter()
        for r, w in enumerate(members):
            wp = plan.workers[w]
            assert wp.rank == r
            new = [None] * wp.num_slots
            rp, loads = wp.layers[layer], wp.loads[layer]
            for dst, src in rp.local:
                new[dst] = holdings[w][layer][src]
            for e, src, dst in rp.recvs:
                assert e not in holdings[w][layer], f"{w} receives expert {e}, which it holds"
                assert e in holdings[union[src]][layer], f"{w} receives expert {e} from a worker without it"
                recvs[(src, e, r)] += 1
                for d in dst:
                    new[d] = e
            for e, dst in loads:
                assert e not in holders, f"expert {e} is read from the checkpoint though a worker holds it"
                for d in dst:
                    new[d] = e
            assert None not in new, f"{w}: slot {new.index(None)} not written"
            experts_in = [e for e, _, _ in rp.recvs] + [e for e, _ in loads]
            assert len(experts_in) == len(set(experts_in)), "an expert arrives twice at one worker"
            out.setdefault(w, []).append(tuple(new))
        assert sends == recvs and max(recvs.values(), default=1) == 1, "sends and receives must pair one to one"
        for w in union[len(members):]:
            wp = plan.workers[w]
            assert wp.num_slots == 0 and not wp.layers[layer].local and not wp.layers[layer].recvs
            assert not wp.loads[layer]
    return {w: tuple(rows) for w, rows in out.items()}


def _random_placement(gen, L, E, R, P):
    return [row for row in rebalance_experts(torch.rand(L, E, generator=gen) ** 3, R, 1, 1, P)[0].tolist()]


def _case(gen, kind, E=8, extra=2, L=2):
    """(holdings, members, helpers) of a random transition of the given kind."""
    rnd = random.Random(int(torch.randint(0, 2 ** 31, (1,), generator=gen)))
    old_P = {"scale_down": 4, "scale_up": 2, "recover": 3, "start": 1, "replace": 3}[kind]
    old = [f"w{i}" for i in range(old_P)]
    holdings = _holdings_from(_random_placement(gen, L, E, num_slots(E, extra, old_P), old_P), old)
    if kind == "start":
        members, helpers = ["w0", "w1", "w2"], []
        holdings = {w: tuple(() for _ in range(L)) for w in members}
    elif kind == "scale_down":
        members = rnd.sample(old, 2)
        helpers = [w for w in old if w not in members]
    elif kind == "scale_up":
        members, helpers = old + ["w9"], []
        holdings["w9"] = tuple(() for _ in range(L))
    elif kind == "recover":
        dead = rnd.choice(old)
        members, helpers = [w for w in old if w != dead], []
        del holdings[dead]
    else:  # one member replaced by a joiner
        members, helpers = [old[0], "w7", old[2]], [old[1]]
        holdings["w7"] = tuple(() for _ in range(L))
    return holdings, members, helpers


@pytest.mark.parametrize("kind", ["start", "scale_down", "scale_up", "recover", "replace"])
def test_plans_reach_the_new_placement(kind, gen):
    for _ in range(6):
        holdings, members, helpers = _case(gen, kind)
        load = torch.rand(2, 8, generator=gen) * 100
        phy2log = place(load, len(members), num_redundant=2, num_groups=1,
                        holdings=[holdings[w] for w in members])
        plan = plan_transition(holdings, members, phy2log, helpers)
        result = _execute(holdings, plan)
        expected = _holdings_from(phy2log, members)
        assert result == expected
        assert apply_plan(holdings, plan) == expected
        assert {w: plan.workers[w].holdings for w in members} == expected
        counts = plan.counts()
        if kind == "start":
            assert counts["loaded"] == sum(len(r) for r in phy2log) and counts["messages"] == 0
        if kind in ("scale_down", "scale_up", "replace"):
            assert counts["loaded"] == 0, "every expert has a live holder: nothing is read from the checkpoint"
        assert plan_transition(holdings, members, phy2log, helpers) == plan  # deterministic


def test_lost_experts_are_loaded_and_replicas_are_moved():
    """Regression of the fault path: the dead worker's only copies come from the checkpoint, its replicated
    experts from a survivor."""
    holdings = {"a": ((0, 1, 2),), "b": ((3, 4, 0),)}  # "c" died holding (5, 6, 3)
    plan = plan_transition(holdings, ["a", "b"], ((0, 1, 3, 5, 3, 4, 6, 0),))
    loads = {w: plan.workers[w].loads[0] for w in ("a", "b")}
    assert loads == {"a": ((5, (3,)),), "b": ((6, (2,)),)}
    assert plan.workers["a"].layers[0].recvs == ((3, 1, (2,)),)  # expert 3 survives on b
    assert _execute(holdings, plan) == {"a": ((0, 1, 3, 5),), "b": ((3, 4, 6, 0),)}


def test_senders_are_spread():
    """Two holders of expert 0, three receivers: the holder with fewer sends so far is picked (ties: lower)."""
    holdings = {"a": ((0, 1),), "b": ((0, 2),), "c": ((),), "d": ((),), "e": ((),)}
    phy2log = ((0, 1, 0, 2, 0, 1, 0, 2, 0, 2),)
    plan = plan_transition(holdings, ["a", "b", "c", "d", "e"], phy2log)
    senders = [src for w in "cde" for e, src, _ in plan.workers[w].layers[0].recvs if e == 0]
    assert senders == [0, 1, 0]


def test_apply_plan_rejects_broken_plans():
    holdings = {"a": ((0, 1),), "b": ((2, 3),)}
    plan = plan_transition(holdings, ["a", "b"], ((3, 1, 2, 0),))
    wp = plan.workers["a"]
    dropped = dataclasses.replace(wp, layers=(dataclasses.replace(wp.layers[0], recvs=()),))
    with pytest.raises(ValueError, match="never written"):
        apply_plan(holdings, dataclasses.replace(plan, workers={**plan.workers, "a": dropped}))
    wrong = dataclasses.replace(wp, layers=(dataclasses.replace(wp.layers[0], recvs=((2, 1, (0,)),)),))
    with pytest.raises(ValueError, match="does not send it"):
        apply_plan(holdings, dataclasses.replace(plan, workers={**plan.workers, "a": wrong}))


def test_plan_input_errors():
    with pytest.raises(ValueError, match="at least one worker"):
        plan_transition({}, [], ((0,),))
    with pytest.raises(ValueError, match="divisible by 2 members"):
        plan_transition({"a": ((),), "b": ((),)}, ["a", "b"], ((0, 1, 2),))
    with pytest.raises(ValueError, match="holdings must give worker 'b'"):
        plan_transition({"a": ((),)}, ["a", "b"], ((0, 1),))
    with pytest.raises(ValueError, match="distinct"):
        plan_transition({"a": ((),)}, ["a"], ((0,),), helpers=["a"])


def test_assign_packs_keeps_packs_and_balance(gen):
    L, E, R, P = 3, 8, 12, 4
    load = torch.rand(L, E, generator=gen) * 50
    phy2log = rebalance_experts(load, R, 1, 1, P)[0]
    S = R // P
    perm = torch.randperm(P, generator=gen).tolist()
    holdings = [tuple(tuple(phy2log[l, perm[m] * S:(perm[m] + 1) * S].tolist()) for l in range(L)) for m in range(P)]
    out = assign_packs(phy2log, P, holdings)
    for l in range(L):
        for m in range(P):  # each rank gets back the pack it holds: nothing moves
            assert sorted(out[l, m * S:(m + 1) * S].tolist()) == sorted(holdings[m][l])
    assert balancedness(gpu_loads(load, out, P))[1] == pytest.approx(balancedness(gpu_loads(load, phy2log, P))[1])
    joiners = [tuple(() for _ in range(L))] * P  # nobody holds anything: the policy's order is kept
    assert torch.equal(assign_packs(phy2log, P, joiners), phy2log)


def test_place_covers_every_expert(gen):
    for P in (1, 2, 3, 4):
        load = torch.rand(2, 8, generator=gen) * 10
        phy2log = place(load, P, num_redundant=2, num_groups=2, holdings=[((), ())] * P)
        assert all(len(row) == num_slots(8, 2, P) for row in phy2log)
        assert all(set(row) == set(range(8)) for row in phy2log)


# -- the capacity rule and request validation ---------------------------------------------

@pytest.mark.parametrize("E,extra,P,R", [(8, 0, 3, 9), (8, 2, 3, 12), (8, 2, 4, 12), (8, 0, 8, 8), (5, 0, 1, 5)])
def test_num_slots(E, extra, P, R):
    assert num_slots(E, extra, P) == R


def test_capacity_rule():
    # E=8 + 2 redundant, 5 slots per rank: P=1 needs 10 per rank; P=2 holds 5 each.
    assert smallest_world(8, 2, 5) == 2
    assert world_problem(8, 2, 2, 5) is None and world_problem(8, 2, 3, 5) is None
    problem = world_problem(8, 2, 1, 5)
    assert "R=10" in problem and "max_slots_per_rank=5" in problem and "smallest world that fits has 2" in problem
    assert "larger than the E=8 experts" in world_problem(8, 2, 9, 5)
    assert smallest_world(8, 2, 1) is None
    with pytest.raises(ValueError, match="no world of at most E ranks fits"):
        check_world(8, 2, 4, 1)
    assert check_world(8, 2, 3, 5) == 12


def test_validate_request_errors():
    members = ("w0", "w1", "w2")
    kw = dict(num_experts=8, num_redundant=2, max_slots_per_rank=5)
    assert validate_request(members, ["w2", "w0"], 1, **kw) == ("w2", "w0")
    with pytest.raises(ValueError, match=r"unknown worker ids \['w7'\]"):
        validate_request(members, ["w0", "w7"], 0, **kw)
    with pytest.raises(ValueError, match="more than once"):
        validate_request(members, ["w0", "w0"], 0, **kw)
    with pytest.raises(ValueError, match="target world is empty"):
        validate_request(members, [], 0, **kw)
    with pytest.raises(ValueError, match="keep 1 \\+ add 0 workers.*max_slots_per_rank=5"):
        validate_request(members, ["w1"], 0, **kw)  # shrinking below what can hold the experts
    with pytest.raises(ValueError, match="add must be an int >= 0"):
        validate_request(members, ["w1"], -1, **kw)
    with pytest.raises(TypeError, match="keep must be a sequence"):
        validate_request(members, "w0", 1, **kw)

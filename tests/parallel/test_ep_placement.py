"""Expert parallelism, step 1 (STYLE.md rule 12): index math with fake group sizes, no processes.

Expected values are worked out by hand in the comments, not recomputed by the code under test.
"""

import pytest
import torch
import torch.nn as nn

from moekit import fused_experts
from moekit.parallel import (AllGatherReduceScatterDispatcher, AllReduceDispatcher, AllToAllDispatcher,
                             LocalDispatcher, ParallelConfig, StaticAllToAllDispatcher)
from moekit.parallel.ep_common import (RowLayout, combine_rows, destination_mask, pack_rows, padding_rows,
                                       row_sources, send_rows, sum_partials, unpack_rows)
from moekit.parallel.placement import (expert_map, expert_owner, local_experts, non_local_expert, split_bounds,
                                       split_sizes)
from moekit.parallel.shard import make_shard
from moekit.parallel.tensor_parallel import shard_intermediate

from conftest import TOL, rel_err


# -- placement -----------------------------------------------------------------------------

def test_linear_split_spreads_the_remainder_over_the_first_ranks():
    # E=10 over P=4: 10 = 4*2 + 2, so ranks 0 and 1 hold 3 experts, ranks 2 and 3 hold 2.
    assert split_sizes(10, 4) == [3, 3, 2, 2]
    # starts: r*2 + min(r, 2) = 0, 3, 6, 8
    assert [split_bounds(10, 4, r) for r in range(4)] == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert split_sizes(8, 4) == [2, 2, 2, 2]  # divisible: no remainder
    assert split_sizes(0, 3) == [0, 0, 0]


@pytest.mark.parametrize("placement, owner, held_by_1, map_of_1", [
    # linear: blocks [0 1 2] [3 4 5] [6 7] [8 9]
    ("linear", [0, 0, 0, 1, 1, 1, 2, 2, 3, 3], [3, 4, 5], [-1, -1, -1, 0, 1, 2, -1, -1, -1, -1]),
    # round robin: expert e on rank e % 4; rank 1 holds 1, 5, 9 as local 0, 1, 2
    ("round_robin", [0, 1, 2, 3, 0, 1, 2, 3, 0, 1], [1, 5, 9], [-1, 0, -1, -1, -1, 1, -1, -1, -1, 2]),
])
def test_placement_E10_P4(placement, owner, held_by_1, map_of_1):
    assert expert_owner(10, 4, placement).tolist() == owner
    assert local_experts(10, 4, 1, placement).tolist() == held_by_1
    emap = expert_map(10, 4, 1, placement)
    assert emap.dtype == torch.int32 and emap.tolist() == map_of_1
    # every expert has exactly one owner, and its local id on the owner is its index in local_experts
    for r in range(4):
        held = local_experts(10, 4, r, placement)
        m = expert_map(10, 4, r, placement)
        assert (m[held] == torch.arange(held.numel(), dtype=torch.int32)).all()
        assert int((m >= 0).sum()) == held.numel()


def test_one_expert_per_rank_and_single_rank():
    assert expert_owner(4, 4, "linear").tolist() == [0, 1, 2, 3]
    assert expert_map(4, 4, 2, "round_robin").tolist() == [-1, -1, 0, -1]
    assert expert_map(5, 1, 0, "linear").tolist() == [0, 1, 2, 3, 4]


def test_non_local_expert_is_held_elsewhere():
    assert non_local_expert(10, 4, 0, "linear") == 3  # rank 0 holds 0..2: first foreign id is 3
    assert non_local_expert(10, 4, 1, "linear") == 0
    assert non_local_expert(10, 4, 0, "round_robin") == 1
    with pytest.raises(ValueError, match="num_ranks >= 2"):
        non_local_expert(4, 1, 0, "linear")


@pytest.mark.parametrize("args, match", [
    ((3, 4, 0, "linear"), "num_experts must be an int >= the number of ranks 4"),  # a rank would hold nothing
    ((8, 4, 0, "striped"), "placement must be one of"),
    ((8, 4, 4, "linear"), r"rank must be in \[0, 4\)"),
    ((8, 0, 0, "linear"), "num_ranks must be an int >= 1"),
])
def test_placement_errors(args, match):
    with pytest.raises(ValueError, match=match):
        local_experts(*args)


# -- ParallelConfig ------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, match", [
    (dict(ep_size=2, ep_rank=2), r"ep_rank must be in \[0, ep_size=2\), got 2"),
    (dict(ep_size=2, tp_size=2), "exclusive"),
    (dict(ep_size=2, placement="striped"), "placement must be one of"),
    (dict(ep_size=2, dispatcher="all_reduce"), "dispatcher for expert parallelism must be one of"),
    (dict(tp_size=2, dispatcher="all_to_all"), r"dispatcher for tensor parallelism \(tp_size > 1\)"),
    (dict(ep_size=2, dispatcher="static_all_to_all"), "needs max_tokens_per_rank"),
    (dict(ep_size=2, max_tokens_per_rank=0), "max_tokens_per_rank must be an int >= 1, got 0"),
    (dict(ep_size=True), "ep_size must be an int >= 1, got True"),
    (dict(ep_size=2, timeout_s=0), "timeout_s must be a number > 0"),
    (dict(ep_size=2, timeout_s=True), "timeout_s must be a number > 0, got True"),  # a bool was taken as 1 s
    (dict(dispatcher="static_all_to_all"), "needs max_tokens_per_rank"),  # one rank: same rule as P ranks
])
def test_parallel_config_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ParallelConfig(**kwargs)


def test_parallel_config_defaults():
    assert ParallelConfig().dispatcher_name == "local"
    assert ParallelConfig(ep_size=4, ep_rank=3).dispatcher_name == "all_to_all"
    assert ParallelConfig(tp_size=2, tp_rank=1).dispatcher_name == "all_reduce"
    p = ParallelConfig(tp_size=3, tp_rank=2)
    assert (p.size, p.rank) == (3, 2)


@pytest.mark.parametrize("dispatcher, max_tokens", [("all_to_all", None), ("allgather_reducescatter", None),
                                                    ("static_all_to_all", 4), ("p2p_all_to_all", 4),
                                                    ("all_reduce", None)])
def test_a_group_of_one_rank_runs_every_expert_locally(dispatcher, max_tokens):
    """Regression: ParallelConfig.expert_parallel(dispatcher=...) in a world of one process (torchrun
    --nproc-per-node 1) built the named dispatcher, which refused ep_size=1: a script written for P ranks
    failed on one (tensor_parallel(dispatcher="all_reduce") was told it is not an expert-parallel
    dispatcher). Every expert is local there: the layer matches the single-process layer."""
    from moekit import FusedMoE, RoutingConfig

    parallel = ParallelConfig(dispatcher=dispatcher, max_tokens_per_rank=max_tokens)
    assert parallel.dispatcher_name == "local"
    E, H, I = 6, 16, 8
    w13, w2 = torch.randn(E, 2 * I, H) * 0.3, torch.randn(E, H, I) * 0.3
    x, logits = torch.randn(5, H), torch.randn(5, E)
    single = FusedMoE(E, H, I, RoutingConfig(top_k=2), backend="reference")
    layer = FusedMoE(E, H, I, RoutingConfig(top_k=2), backend="reference", parallel=parallel)
    single.load_weights(w13, w2)
    layer.load_weights(w13, w2)
    with torch.no_grad():
        assert torch.equal(layer(x, logits), single(x, logits))


def test_parallel_layer_needs_torch_distributed():
    from moekit import FusedMoE, RoutingConfig

    with pytest.raises(ValueError, match="init_process_group"):
        FusedMoE(8, 16, 8, RoutingConfig(top_k=2), parallel=ParallelConfig(ep_size=2, ep_rank=0))


# -- dispatchers own no parameters ---------------------------------------------------------

def test_dispatchers_own_no_parameters():
    ep = ParallelConfig(ep_size=4, ep_rank=1, max_tokens_per_rank=8)
    dispatchers = [
        LocalDispatcher(),
        AllToAllDispatcher(ep, 10, 2),
        AllGatherReduceScatterDispatcher(ep, 10, 2),
        StaticAllToAllDispatcher(ep, 10, 2),
        AllReduceDispatcher(ParallelConfig(tp_size=2, tp_rank=0)),
    ]
    for d in dispatchers:
        assert not isinstance(d, nn.Module), d.name
        for name, value in vars(d).items():
            assert not isinstance(value, (nn.Parameter, nn.Module)), f"{d.name}.{name}"
            assert not (isinstance(value, torch.Tensor) and value.requires_grad), f"{d.name}.{name}"


# -- destination math (the all_to_all and static paths) --------------------------------------

def _example():
    # linear E=10 over P=4: owner = [0 0 0 1 1 1 2 2 3 3]
    owner = expert_owner(10, 4, "linear")
    ids = torch.tensor([[0, 1],   # both experts on rank 0       -> goes to {0} once, not twice
                        [3, 9],   # rank 1 and rank 3            -> {1, 3}
                        [8, 9]],  # both on rank 3               -> {3}
                       dtype=torch.int32)
    return owner, ids


def test_destination_mask_once_per_rank():
    owner, ids = _example()
    # [P, T]: rank r's row says which tokens go to r
    assert destination_mask(ids, owner, 4).tolist() == [[True, False, False],
                                                         [False, True, False],
                                                         [False, False, False],
                                                         [False, True, True]]


def test_send_rows_dynamic_blocks():
    owner, ids = _example()
    mask = destination_mask(ids, owner, 4)
    # rows per rank: r0 {t0}, r1 {t1}, r2 {}, r3 {t1, t2}: packed back to back -> rows 0 | 1 | - | 2 3, trash 4
    rows = send_rows(mask, None, trash=4)
    assert rows.tolist() == [[0, 4, 4], [4, 1, 4], [4, 4, 4], [4, 2, 3]]
    assert row_sources(rows, torch.full((5,), -7)).tolist() == [0, 1, 1, 2]
    # C = min(P, k) = 2 rows per token, increasing rank: t0 -> (0, trash), t1 -> (1, 2), t2 -> (3, trash)
    assert combine_rows(rows, 2).tolist() == [[0, 1, 3], [4, 2, 4]]
    assert combine_rows(rows, 4) is rows  # P <= k: every rank is a possible destination


def test_send_rows_static_capacity():
    owner, ids = _example()
    mask = destination_mask(ids, owner, 4)
    # capacity 3 rows per destination: blocks start at 0 3 6 9, trash row 12;
    # t0 is the first token for r0 -> 0; t1 the first for r1 -> 3 and for r3 -> 9; t2 the second for r3 -> 10
    rows = send_rows(mask, 3, trash=12)
    assert rows.tolist() == [[0, 12, 12], [12, 3, 12], [12, 12, 12], [12, 9, 10]]
    # empty slots of block r keep T + r = 3 + r (the padding row for destination r)
    fill = torch.tensor([3, 3, 3, 4, 4, 4, 5, 5, 5, 6, 6, 6, 6])
    assert row_sources(rows, fill).tolist() == [0, 3, 3, 1, 4, 4, 5, 5, 5, 1, 2, 6]


def test_sum_partials_in_destination_order():
    back = torch.tensor([[1.0], [2.0], [4.0], [8.0], [0.0]])  # last row is the zero trash row
    rows = torch.tensor([[0, 1, 3], [4, 2, 4]])  # [C, T]
    assert sum_partials(back, rows).tolist() == [[1.0], [6.0], [8.0]]
    assert sum_partials(back, rows[:, :0]).shape == (0, 1)  # T = 0


def test_sum_partials_adds_in_rank_order_from_zero():
    # fp32: ((0 + 1e8) + 1) + -1e8 + 1 = 1 exactly (1e8 + 1 rounds to 1e8); a pairwise sum would give 0
    back = torch.tensor([[1e8], [1.0], [-1e8], [1.0], [0.0]])
    rows = torch.tensor([[0], [1], [2], [3]])  # one token, C = 4 destinations
    assert sum_partials(back, rows).tolist() == [[1.0]]
    assert sum_partials(back, torch.tensor([[2], [0], [4], [4]])).tolist() == [[0.0]]  # trash rows add zero


# -- packed rows -------------------------------------------------------------------------

def test_row_layout_pads_x_to_16_bytes():
    layout = RowLayout(33, torch.bfloat16, 3)  # x: 66 bytes -> weights at 80, ids at 92, row 112
    assert (layout.x_bytes, layout.w_offset, layout.ids_offset, layout.row_bytes) == (66, 80, 92, 112)
    dsv3 = RowLayout(7168, torch.bfloat16, 8)  # 14336 + 32 + 32: no padding needed
    assert (dsv3.w_offset, dsv3.row_bytes) == (14336, 14400)


@pytest.mark.parametrize("dtype, H", [
    (torch.bfloat16, 33),  # odd H: x ends at byte 66, weights aligned up to 68
    (torch.float32, 5),
    (torch.float16, 1),    # H = 1
])
def test_pack_unpack_roundtrip(dtype, H, gen):
    T, k = 6, 3
    x = torch.randn(T, H, generator=gen).to(dtype)
    w = torch.rand(T, k, generator=gen)
    ids = torch.randint(0, 100, (T, k), generator=gen, dtype=torch.int32)
    layout = RowLayout(H, dtype, k)
    assert layout.row_bytes % 16 == 0 and layout.w_offset % 4 == 0
    pad = padding_rows(layout, torch.tensor([7, 9], dtype=torch.int32))
    rows = pack_rows(x, w, ids, layout, tail=pad)
    assert rows.shape == (T + 2, layout.row_bytes) and rows.dtype == torch.uint8
    xr, wr, idr = unpack_rows(rows, layout)
    assert torch.equal(xr[:T], x) and torch.equal(wr[:T], w) and torch.equal(idr[:T], ids)
    # padding rows: zero token, zero weights, every id the given foreign expert
    assert not xr[T:].any() and not wr[T:].any()
    assert idr[T:].tolist() == [[7] * k, [9] * k]
    # x as a view that starts one element past the storage and skips columns: the same rows
    wide = torch.randn(T, H + 3, generator=gen).to(dtype)
    wide[:, 1:H + 1] = x
    xv, wv, iv = unpack_rows(pack_rows(wide[:, 1:H + 1], w, ids, layout), layout)
    assert torch.equal(xv, x) and torch.equal(wv, w) and torch.equal(iv, ids)


# -- tensor parallelism of I: the partial outputs add up to the full layer ------------------

@pytest.mark.parametrize("activation, I, tp", [
    ("silu", 7, 3),          # uneven slices 3 2 2
    ("swigluoai", 8, 2),
    ("relu2_no_mul", 5, 5),  # non-gated, one intermediate unit per rank
])
def test_tp_slices_sum_to_full(activation, I, tp, gen):
    E, H, T, k = 4, 12, 9, 2
    gated = not activation.endswith("_no_mul")
    rows = 2 * I if gated else I
    w13 = torch.randn(E, rows, H, generator=gen) * 0.3
    w2 = torch.randn(E, H, I, generator=gen) * 0.3
    b13 = torch.randn(E, rows, generator=gen)
    b2 = torch.randn(E, H, generator=gen)
    x = torch.randn(T, H, generator=gen)
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)]).to(torch.int32)
    w = torch.rand(T, k, generator=gen)
    kw = dict(activation=activation, backend="reference")
    full = fused_experts(x, w13, w2, w, ids, b13=b13, b2=b2, **kw)
    parts = []
    for r in range(tp):
        a, b, c, d = shard_intermediate(w13, w2, b13, b2, tp, r, gated)
        assert b.shape[2] == split_sizes(I, tp)[r]
        parts.append(fused_experts(x, a, b, w, ids, b13=c, b2=d, **kw))
    assert rel_err(torch.stack(parts).sum(0), full) <= TOL[torch.float32]


def test_shard_select_global_or_local(gen):
    # round robin E=10 over 4 ranks: rank 1 holds experts 1, 5, 9
    shard = make_shard(ParallelConfig(ep_size=4, ep_rank=1, placement="round_robin"), 10, 6)
    w13 = torch.randn(10, 12, 8, generator=gen)
    w2 = torch.randn(10, 8, 6, generator=gen)
    a, b, _, _ = shard.select(w13, w2, gated=True)
    assert torch.equal(a, w13[[1, 5, 9]]) and torch.equal(b, w2[[1, 5, 9]])
    a, b, _, _ = shard.select(w13[:3], w2[:3], gated=True)  # already local: passed through
    assert torch.equal(a, w13[:3])
    with pytest.raises(ValueError, match=r"all E=10 experts or this rank's E_local=3"):
        shard.select(w13[:4], w2[:4], gated=True)
    tp = make_shard(ParallelConfig(tp_size=2, tp_rank=1), 10, 6)
    b2 = torch.randn(10, 8, generator=gen)
    _, b, _, d = tp.select(w13, w2, None, b2, gated=True)
    assert torch.equal(b, w2[:, :, 3:]) and not d.any()  # b2 is added by rank 0 only
    with pytest.raises(ValueError, match="intermediate_size must be >= tp_size=8"):
        make_shard(ParallelConfig(tp_size=8, tp_rank=0), 10, 6)


def test_shard_select_checks_the_tensors_it_cuts(gen):
    """Regression: with a full w13 the other tensors were cut by index unchecked (w2 with E + 2 experts
    was accepted, a local w2 failed with a bare IndexError), and under TP a w13 with extra rows was cut
    by row ranges into a tensor of the right local shape."""
    E, H, I = 10, 8, 6
    ep = make_shard(ParallelConfig(ep_size=4, ep_rank=1, placement="round_robin"), E, I)
    w13, w2 = torch.randn(E, 2 * I, H, generator=gen), torch.randn(E, H, I, generator=gen)
    for bad in (dict(w2=torch.randn(E + 2, H, I)), dict(w2=w2[:3]), dict(b13=torch.randn(3, 2 * I)),
                dict(b2=torch.randn(E + 1, H))):
        name = next(iter(bad))
        args = dict(w13=w13, w2=w2, b13=None, b2=None)
        args.update(bad)
        with pytest.raises(ValueError, match=rf"{name} must hold all E=10 experts \(dim 0\), as w13 does, got shape"):
            ep.select(gated=True, **args)
    tp = make_shard(ParallelConfig(tp_size=2, tp_rank=1), E, I)
    with pytest.raises(ValueError, match=r"w13 must hold 2I=12 rows \(dim 1\) for the full I=6 that w2 holds, "
                                         r"got shape \(10, 14, 8\)"):
        tp.select(torch.randn(E, 2 * I + 2, H), w2, gated=True)
    with pytest.raises(ValueError, match=r"b13 must hold I=6 rows"):
        tp.select(torch.randn(E, I, H), w2, torch.randn(E, 2 * I), None, gated=False)

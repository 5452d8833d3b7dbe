"""The all_to_all dispatchers on 3 gloo ranks, step by step, against rows and sums worked out here.

Every rank draws all ranks' tokens from one seed, dispatches its own, and checks bit for bit:
the rows it receives (from each source rank in rank order, that rank's tokens in order; the
static path adds padding rows to fill each block) and the combined output (per token, from
zero, the partials of its destination ranks added in increasing rank order). The partials
are y = x * (1 + rank) + w[:, :1], elementwise, so the expected sums are exact. Out-of-range
ids make every rank of the dynamic path raise; a rank that says it has another round makes
every rank see more_rounds. test_ep_kernels.py runs the same world with the Triton kernels
under Triton's interpreter.
"""

import random
import re
from dataclasses import dataclass
from typing import Optional, Tuple

import pytest
import torch

from moekit.parallel import AllToAllDispatcher, ParallelConfig, StaticAllToAllDispatcher
from moekit.parallel.placement import expert_owner, non_local_expert

from dist_harness import run_world


@dataclass(frozen=True)
class Case:
    name: str
    tokens: Tuple[int, ...]  # T per rank
    static: bool = False
    capacity: Optional[int] = None
    E: int = 7
    k: int = 3
    H: int = 33
    dtype: torch.dtype = torch.bfloat16
    placement: str = "linear"
    only_rank0: bool = False  # every id is an expert of rank 0: the other ranks receive nothing
    int64_strided: bool = False  # ids int64 and weights not contiguous
    bad_rank: Optional[int] = None  # this rank passes an id == E
    more_rank: Optional[int] = None  # this rank says it has more tokens: every rank must learn it


CASES = [
    Case("dynamic, bf16 odd H, rank 1 empty", (5, 0, 3)),
    Case("dynamic, k=1, fp32, round robin", (1, 4, 2), E=6, k=1, H=16, dtype=torch.float32, placement="round_robin"),
    Case("dynamic, fp16, k=4, int64 ids, strided weights", (9, 9, 9), E=12, k=4, H=8, dtype=torch.float16,
         int64_strided=True),
    Case("dynamic, every id on rank 0", (4, 4, 4), only_rank0=True),
    Case("dynamic, every rank empty", (0, 0, 0)),
    Case("dynamic, rank 2 has another round", (2, 3, 0), more_rank=2),
    Case("dynamic, rank 0 has another round, ids outside on rank 1", (3, 2, 2), more_rank=0, bad_rank=1),
    Case("static, bf16 odd H, T = capacity on rank 0", (5, 0, 3), static=True, capacity=5),
    Case("static, capacity 1, round robin", (1, 0, 1), static=True, capacity=1, E=9, k=2, H=4, dtype=torch.float32,
         placement="round_robin"),
    Case("dynamic, ids outside [0, E) on rank 1", (3, 2, 2), bad_rank=1),
]


def _inputs(case: Case, size: int, seed: int):
    """Every rank's (x [T, H], weights [T, k], ids [T, k]) from one seed."""
    g = torch.Generator().manual_seed(seed)
    owner = expert_owner(case.E, size, case.placement)
    mine = (owner == 0).nonzero().flatten()
    out = []
    for r in range(size):
        T = case.tokens[r % len(case.tokens)]
        x = torch.randn(T, case.H, generator=g).to(case.dtype)
        w = torch.rand(T, case.k, generator=g)
        if case.only_rank0:
            ids = mine[torch.randint(0, mine.numel(), (T, case.k), generator=g)]
        else:
            ids = torch.stack([torch.randperm(case.E, generator=g)[:case.k] for _ in range(T)]) if T else \
                torch.zeros(0, case.k, dtype=torch.long)
        if case.bad_rank == r and T:
            ids[T - 1, 0] = case.E
        if case.int64_strided:
            w = torch.rand(case.k, T, generator=g).t()  # [T, k], column-major
        else:
            ids = ids.to(torch.int32)
        out.append((x, w, ids))
    return out, owner


def _partial(x: torch.Tensor, w: torch.Tensor, rank: int) -> torch.Tensor:
    """The stand-in experts' output of `rank` for rows (x, w): elementwise, so bitwise reproducible."""
    return x.float() * (1 + rank) + w[:, :1].float()


def _run_case(case: Case, rank: int, size: int, seed: int, kernels: str):
    """Failure messages of one case on this rank."""
    inputs, owner = _inputs(case, size, seed)
    x, w, ids = inputs[rank]
    fields = dict(ep_size=size, ep_rank=rank, placement=case.placement, timeout_s=20)
    if case.static:
        parallel = ParallelConfig(dispatcher="static_all_to_all", max_tokens_per_rank=case.capacity, **fields)
        disp = StaticAllToAllDispatcher(parallel, case.E, case.k, kernels=kernels)
    else:
        disp = AllToAllDispatcher(ParallelConfig(**fields), case.E, case.k, kernels=kernels)
    more = {} if case.static else dict(more=rank == case.more_rank)
    if case.bad_rank is not None:
        try:
            disp.dispatch(x, w, ids, **more)
        except ValueError as exc:
            want = rf"topk_ids must lie in \[0, {case.E}\), got ids outside on rank\(s\) \[{case.bad_rank}\]"
            return [] if re.search(want, str(exc)) else [f"unexpected message: {exc}"]
        return ["no error for ids outside [0, E)"]
    d = disp.dispatch(x, w, ids, **more)
    if d.more_rounds != (case.more_rank is not None):
        return [f"more_rounds {d.more_rounds}, expected {case.more_rank is not None}"]
    # expected rows: per source rank, its tokens with an expert here, in order (+ padding blocks when static)
    exp_x, exp_w, exp_ids = [], [], []
    for xs, ws, idss in inputs:
        hit = (owner[idss.long()] == rank).any(dim=1) if idss.numel() else torch.zeros(0, dtype=torch.bool)
        exp_x.append(xs[hit])
        exp_w.append(ws[hit])
        exp_ids.append(idss[hit].to(torch.int32))
        if case.static:
            n_pad = case.capacity - int(hit.sum())
            exp_x.append(torch.zeros(n_pad, case.H, dtype=case.dtype))
            exp_w.append(torch.zeros(n_pad, case.k))
            exp_ids.append(torch.full((n_pad, case.k), non_local_expert(case.E, size, rank, case.placement),
                                      dtype=torch.int32))
    failures = []
    for what, got, want in (("x", d.x, torch.cat(exp_x)), ("weights", d.topk_weights, torch.cat(exp_w)),
                            ("ids", d.topk_ids, torch.cat(exp_ids))):
        if got.shape != want.shape or not torch.equal(got, want):
            failures.append(f"received {what} differ: got {tuple(got.shape)}, expected {tuple(want.shape)}")
    if failures:
        return failures
    out = disp.combine(_partial(d.x, d.topk_weights, rank), d)
    # expected: from zero, the partials of the destinations in increasing rank order
    want = torch.zeros(x.shape[0], case.H)
    dests = torch.zeros(size, x.shape[0], dtype=torch.bool)
    if x.shape[0]:
        dests.scatter_(0, owner[ids.long()].t(), True)
    for r in range(size):
        want[dests[r]] += _partial(x[dests[r]], w[dests[r]], r)
    if out.dtype != torch.float32 or not torch.equal(out, want):
        failures.append(f"combine differs: max abs diff {(out - want).abs().max() if out.numel() else 0}")
    return failures


def check_dispatch_cases(rank, size, kernels, base_seed):
    """Every case on this rank; a failure stops the world (the ranks may disagree on collectives after it)."""
    failures = []
    for i, case in enumerate(CASES):
        seed = base_seed + 1000 * i
        try:
            errs = _run_case(case, rank, size, seed, kernels)
        except Exception as exc:  # noqa: BLE001 (reported; a raise on one rank would hang the others)
            errs = [f"{type(exc).__name__}: {exc}"]
        failures += [f"[{case.name}] seed {seed} rank {rank} kernels={kernels}: {e}" for e in errs]
        if errs:
            break
    return failures


@pytest.mark.slow
def _on_three_ranks(check, *args):
    """Run check(rank, size, *args, base_seed) on three gloo ranks; fail with every rank's failures."""
    base_seed = random.randrange(2 ** 31)
    results = run_world(3, check, *args, base_seed, timeout_s=120, gloo_timeout_s=30)
    failures = [f for r in sorted(results) for f in results[r]]
    assert not failures, f"base seed {base_seed}:\n" + "\n".join(failures)


def test_dispatch_rows_and_sums_on_three_ranks():
    _on_three_ranks(check_dispatch_cases, "torch")


def test_kernels_argument_is_checked():
    parallel = ParallelConfig(ep_size=2, ep_rank=0)
    with pytest.raises(ValueError, match=r"kernels must be one of \['auto', 'torch', 'triton'\], got 'cuda'"):
        AllToAllDispatcher(parallel, 4, 2, kernels="cuda")
    from moekit.parallel import AllGatherReduceScatterDispatcher

    with pytest.raises(ValueError, match="allgather_reducescatter has no Triton kernels"):
        AllGatherReduceScatterDispatcher(parallel, 4, 2, kernels="triton")
    pytest.importorskip("triton")
    from moekit.parallel.ep_kernels import EpKernelConfig

    with pytest.raises(ValueError, match="kernel_config tunes the Triton kernels, but kernels='torch'"):
        AllToAllDispatcher(parallel, 4, 2, kernels="torch", kernel_config=EpKernelConfig())
    disp = AllToAllDispatcher(parallel, 4, 2, kernels="triton")
    from moekit.config import settings

    if not settings.triton_interpret:
        with pytest.raises(ValueError, match=r"kernels='triton' needs CUDA tensors .* got x on cpu"):
            disp.dispatch(torch.zeros(1, 4), torch.ones(1, 2), torch.zeros(1, 2, dtype=torch.int32))
    assert AllToAllDispatcher(parallel, 4, 2).triton_for(torch.zeros(1)) is None  # auto: torch on CPU


def check_rounds_agreed_in_dispatch(rank, size, base_seed):
    """The layer's chunk rounds with the dynamic path: per-rank chunk counts 3, 1 and 0 (chunk 2,
    T = 5, 1, 0), every rank's output equal to the single-process layer's, and no all-reduce (the
    count exchange carries whether a rank has more tokens)."""
    import torch.distributed as dist

    from moekit import FusedMoE, RoutingConfig

    E, H, I, Ts = 6, 16, 8, (5, 1, 0)
    g = torch.Generator().manual_seed(base_seed)
    x_all = torch.randn(sum(Ts), H, generator=g)
    logits = torch.randn(sum(Ts), E, generator=g)
    w13, w2 = torch.randn(E, 2 * I, H, generator=g) * 0.3, torch.randn(E, H, I, generator=g) * 0.3
    ref = FusedMoE(E, H, I, RoutingConfig(top_k=2), backend="reference")
    ref.load_weights(w13, w2)
    layer = FusedMoE(E, H, I, RoutingConfig(top_k=2), backend="reference",
                     parallel=ParallelConfig(ep_size=size, ep_rank=rank, dispatcher="all_to_all", timeout_s=20))
    layer.load_weights(w13, w2)
    layer.runner.chunk_size = 2
    start = sum(Ts[:rank])
    mine = slice(start, start + Ts[rank])
    calls = []
    real_all_reduce = dist.all_reduce

    def counting_all_reduce(*args, **kwargs):
        calls.append(1)
        return real_all_reduce(*args, **kwargs)

    dist.all_reduce = counting_all_reduce
    try:
        with torch.no_grad():
            out = layer(x_all[mine], logits[mine])
            expected = ref(x_all, logits)[mine]
    finally:
        dist.all_reduce = real_all_reduce
    failures = []
    if calls:
        failures.append(f"rank {rank}: {len(calls)} all_reduce calls in forward, expected none")
    if out.shape != expected.shape or not torch.allclose(out, expected, rtol=1e-5, atol=1e-6):
        failures.append(f"rank {rank}: output differs from the single-process layer")
    return failures


def test_chunk_rounds_are_agreed_in_the_count_exchange():
    _on_three_ranks(check_rounds_agreed_in_dispatch)


def check_refusal_reaches_every_rank(rank, size, base_seed):
    """A call refused on one rank before dispatch raises on every rank, then the next call works.

    Regression: the other ranks waited in the count exchange until the process group's timeout.
    Cases: NaN logits on rank 1; NaN in rank 0's third chunk round (chunk 2; T = 5, 1, 0); rank 2
    over max_tokens_per_rank."""
    from moekit import FusedMoE, RoutingConfig

    E, H, I, Ts = 6, 16, 8, (5, 1, 0)
    g = torch.Generator().manual_seed(base_seed)
    x_all, logits = torch.randn(sum(Ts), H, generator=g), torch.randn(sum(Ts), E, generator=g)
    w13, w2 = torch.randn(E, 2 * I, H, generator=g) * 0.3, torch.randn(E, H, I, generator=g) * 0.3
    ref = FusedMoE(E, H, I, RoutingConfig(top_k=2), backend="reference")
    ref.load_weights(w13, w2)
    start = sum(Ts[:rank])
    mine = slice(start, start + Ts[rank])
    failures = []

    def layer(**kw):
        m = FusedMoE(E, H, I, RoutingConfig(top_k=2), backend="reference", parallel=ParallelConfig(
            ep_size=size, ep_rank=rank, dispatcher="all_to_all", timeout_s=20, **kw))
        m.load_weights(w13, w2)
        return m

    def expect(name, m, x, z, refuser, own_error, rows=None):
        try:
            m(x, z)
            failures.append(f"rank {rank}, {name}: no error")
        except ValueError as err:
            if rank != refuser or own_error not in str(err):
                failures.append(f"rank {rank}, {name}: {err}")
        except RuntimeError as err:
            if rank == refuser or f"rank(s) [{refuser}] refused this call" not in str(err):
                failures.append(f"rank {rank}, {name}: {err}")
        out = m(x_all[mine][:rows], logits[mine][:rows])  # every rank is at the same collective again
        if not torch.allclose(out, ref(x_all, logits)[mine][:rows], rtol=1e-5, atol=1e-6):
            failures.append(f"rank {rank}, {name}: the next call differs from the single-process layer")

    with torch.no_grad():
        m = layer()
        z = logits[mine].clone()
        if rank == 1:
            z[0, 2] = float("nan")
        expect("NaN logits", m, x_all[mine], z, 1, "router_logits contains NaN")
        m.runner.chunk_size = 2
        z = logits[mine].clone()
        if rank == 0:
            z[4, 0] = float("nan")  # the third round (rows 4..5)
        expect("NaN in a later round", m, x_all[mine], z, 0, "router_logits contains NaN")
        capped = layer(max_tokens_per_rank=4)
        n = 5 if rank == 2 else min(Ts[rank], 4)
        expect("over capacity", capped, torch.randn(n, H), torch.randn(n, E), 2, "more than max_tokens_per_rank=4",
               rows=4)
    return failures


def test_a_call_refused_on_one_rank_raises_on_every_rank():
    _on_three_ranks(check_refusal_reaches_every_rank)


@pytest.mark.parametrize("name", ["all_to_all", "allgather_reducescatter", "static_all_to_all"])
def test_routing_weights_that_require_grad_are_refused_before_any_collective(name):
    """Regression: a trainable gate over frozen experts (only the routing weights require grad)
    was dispatched as bytes, so the gate's gradient was dropped without a word. No process group
    exists here: the refusal must come before the first collective."""
    from moekit.parallel.registry import DISPATCHERS

    parallel = ParallelConfig(ep_size=2, ep_rank=0, dispatcher=name, max_tokens_per_rank=4)
    disp = DISPATCHERS[name](parallel, 4, 2)
    x = torch.randn(3, 8)
    weights = torch.rand(3, 2, requires_grad=True)
    ids = torch.randint(0, 4, (3, 2), dtype=torch.int32)
    with pytest.raises(ValueError, match=r"topk_weights \(the routing weights.*\) requires grad.*inference-only"):
        disp.dispatch(x, weights * 1.0, ids)

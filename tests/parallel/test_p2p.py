"""The p2p_all_to_all dispatcher: its kernels and steps with P simulated ranks in one process.

Each simulated rank has its own window (peer_memory.simulated_windows: every window sees the
others as peers) and its own dispatcher; the test plays the ranks through send -> barrier ->
received -> stand-in experts -> give_back -> barrier -> gather, twice (the second round has
fewer tokens, so slots that held rows keep stale bytes the padding must neutralise, and the
partial outputs are found through a device-held address as the graphed eager path does), and
checks the received rows against the routing and the outputs bit for bit against the sum the
stand-in implies. Barriers run split in their signal and wait halves (ranks play in turn).

On CPU the cases run under Triton's interpreter in a child process (TRITON_INTERPRET is read at
import); where a GPU is present the same cases run on CUDA tensors (gpu mark), and examples/ep_torchrun.py runs the dispatcher on 2 GPUs (NCCL, 2 processes).
"""

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

IN_INTERPRETER = os.environ.get("MOEKIT_TEST_IN_INTERPRETER") == "1"
triton = pytest.importorskip("triton")

from moekit.parallel import ParallelConfig, P2PAllToAllDispatcher  # noqa: E402
from moekit.parallel import p2p_kernels as K2  # noqa: E402
from moekit.parallel.ep_kernels import EpKernelConfig  # noqa: E402
from moekit.parallel.peer_memory import regions, simulated_windows  # noqa: E402
from moekit.parallel.placement import expert_map, expert_owner, non_local_expert  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
DEVICE = "cpu" if IN_INTERPRETER else "cuda"
ON_DEVICE = pytest.mark.gpu if not IN_INTERPRETER else (lambda test: test)
SMALL = EpKernelConfig(plan_block=16, pack_block=16, combine_block=16)

if not IN_INTERPRETER:

    def test_p2p_under_the_triton_interpreter():
        env = dict(os.environ, TRITON_INTERPRET="1", MOEKIT_TEST_IN_INTERPRETER="1")
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", os.path.abspath(__file__)],
            env=env, capture_output=True, text=True, timeout=600, cwd=str(ROOT / "tests"))
        assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]

    def test_a_window_belongs_to_its_group_not_to_its_id(monkeypatch):
        """Windows were keyed by id(group): a group destroyed and replaced could leave its id to the
        new group, which then got the old group's window (freed and mapped by other processes)."""
        import weakref

        from moekit.parallel import peer_memory

        class Group:  # stands for a process group object
            pass

        old, new = Group(), Group()
        key = (id(new), 0, 2, "cpu", 64, "auto")
        monkeypatch.setattr(peer_memory, "_WINDOWS", {key: (weakref.ref(old), "old group's window")})
        with pytest.raises(ValueError, match="needs CUDA tensors"):  # not the old window: a new one is made
            peer_memory.open_window(64, new, 0, 2, torch.device("cpu"))
        monkeypatch.setitem(peer_memory._WINDOWS, key, (weakref.ref(new), "its window"))
        assert peer_memory.open_window(64, new, 0, 2, torch.device("cpu")) == "its window"

    def test_arguments_are_checked():
        with pytest.raises(ValueError, match="needs max_tokens_per_rank"):
            ParallelConfig(ep_size=2, dispatcher="p2p_all_to_all")
        ep = ParallelConfig(ep_size=2, dispatcher="p2p_all_to_all", max_tokens_per_rank=4)
        with pytest.raises(ValueError, match="kernels='torch' cannot serve it"):
            P2PAllToAllDispatcher(ep, 8, 2, kernels="torch")
        with pytest.raises(ValueError, match="peer_memory must be one of"):
            P2PAllToAllDispatcher(ep, 8, 2, peer_memory="shm")
        with pytest.raises(ValueError, match="peer_memory must be one of"):
            ParallelConfig(ep_size=2, dispatcher="p2p_all_to_all", max_tokens_per_rank=4, peer_memory="nvshmem")
        disp = P2PAllToAllDispatcher(ep, 8, 2)
        x = torch.zeros(5, 4)
        with pytest.raises(ValueError, match="got 5 tokens, more than its capacity max_tokens_per_rank=4"):
            disp.dispatch(x, torch.ones(5, 2), torch.zeros(5, 2, dtype=torch.int32))
        with pytest.raises(ValueError, match="needs CUDA tensors and Triton"):
            disp.dispatch(x[:4], torch.ones(4, 2), torch.zeros(4, 2, dtype=torch.int32))


def _ranks(P, E, k, C, placement):
    return [P2PAllToAllDispatcher(ParallelConfig(ep_size=P, ep_rank=r, dispatcher="p2p_all_to_all",
                                                 max_tokens_per_rank=C, placement=placement),
                                  E, k, kernels="triton", kernel_config=SMALL) for r in range(P)]


def _tokens(T, H, k, E, dtype, gen):
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)]).to(torch.int32) if T else \
        torch.zeros(0, k, dtype=torch.int32)
    return (torch.randn(T, H, generator=gen).to(dtype).to(DEVICE), torch.rand(T, k, generator=gen).to(DEVICE),
            ids.to(DEVICE))


def _barrier(wins):
    for w in wins:
        K2.barrier(w, phase=1)
    for w in wins:
        K2.barrier(w, phase=2)
    for w in wins:
        assert int(w.status.item()) == 0, "a barrier gave up"


def _stand_in(x, w, ids, emap):
    """y = x * (sum of the weights of this rank's experts) in fp32: padding rows give 0."""
    local = (emap.long()[ids.long()] >= 0).float()
    return x.float() * (w * local).sum(dim=1, keepdim=True)


def _play_round(disps, wins, Ts, H, k, E, C, dtype, placement, gen, indirect):
    P = len(disps)
    layout = disps[0].layout(H, dtype, k)
    owner = expert_owner(E, P, placement).to(DEVICE)
    inputs = [_tokens(T, H, k, E, dtype, gen) for T in Ts]
    handles = [d.send(*inp, win) for d, inp, win in zip(disps, inputs, wins)]
    _barrier(wins)
    ys = []
    for r, (d, win) in enumerate(zip(disps, wins)):
        x_r, w_r, ids_r = d.received(win, layout)
        emap = expert_map(E, P, r, placement).to(DEVICE)
        pad = non_local_expert(E, P, r, placement)
        for q, (x, w, ids) in enumerate(inputs):
            goes = (owner[ids.long()] == r).any(dim=1)  # q's tokens for r, in order
            n = int(goes.sum())
            blk = slice(q * C, q * C + n)
            assert torch.equal(x_r[blk], x[goes]) and torch.equal(w_r[blk], w[goes].float())
            assert torch.equal(ids_r[blk], ids[goes].int())
            rest = slice(q * C + n, (q + 1) * C)  # padding: weights 0, every id one r lacks
            assert bool((w_r[rest] == 0).all()) and bool((ids_r[rest] == pad).all())
        ys.append(_stand_in(x_r, w_r, ids_r, emap))
    for d, y, win in zip(disps, ys, wins):
        # indirect: the kernel finds y from the window through a device value (the graphed eager path)
        delta = torch.tensor([(y.data_ptr() - win.words.data_ptr()) // 16], device=DEVICE) if indirect else None
        d.give_back(y, win, layout, delta)
    _barrier(wins)
    for d, h, win, (x, w, ids) in zip(disps, handles, wins, inputs):
        out = d.gather(h, win, layout)
        want = torch.zeros(x.shape[0], H, device=DEVICE)
        for r in range(P):  # the combine's order: increasing rank, from zero, fp32
            on_r = (owner[ids.long()] == r).float()
            goes = on_r.any(dim=1, keepdim=True)
            want = torch.where(goes, want + x.float() * (w * on_r).sum(dim=1, keepdim=True), want)
        assert torch.equal(out, want)


@ON_DEVICE
@pytest.mark.parametrize("rounds, H, k, E, C, dtype, placement", [
    ([(5, 3), (2, 0)], 33, 3, 7, 5, torch.bfloat16, "linear"),         # odd H, a rank with no tokens later
    ([(4, 6, 1), (1, 2, 0)], 16, 2, 9, 6, torch.float32, "round_robin"),  # P = 3, stale slots
    ([(1, 1), (0, 1)], 8, 1, 4, 1, torch.float16, "linear"),            # k = 1, capacity 1
    ([(7, 7, 7, 7)], 24, 4, 8, 7, torch.bfloat16, "linear"),            # P = 4, every slot full
])
def test_ranks_exchange_through_windows(rounds, H, k, E, C, dtype, placement):
    seed = random.randrange(2 ** 31)
    gen = torch.Generator().manual_seed(seed)
    P = len(rounds[0])
    disps = _ranks(P, E, k, C, placement)
    layout = disps[0].layout(H, dtype, k)
    wins = simulated_windows(P, regions(P, C, layout)[2], device=DEVICE)
    for i, Ts in enumerate(rounds):
        try:
            _play_round(disps, wins, Ts, H, k, E, C, dtype, placement, gen, indirect=i % 2 == 1)
        except AssertionError as err:
            raise AssertionError(f"seed {seed}, tokens {Ts}: {err}") from err
    assert [int(w.epoch.item()) for w in wins] == [2 * len(rounds)] * P


if IN_INTERPRETER:
    from hypothesis import given, settings
    from hypothesis import strategies as st

    @settings(max_examples=12, deadline=None)
    @given(st.data())
    def test_random_exchanges_through_windows(data):
        """Random ranks, capacity, k, E, H, placement and per-round token counts (<= capacity)."""
        P = data.draw(st.integers(2, 4), "P")
        C = data.draw(st.integers(1, 6), "C")
        k = data.draw(st.integers(1, 3), "k")
        E = data.draw(st.integers(max(P, k), 10), "E")
        H = data.draw(st.sampled_from([8, 12, 33]), "H")
        placement = data.draw(st.sampled_from(["linear", "round_robin"]), "placement")
        rounds = data.draw(st.lists(st.lists(st.integers(0, C), min_size=P, max_size=P), min_size=1, max_size=3),
                           "rounds")
        gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2 ** 31 - 1), "seed"))
        disps = _ranks(P, E, k, C, placement)
        layout = disps[0].layout(H, torch.float16, k)
        wins = simulated_windows(P, regions(P, C, layout)[2], device=DEVICE)
        for i, Ts in enumerate(rounds):
            _play_round(disps, wins, Ts, H, k, E, C, torch.float16, placement, gen, indirect=i % 2 == 1)


@ON_DEVICE
def test_a_missing_peer_times_out_and_a_second_dispatch_is_refused():
    P, E, k, C, H = 2, 4, 2, 3, 8
    disps = _ranks(P, E, k, C, "linear")
    layout = disps[0].layout(H, torch.float16, k)
    wins = simulated_windows(P, regions(P, C, layout)[2], device=DEVICE, spin_limit=20)
    for win in wins:
        win.timeout_s = 0.05
    disps[0]._windows[(str(wins[0].words.device), regions(P, C, layout)[2])] = wins[0]
    x, w, ids = _tokens(2, H, k, E, torch.float16, torch.Generator().manual_seed(0))
    disps[0].dispatch(x, w, ids)  # rank 1 never arrives: the barrier gives up
    with pytest.raises(RuntimeError, match="rank 0 waited more than timeout_s=0.05 s for a peer"):
        disps[0].check_health()
    with pytest.raises(RuntimeError, match="dispatch called again before the previous dispatch's combine"):
        disps[0].dispatch(x, w, ids)


if not IN_INTERPRETER:

    @pytest.mark.gpu
    @pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
    @pytest.mark.parametrize("dtype, peer_memory", [("bfloat16", "auto"), ("float32", "symmetric"),
                                                    ("bfloat16", "ipc")])
    def test_p2p_layer_on_two_gpus(dtype, peer_memory):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               str(ROOT / "examples" / "ep_torchrun.py"), "--dispatchers", "p2p_all_to_all", "static_all_to_all",
               "--dtype", dtype, "--tokens", "96", "--empty-rank", "--iters", "3", "--peer-memory", peer_memory]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                              env=dict(os.environ, OMP_NUM_THREADS="1"))
        assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
        assert proc.stdout.count("match") == 2 and "MISMATCH" not in proc.stdout, proc.stdout

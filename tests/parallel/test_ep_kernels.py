"""The dispatchers' Triton kernels (plan, pack, combine) under Triton's interpreter, bit for bit
against the torch path of ep_common.py, then whole dispatchers on 3 gloo ranks with
kernels="triton" against the rows and sums test_ep_dispatch.py works out.

TRITON_INTERPRET is read when moekit and the kernels are imported, so the cases run in a
fresh process with it set (the parent's one test starts that process). The kernels copy
bytes as integer words, so bf16 tokens are fine in the interpreter here. Where a GPU is
present, the parent also runs the kernel cases on CUDA tensors (marked gpu).
"""

import os
import random
import subprocess
import sys

import pytest
import torch

IN_INTERPRETER = os.environ.get("MOEKIT_TEST_IN_INTERPRETER") == "1"
triton = pytest.importorskip("triton")

from moekit.config import settings  # noqa: E402 (after the skip: the kernels need Triton)
from moekit.parallel import ep_kernels as K  # noqa: E402
from moekit.parallel.ep_common import (RowLayout, combine_rows, destination_mask, pack_rows, padding_rows,  # noqa: E402
                                       row_sources, send_rows, sum_partials, unpack_rows)
from moekit.parallel.placement import expert_owner  # noqa: E402

# Kernel cases run on CPU tensors in the interpreter child, and on CUDA tensors (gpu mark) in the parent.
DEVICE = "cpu" if IN_INTERPRETER else "cuda"
ON_DEVICE = pytest.mark.gpu if not IN_INTERPRETER else (lambda test: test)
# small tiles so that several scan steps, word blocks and H blocks run
SMALL = K.EpKernelConfig(plan_block=16, pack_block=16, combine_block=16)

if not IN_INTERPRETER:

    def test_ep_kernels_under_the_triton_interpreter():
        env = dict(os.environ, TRITON_INTERPRET="1", MOEKIT_TEST_IN_INTERPRETER="1")
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", os.path.abspath(__file__)],
            env=env, capture_output=True, text=True, timeout=300,
            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]

    def test_kernel_config_is_checked():
        with pytest.raises(ValueError, match="EpKernelConfig.pack_block must be a power of two >= 1, got 1000"):
            K.EpKernelConfig(pack_block=1000)

else:
    from dist_harness import run_world
    from test_ep_dispatch import check_dispatch_cases

    def test_interpreter_flag_was_read():
        assert settings.triton_interpret

    @pytest.mark.slow
    def test_dispatchers_with_triton_kernels_on_three_ranks():
        base_seed = random.randrange(2 ** 31)
        results = run_world(3, check_dispatch_cases, "triton", base_seed, timeout_s=240, gloo_timeout_s=60)
        failures = [f for r in sorted(results) for f in results[r]]
        assert not failures, f"base seed {base_seed}:\n" + "\n".join(failures)


def _problem(T, H, k, E, P, dtype, gen, placement="linear"):
    owner = expert_owner(E, P, placement)
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)]).to(torch.int32) if T else \
        torch.zeros(0, k, dtype=torch.int32)
    x = torch.randn(T, H, generator=gen).to(dtype)
    return owner.to(DEVICE), x.to(DEVICE), torch.rand(T, k, generator=gen).to(DEVICE), ids.to(DEVICE)


def _plan(ids, owner, P, config=SMALL):
    meta = torch.full((K.meta_size(P, ids.shape[0]),), -77, dtype=torch.int32, device=DEVICE)
    K.plan(ids, owner, P, meta, config)
    return meta


def _same_rows(got, want, layout):
    """Rows equal in every byte of x, weights and ids (padding bytes may differ)."""
    for a, b in zip(unpack_rows(got, layout), unpack_rows(want, layout)):
        assert a.shape == b.shape
        assert torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


@ON_DEVICE
@pytest.mark.parametrize("T, H, k, E, P, dtype, placement", [
    (1, 8, 1, 4, 2, torch.float16, "linear"),          # one token, k=1
    (5, 33, 3, 9, 2, torch.bfloat16, "linear"),        # odd H: 66 bytes of x, copied as 2-byte words
    (37, 24, 2, 8, 4, torch.float32, "round_robin"),   # several plan steps (block 16)
    (20, 48, 8, 16, 8, torch.bfloat16, "linear"),      # P = k = 8
    (11, 40, 2, 6, 3, torch.bfloat16, "round_robin"),  # P = 3 (not a power of two)
    (0, 8, 2, 4, 2, torch.float16, "linear"),          # no tokens
])
def test_dynamic_pack_and_combine_match_torch(T, H, k, E, P, dtype, placement, gen):
    owner, x, w, ids = _problem(T, H, k, E, P, dtype, gen, placement)
    layout = RowLayout(H, dtype, k)
    meta = _plan(ids, owner, P)
    mask = destination_mask(ids, owner, P)
    assert meta[0:2 * P:2].tolist() == mask.sum(1).tolist() and meta[1:2 * P:2].tolist() == [0] * P
    assert meta[2 * P:4 * P].tolist() == [-77] * (2 * P), "plan wrote the receive part"
    n = int(mask.sum())
    rows = send_rows(mask, None, trash=n)
    want = pack_rows(x, w, ids, layout)[row_sources(rows, torch.empty(n + 1, dtype=torch.int64, device=DEVICE))]
    got = torch.zeros((min(P, k) * T, layout.row_bytes), dtype=torch.uint8, device=DEVICE)
    K.pack(x, w, ids, meta, layout, got, P, 0, None, SMALL)
    _same_rows(got[:n], want, layout)
    back = torch.randn(n + 1, H, generator=gen).to(DEVICE)
    back[n] = 0.0
    out = torch.full((T, H), float("nan"), device=DEVICE)
    K.combine(back[:n], meta, P, 0, out, SMALL)
    assert torch.equal(out, sum_partials(back, combine_rows(rows, k)))


@ON_DEVICE
@pytest.mark.parametrize("T, C, H, k, E, P, dtype", [
    (5, 5, 33, 3, 7, 2, torch.bfloat16),  # T = capacity
    (2, 6, 16, 2, 9, 3, torch.float32),   # mostly padding, P = 3
    (0, 2, 8, 2, 4, 2, torch.float16),    # no tokens: padding only
    (1, 1, 8, 1, 4, 4, torch.float16),    # capacity 1 (specialised as a constant by Triton)
])
def test_static_pack_and_combine_match_torch(T, C, H, k, E, P, dtype, gen):
    owner, x, w, ids = _problem(T, H, k, E, P, dtype, gen)
    layout = RowLayout(H, dtype, k)
    pad_ids = torch.arange(100, 100 + P, dtype=torch.int32, device=DEVICE)
    meta = _plan(ids, owner, P)
    mask = destination_mask(ids, owner, P)
    rows = send_rows(mask, C, trash=P * C)
    block = torch.arange(P * C + 1, device=DEVICE).floor_divide(C).clamp(max=P - 1)
    want = pack_rows(x, w, ids, layout, tail=padding_rows(layout, pad_ids))[row_sources(rows, block + T)]
    got = torch.full((P * C, layout.row_bytes), 0xAB, dtype=torch.uint8, device=DEVICE)  # poisoned: all written
    K.pack(x, w, ids, meta, layout, got, P, C, pad_ids, SMALL)
    _same_rows(got, want, layout)
    back = torch.randn(P * C + 1, H, generator=gen).to(DEVICE)
    back[P * C] = 0.0
    out = torch.full((T, H), float("nan"), device=DEVICE)
    K.combine(back[:P * C], meta, P, C, out, SMALL)
    assert torch.equal(out, sum_partials(back, combine_rows(rows, k)))


@ON_DEVICE
def test_plan_counts_ids_outside_and_skips_them(gen):
    owner, _, _, ids = _problem(6, 8, 3, 8, 2, torch.float32, gen)
    ids[1, 2], ids[4, 0] = 8, -1  # E and -1
    meta = _plan(ids.to(torch.int64), owner, 2)
    assert meta[1:4:2].tolist() == [2, 2]  # every destination hears of the 2 bad ids
    good = ids.clone()
    good[1, 2], good[4, 0] = good[1, 0], good[4, 1]  # the same tokens without them
    assert meta[0:4:2].tolist() == destination_mask(good, owner, 2).sum(1).tolist()


@ON_DEVICE
def test_strided_inputs_and_outputs(gen):
    T, H, k, E, P = 9, 32, 4, 12, 2
    owner, x, w, ids = _problem(T, H, k, E, P, torch.bfloat16, gen)
    wide = torch.randn(T, 2 * H, generator=gen).to(torch.bfloat16).to(DEVICE)
    wide[:, 1:H + 1] = x
    x_strided = wide[:, 1:H + 1]  # rows 128 bytes apart, starting 2 bytes past a 4-byte boundary
    w_strided = w.t().contiguous().t()  # column-major
    ids64 = ids.t().contiguous().t().to(torch.int64)
    layout = RowLayout(H, torch.bfloat16, k)
    meta = _plan(ids64, owner, P)
    got = torch.zeros((P * T, layout.row_bytes), dtype=torch.uint8, device=DEVICE)
    K.pack(x_strided, w_strided, ids64, meta, layout, got, P, 0, None, SMALL)
    want = torch.zeros_like(got)
    K.pack(x, w, ids, _plan(ids, owner, P), layout, want, P, 0, None, SMALL)
    n = int(meta[0:2 * P:2].sum())
    _same_rows(got[:n], want[:n], layout)
    back = torch.randn(n, H, generator=gen).to(DEVICE)
    wide_out = torch.full((T, 3 * H), float("nan"), device=DEVICE)
    K.combine(back, meta, P, 0, wide_out[:, H:2 * H], SMALL)  # rows 3H apart
    want = torch.empty(T, H, device=DEVICE)
    K.combine(back, meta, P, 0, want, SMALL)
    assert torch.equal(wide_out[:, H:2 * H], want)
    assert wide_out[:, :H].isnan().all() and wide_out[:, 2 * H:].isnan().all()  # nothing outside written


@ON_DEVICE
@pytest.mark.parametrize("config", [K.EpKernelConfig(), K.EpKernelConfig(2048, 8, 2048, 8, 2048, 8)],
                         ids=["default", "wide"])
def test_default_tiles_match_torch(config, gen):
    """The tile configs the benchmark sweeps, at a size where several programs and blocks run."""
    T, H, k, E, P = 300, 2056, 8, 32, 2
    owner, x, w, ids = _problem(T, H, k, E, P, torch.bfloat16, gen)
    layout = RowLayout(H, torch.bfloat16, k)
    meta = _plan(ids, owner, P, config)
    mask = destination_mask(ids, owner, P)
    n = int(mask.sum())
    rows = send_rows(mask, None, trash=n)
    want = pack_rows(x, w, ids, layout)[row_sources(rows, torch.empty(n + 1, dtype=torch.int64, device=DEVICE))]
    got = torch.empty((P * T, layout.row_bytes), dtype=torch.uint8, device=DEVICE)
    K.pack(x, w, ids, meta, layout, got, P, 0, None, config)
    _same_rows(got[:n], want, layout)
    back = torch.randn(n + 1, H, generator=gen).to(DEVICE)
    back[n] = 0.0
    out = torch.empty(T, H, device=DEVICE)
    K.combine(back[:n], meta, P, 0, out, config)
    assert torch.equal(out, sum_partials(back, combine_rows(rows, k)))

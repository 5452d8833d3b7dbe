"""Parallel FusedMoE construction on 2 gloo ranks: inconsistent configurations are reported on
every rank (not a hang), a rank that never joins makes the others time out, and E not
divisible by the group size follows the placement rule."""

import re
import time

import pytest
import torch

from moekit import FusedMoE, RoutingConfig, SharedExpertsConfig
from moekit.config import ActivationParams
from moekit.quant import get_scheme
from moekit.parallel import ParallelConfig

from conftest import TOL, rel_err
from dist_harness import run_world


def _layer(rank, *, E=8, H=16, I=8, k=2, activation="silu", shared=None, dtype=None, quant=None,
           activation_params=None, **parallel):
    fields = dict(ep_size=2, ep_rank=rank, timeout_s=20)
    fields.update(parallel)
    return FusedMoE(E, H, I, RoutingConfig(top_k=k), activation=activation, shared_experts=shared, dtype=dtype,
                    quant=quant, activation_params=activation_params, parallel=ParallelConfig(**fields))


# (what differs, kwargs on rank 0, kwargs on rank 1, message every rank must raise)
MISMATCHES = [
    ("E", dict(E=8), dict(E=6), r"num_experts: rank 0 = 8, rank 1 = 6"),
    ("k", dict(k=2), dict(k=3), r"top_k: rank 0 = 2, rank 1 = 3"),
    ("H and I", dict(H=16), dict(H=17, I=4), r"hidden_size: rank 0 = 16, rank 1 = 17; intermediate_size"),
    ("activation", dict(activation="silu"), dict(activation="gelu"),
     r"activation differs \(rank \d has '(silu|gelu)'\)"),
    ("dispatcher", dict(dispatcher="all_to_all"), dict(dispatcher="allgather_reducescatter"), r"dispatcher differs"),
    ("ep_size", dict(ep_size=2), dict(ep_size=4), r"ep_size: rank 0 = 2, rank 1 = 4"),
    ("placement", dict(placement="linear"), dict(placement="round_robin"), r"placement differs"),
    ("shared experts", dict(), dict(shared=SharedExpertsConfig(8)), r"shared_experts differs"),
    # Regression: the quantization scheme and the activation's parameters were not compared
    ("quant", dict(quant="int8_w8a8"), dict(), r"quant differs"),
    ("group size", dict(H=128, I=128, quant=get_scheme("int8_w8a16", group_size=64)),
     dict(H=128, I=128, quant="int8_w8a16"), r"quant differs"),
    ("activation params", dict(activation="swigluoai", activation_params=ActivationParams(alpha=1.5)),
     dict(activation="swigluoai"), r"activation_params differs"),
    # consistent on every rank but wrong for the group: every rank raises the same local error
    ("group size", dict(ep_size=4), dict(ep_size=4), r"ep_size/ep_rank must match the process group"),
    ("fused shared", dict(shared=SharedExpertsConfig(8, mode="fused")),
     dict(shared=SharedExpertsConfig(8, mode="fused")), r"shared_experts mode 'fused' cannot be split over ranks"),
    ("E < ranks", dict(E=1, k=1), dict(E=1, k=1), r"every rank holds at least one expert"),
]


def _check(rank, size):
    failures = []
    # Regression: a process outside the group was told "ep_size must be an int >= 1, got -1".
    only_rank0 = torch.distributed.new_group([0])
    if rank == 1:
        for make in (ParallelConfig.expert_parallel, ParallelConfig.tensor_parallel):
            try:
                make(group=only_rank0)
                failures.append(f"[not a member] rank {rank}: {make.__name__} gave no error")
            except ValueError as exc:
                if "group must contain this process (global rank 1)" not in str(exc):
                    failures.append(f"[not a member] rank {rank}: message {exc!s}")
    for what, kw0, kw1, pattern in MISMATCHES:
        try:
            _layer(rank, **(kw0 if rank == 0 else kw1))
            failures.append(f"[{what}] rank {rank}: no error")
        except ValueError as exc:
            if not re.search(pattern, str(exc)):
                failures.append(f"[{what}] rank {rank}: message {exc!s} does not match {pattern!r}")
    # Regression: the fingerprint compared the dtype argument, not the layer's dtype: None and the
    # default dtype were reported as different, and dtype=None under different default dtypes was
    # not (the ranks then exchanged rows of different sizes and gloo aborted the process).
    try:
        _layer(rank, dtype=None if rank == 0 else torch.float32)
    except ValueError as exc:
        failures.append(f"[dtype None vs float32] rank {rank}: {exc}")
    torch.set_default_dtype(torch.bfloat16 if rank == 1 else torch.float32)
    try:
        _layer(rank)
        failures.append(f"[default dtype] rank {rank}: no error")
    except ValueError as exc:
        if "dtype differs" not in str(exc):
            failures.append(f"[default dtype] rank {rank}: message {exc!s}")
    finally:
        torch.set_default_dtype(torch.float32)
    # Regression: after .to(torch.bfloat16) on every rank the layer still demanded fp32 x.
    torch.manual_seed(5)  # the same weights on both ranks
    w13, w2 = torch.randn(8, 16, 16) / 4, torch.randn(8, 16, 8) / 3
    layer, single = _layer(rank), FusedMoE(8, 16, 8, RoutingConfig(top_k=2), backend="reference")
    for m in (layer, single):
        m.load_weights(w13, w2)
        m.to(torch.bfloat16)
    torch.manual_seed(100 + rank)  # each rank its own tokens
    x, logits = torch.randn(5, 16, dtype=torch.bfloat16), torch.randn(5, 8)
    with torch.no_grad():
        try:
            err = rel_err(layer(x, logits), single(x, logits))
            if not err <= TOL[torch.bfloat16]:
                failures.append(f"[cast to bf16] rank {rank}: error {err}")
        except (TypeError, ValueError) as exc:
            failures.append(f"[cast to bf16] rank {rank}: {exc}")
    # E=7 over 2 ranks: linear gives rank 0 experts 0..3 and rank 1 experts 4..6;
    # round robin gives rank 0 experts 0 2 4 6 and rank 1 experts 1 3 5.
    expect = {
        ("linear", 0): [0, 1, 2, 3, -1, -1, -1], ("linear", 1): [-1, -1, -1, -1, 0, 1, 2],
        ("round_robin", 0): [0, -1, 1, -1, 2, -1, 3], ("round_robin", 1): [-1, 0, -1, 1, -1, 2, -1],
    }
    for placement in ("linear", "round_robin"):
        layer = _layer(rank, E=7, placement=placement)
        got = layer.expert_map.tolist()
        if got != expect[placement, rank] or layer.experts.w13.shape[0] != (4, 3)[rank]:
            failures.append(f"[E=7 {placement}] rank {rank}: expert_map {got}, {layer.experts.w13.shape[0]} experts")
    # After the reported mismatches the group still works. Collectives carry no gradients, so a
    # forward that autograd records is refused (on every rank, at the same step), not half-recorded.
    layer = _layer(rank)
    try:
        layer(torch.randn(3, 16), torch.randn(3, 8))
        failures.append(f"rank {rank}: a forward recording gradients was not refused")
    except ValueError as exc:
        if "inference-only" not in str(exc):
            failures.append(f"rank {rank}: unexpected error {exc}")
    # A trainable gate over frozen experts: only the routing weights require grad (their gradient
    # used to be dropped silently).
    gated = FusedMoE(8, 16, 8, RoutingConfig(top_k=2), gate=True,
                     parallel=ParallelConfig(ep_size=2, ep_rank=rank, timeout_s=20))
    gated.experts.requires_grad_(False)
    try:
        gated(torch.randn(3, 16))
        failures.append(f"rank {rank}: a trainable gate's forward under autograd was not refused")
    except ValueError as exc:
        if "topk_weights" not in str(exc) or "inference-only" not in str(exc):
            failures.append(f"rank {rank}: unexpected error {exc}")
    with torch.no_grad():
        out = layer(torch.randn(3, 16), torch.randn(3, 8))
    if out.shape != (3, 16) or not torch.isfinite(out).all():
        failures.append(f"rank {rank}: forward after the errors gave {tuple(out.shape)}")
    # Last (it leaves a collective pending): rank 1 never builds the layer; rank 0 must give up.
    if rank == 0:
        start = time.monotonic()
        try:
            _layer(rank, timeout_s=1.5)
            failures.append("rank 0: no TimeoutError although rank 1 never joined")
        except TimeoutError as exc:
            waited = time.monotonic() - start
            if not 1.5 <= waited < 10 or "did not build this layer" not in str(exc):
                failures.append(f"rank 0: TimeoutError after {waited:.1f} s: {exc}")
    else:
        time.sleep(6.0)  # alive but absent (a crashed peer is reported by gloo itself)
    return failures


@pytest.mark.slow
def test_inconsistent_configurations_are_reported():
    results = run_world(2, _check, timeout_s=120, gloo_timeout_s=30)
    failures = [f for r in sorted(results) for f in results[r]]
    assert not failures, "\n".join(failures)

"""Expert and tensor parallelism, step 2: FusedMoE on 2 and 4 gloo ranks against the single-process layer.

Every rank builds the same full weights and all ranks' tokens (seeded per case from a fresh
base seed), runs the single-process layer (reference backend) on all tokens, runs its
parallel layer on its own tokens, and compares its slice. Many cases share one spawned
world because spawning is slow.
"""

import random
from dataclasses import dataclass, field
from typing import Optional, Tuple

import pytest
import torch

from moekit import FusedMoE, RoutingConfig, SharedExpertsConfig
from moekit.parallel import ParallelConfig

from conftest import TOL, rel_err
from dist_harness import run_world


@dataclass(frozen=True)
class Case:
    name: str
    tokens: Tuple[int, ...]  # T per rank (cycled over the world)
    dispatcher: str = "all_to_all"
    placement: str = "linear"
    E: int = 8
    H: int = 24
    I: int = 12
    routing: RoutingConfig = field(default_factory=lambda: RoutingConfig(top_k=2))
    backend: str = "auto"
    shared: Optional[SharedExpertsConfig] = None
    bias: bool = False
    activation: str = "silu"
    dtype: torch.dtype = torch.float32
    max_tokens: Optional[int] = None
    chunk: Optional[int] = None  # runner chunk size (forces several rounds)
    cold: int = 0  # the last `cold` experts get very low logits: they receive no tokens
    tp: bool = False  # tensor parallelism of I instead of EP
    local_weights: bool = False  # load this rank's part instead of the full tensors
    gate: bool = False  # the layer owns its gate (and a correction bias), forward gets no logits


DEEPSEEK = RoutingConfig(top_k=3, scoring="sigmoid", num_expert_group=4, topk_group=2,
                         routed_scaling_factor=2.5, scale_on="output")
LLAMA4 = RoutingConfig(top_k=1, order="topk_then_sigmoid", renormalize=False, apply_router_weight_on_input=True)

CASES_2 = [
    Case("a2a: rank 1 has no tokens; gated shared experts; biases", (6, 0), shared=SharedExpertsConfig(24, gated=True),
         bias=True, backend="cpu"),
    Case("allgather, round robin, E odd, k=3", (1, 9), "allgather_reducescatter", "round_robin", E=7,
         routing=RoutingConfig(top_k=3), backend="reference"),
    Case("static, T = capacity on rank 0", (5, 3), "static_all_to_all", E=6, max_tokens=5, backend="grouped_mm",
         shared=SharedExpertsConfig(12, mode="overlap")),
    Case("a2a: half the experts get no token", (7, 4), cold=4),
    Case("static, round robin: experts with no token", (2, 6), "static_all_to_all", "round_robin", max_tokens=8,
         cold=3),
    Case("a2a, k=1, weights on input (Llama-4)", (5, 5), routing=LLAMA4, backend="reference"),
    Case("a2a, uneven chunk counts agreed in the count exchange", (7, 2), chunk=3),
    Case("allgather, chunk count from max_tokens_per_rank", (7, 2), "allgather_reducescatter", max_tokens=9, chunk=4),
    Case("a2a, DeepSeek-V3 routing, owned gate and bias, scale on output", (4, 6), E=8, routing=DEEPSEEK, gate=True,
         shared=SharedExpertsConfig(24)),
    Case("a2a, bf16, odd H", (5, 3), H=33, dtype=torch.bfloat16),
    Case("static, bf16, odd H, local weights", (3, 4), "static_all_to_all", H=33, dtype=torch.bfloat16, max_tokens=4,
         local_weights=True),
    Case("a2a, local weights, gpt-oss activation with biases", (3, 5), activation="swigluoai", bias=True,
         local_weights=True),
    Case("a2a, every rank empty", (0, 0)),
    Case("allgather, every rank empty", (0, 0), "allgather_reducescatter"),
    Case("static, every rank empty", (0, 0), "static_all_to_all", max_tokens=2),
    Case("TP all_reduce, I odd, biases, shared", (6, 6), I=13, bias=True, tp=True, shared=SharedExpertsConfig(8)),
    Case("TP all_reduce, local slices, non-gated", (3, 3), I=9, tp=True, activation="relu2_no_mul",
         local_weights=True),
]

CASES_4 = [
    Case("a2a, E=10 over 4 (3 3 2 2), rank 1 empty, shared", (3, 0, 7, 1), E=10, routing=RoutingConfig(top_k=3),
         shared=SharedExpertsConfig(12, gated=True)),
    Case("a2a, round robin, E=10, k=4", (2, 5, 0, 4), placement="round_robin", E=10,
         routing=RoutingConfig(top_k=4), backend="reference"),
    Case("allgather, linear, E=9, biases", (4, 1, 0, 6), "allgather_reducescatter", E=9, bias=True),
    Case("allgather, round robin, cold experts", (5, 5, 2, 0), "allgather_reducescatter", "round_robin", cold=3),
    Case("static, linear, E=10, k=3", (4, 0, 2, 3), "static_all_to_all", E=10, routing=RoutingConfig(top_k=3),
         max_tokens=4, backend="grouped_mm"),
    Case("static, round robin, one expert per rank", (1, 3, 2, 0), "static_all_to_all", "round_robin", E=4,
         max_tokens=3),
    Case("a2a, uneven chunk counts", (9, 1, 0, 4), chunk=2),
    Case("TP all_reduce over 4, I=6", (5, 5, 5, 5), I=6, tp=True, bias=True),
]


def _run_case(case: Case, rank: int, size: int, seed: int):
    """Returns (error or message, tolerance)."""
    g = torch.Generator().manual_seed(seed)
    Ts = [case.tokens[r % len(case.tokens)] for r in range(size)]
    if case.tp:  # every TP rank computes the same tokens
        Ts = [Ts[0]] * size
    E, H, I = case.E, case.H, case.I
    gated = not case.activation.endswith("_no_mul")
    rows = 2 * I if gated else I
    w13 = torch.randn(E, rows, H, generator=g) * H ** -0.5
    w2 = torch.randn(E, H, I, generator=g) * I ** -0.5
    b13 = torch.randn(E, rows, generator=g) * 0.1 if case.bias else None
    b2 = torch.randn(E, H, generator=g) * 0.1 if case.bias else None
    T_all = sum(Ts) if not case.tp else Ts[0]
    x_all = torch.randn(T_all, H, generator=g).to(case.dtype)
    logits = torch.randn(T_all, E, generator=g)
    if case.cold:
        logits[:, E - case.cold:] -= 100.0
    kw = dict(activation=case.activation, bias=case.bias, shared_experts=case.shared, dtype=case.dtype,
              gate=case.gate, correction_bias=case.gate)
    ref = FusedMoE(E, H, I, case.routing, backend="reference", **kw)
    ref.load_weights(w13, w2, b13, b2)
    if case.shared is not None:
        with torch.no_grad():
            for p in ref.shared.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    if case.gate:
        with torch.no_grad():
            ref.gate.weight.copy_(torch.randn(E, H, generator=g) * 0.5)
            ref.e_score_correction_bias.copy_(torch.randn(E, generator=g) * 0.1)
    with torch.no_grad():
        out_all = ref(x_all, None if case.gate else logits)
    if case.tp:
        parallel = ParallelConfig(tp_size=size, tp_rank=rank, timeout_s=20)
        mine = slice(0, T_all)
    else:
        parallel = ParallelConfig(ep_size=size, ep_rank=rank, dispatcher=case.dispatcher, placement=case.placement,
                                  max_tokens_per_rank=case.max_tokens, timeout_s=20)
        start = sum(Ts[:rank])
        mine = slice(start, start + Ts[rank])
    layer = FusedMoE(E, H, I, case.routing, backend=case.backend, parallel=parallel, **kw)
    if case.local_weights:
        shard = layer.shard
        if case.tp:
            i0, i1 = shard.i_start, shard.i_end
            cut13 = (lambda t: torch.cat((t[:, i0:i1], t[:, I + i0:I + i1]), 1)) if gated else (lambda t: t[:, i0:i1])
            layer.load_weights(cut13(w13), w2[:, :, i0:i1], None if b13 is None else cut13(b13), b2)
        else:
            held = shard.expert_ids
            layer.load_weights(w13[held], w2[held], None if b13 is None else b13[held],
                               None if b2 is None else b2[held])
    else:
        layer.load_weights(w13, w2, b13, b2)
    layer.load_state_dict({k: v for k, v in ref.state_dict().items() if not k.startswith("experts.")}, strict=False)
    if case.chunk is not None:
        layer.runner.chunk_size = case.chunk
    # The layer holds only its part: E_local experts, or an I-slice of each.
    n_local = layer.shard.local_experts * layer.shard.local_intermediate
    assert layer.experts.w2.numel() == n_local * H, "the layer holds more than its part of the experts"
    with torch.no_grad():
        out = layer(x_all[mine], None if case.gate else logits[mine])
    ref_mine = out_all[mine]
    if out.shape != ref_mine.shape or out.dtype != ref_mine.dtype:
        return f"shape/dtype {tuple(out.shape)} {out.dtype}, expected {tuple(ref_mine.shape)} {ref_mine.dtype}", 0
    return rel_err(out, ref_mine), TOL[case.dtype]


def _check_cases(rank, size, cases, base_seed):
    failures = []
    for i, case in enumerate(cases):
        seed = base_seed + 1000 * i
        try:
            err, tol = _run_case(case, rank, size, seed)
        except Exception as exc:  # noqa: BLE001 (every case reports; a raise on one rank would hang the others)
            failures.append(f"[{case.name}] seed {seed}: {type(exc).__name__}: {exc}")
            break  # the ranks may now disagree on the collectives to come
        if isinstance(err, str) or not err <= tol:
            failures.append(f"[{case.name}] seed {seed}: rank {rank} rel err {err} > {tol}")
    return failures


@pytest.mark.slow
@pytest.mark.parametrize("size, cases", [(2, CASES_2), (4, CASES_4)], ids=["2 ranks", "4 ranks"])
def test_parallel_layer_matches_single_process(size, cases):
    base_seed = random.randrange(2 ** 31)
    results = run_world(size, _check_cases, cases, base_seed, timeout_s=150, gloo_timeout_s=30)
    failures = [f for r in sorted(results) for f in results[r]]
    assert not failures, f"base seed {base_seed}:\n" + "\n".join(failures)

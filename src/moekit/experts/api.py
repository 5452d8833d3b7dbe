"""`fused_experts`: the functional entry point over the experts backends (input checks + oracle)."""

from __future__ import annotations

import dataclasses
from typing import Optional, Union

import torch

from ..activations import check_activation, is_gated
from ..checks import cuda_capturing, host_checks
from ..config import ActivationParams
from .base import ExpertsProblem, ExpertWeights

__all__ = ["fused_experts", "experts_forward", "check_experts_inputs", "problem_of"]

_FLOAT = (torch.float32, torch.bfloat16, torch.float16)


def _tensor(name: str, t) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    return t


def _same_device(name: str, t: torch.Tensor, device: torch.device) -> None:
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device} (the device of hidden_states)")


def check_experts_inputs(
    x: torch.Tensor,
    weights: ExpertWeights,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str,
    expert_map: Optional[torch.Tensor],
) -> None:
    """Raise a ValueError/TypeError naming the argument for any malformed input."""
    _tensor("hidden_states", x)
    if x.dim() != 2:
        raise ValueError(f"hidden_states must be 2-D [T, H], got shape {tuple(x.shape)}")
    if x.dtype not in _FLOAT:
        raise TypeError(f"hidden_states must be float32, bfloat16 or float16, got {x.dtype}")
    check_activation(activation)
    T, H = x.shape
    w13, w2 = _tensor("w13", weights.w13), _tensor("w2", weights.w2)
    if w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"w13 and w2 must be 3-D, got w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)}")
    E, H2, I = w2.shape
    if w13.shape[0] != E:
        raise ValueError(f"w13 and w2 must hold the same number of experts, got w13 {tuple(w13.shape)} "
                         f"and w2 {tuple(w2.shape)}")
    if weights.quant is not None:  # packed storage: moekit.quant checks shapes, dtypes and scales
        from ..quant.layout import check_quantized_weights  # noqa: PLC0415

        I = check_quantized_weights(weights, H, activation)
    elif H2 != H:
        raise ValueError(f"w2 must be [E, H={H}, I], got {tuple(w2.shape)}")
    n13 = 2 * I if is_gated(activation) else I
    if weights.quant is None and tuple(w13.shape) != (E, n13, H):
        kind = "gated" if is_gated(activation) else "non-gated"
        raise ValueError(f"w13 must be [E={E}, {n13}, H={H}] for {kind} activation {activation!r}, got {tuple(w13.shape)}")
    if weights.quant is None and (w13.dtype not in _FLOAT or w2.dtype not in _FLOAT):
        raise TypeError(f"w13 and w2 must be float32, bfloat16 or float16, got {w13.dtype} and {w2.dtype}")
    for name, t in (("w13", w13), ("w2", w2)):
        _same_device(name, t, x.device)
    for name, b in (("b13", weights.b13), ("b2", weights.b2)):
        if b is not None and not _tensor(name, b).is_floating_point():
            raise TypeError(f"{name} must be a float tensor, got {b.dtype}")
    if weights.b13 is not None:
        _same_device("b13", _tensor("b13", weights.b13), x.device)
        if tuple(weights.b13.shape) != (E, n13):
            raise ValueError(f"b13 must be [E={E}, {n13}], got {tuple(weights.b13.shape)}")
    if weights.b2 is not None:
        _same_device("b2", _tensor("b2", weights.b2), x.device)
        if tuple(weights.b2.shape) != (E, H):
            raise ValueError(f"b2 must be [E={E}, H={H}], got {tuple(weights.b2.shape)}")
    _tensor("topk_weights", topk_weights)
    _tensor("topk_ids", topk_ids)
    if topk_ids.dim() != 2 or topk_ids.shape[0] != T or topk_ids.shape[1] < 1:
        raise ValueError(f"topk_ids must be [T={T}, k] with k >= 1, got {tuple(topk_ids.shape)}")
    if tuple(topk_weights.shape) != tuple(topk_ids.shape):
        raise ValueError(f"topk_weights must have the shape of topk_ids {tuple(topk_ids.shape)}, got {tuple(topk_weights.shape)}")
    if topk_ids.is_floating_point() or topk_ids.dtype == torch.bool:
        raise TypeError(f"topk_ids must be an integer tensor (int32), got {topk_ids.dtype}")
    if not topk_weights.is_floating_point():
        raise TypeError(f"topk_weights must be a float tensor (float32), got {topk_weights.dtype}")
    _same_device("topk_ids", topk_ids, x.device)
    _same_device("topk_weights", topk_weights, x.device)
    num_global = E
    if expert_map is not None:
        _tensor("expert_map", expert_map)
        _same_device("expert_map", expert_map, x.device)
        if expert_map.dim() != 1 or expert_map.is_floating_point():
            raise ValueError(f"expert_map must be a 1-D integer tensor [E_global], got {expert_map.dtype} {tuple(expert_map.shape)}")
        num_global = expert_map.shape[0]
        if host_checks(x) and expert_map.numel() and (int(expert_map.min()) < -1 or int(expert_map.max()) >= E):
            raise ValueError(f"expert_map entries must be -1 or a local expert id in [0, {E}), got values outside")
    if host_checks(x) and topk_ids.numel():
        lo, hi = int(topk_ids.min()), int(topk_ids.max())
        if lo < 0 or hi >= num_global:
            raise ValueError(f"topk_ids must lie in [0, {num_global}), got values in [{lo}, {hi}]")


def _intermediate_size(weights: ExpertWeights) -> int:
    if weights.quant is None:
        return weights.w2.shape[2]
    from ..quant.layout import logical_intermediate_size  # noqa: PLC0415 (int4 packs two per byte)

    return logical_intermediate_size(weights)


_DEFAULT_PARAMS = ActivationParams()


def _oracle():
    """moekit.oracle, imported on first use (it imports the experts registry, which imports this)."""
    global _ORACLE
    if _ORACLE is None:
        from .. import oracle  # noqa: PLC0415

        _ORACLE = oracle
    return _ORACLE


_ORACLE = None


def problem_of(
    x: torch.Tensor,
    weights: ExpertWeights,
    top_k: int,
    activation: str,
    apply_router_weight_on_input: bool,
    has_expert_map: bool,
    topk_weights: Optional[torch.Tensor] = None,
) -> ExpertsProblem:
    """The ExpertsProblem of a call; topk_weights (optional) counts towards requires_grad."""
    return ExpertsProblem(
        device=x.device.type,
        dtype=x.dtype,
        weight_dtype=weights.w13.dtype,
        activation=activation,
        has_bias=weights.b13 is not None or weights.b2 is not None,
        has_expert_map=has_expert_map,
        apply_router_weight_on_input=apply_router_weight_on_input,
        num_experts=weights.num_experts,
        hidden_size=x.shape[1],
        intermediate_size=_intermediate_size(weights),
        top_k=top_k,
        quant=weights.quant,
        capturing=cuda_capturing(x),
        static_scales="a13_scale" in weights.scales,
        requires_grad=torch.is_grad_enabled() and (
            x.requires_grad or any(t.requires_grad for _, t in weights.per_expert_tensors())
            or (topk_weights is not None and topk_weights.requires_grad)),
    )


def fused_experts(
    hidden_states: torch.Tensor,
    w13: Union[torch.Tensor, ExpertWeights],
    w2: Optional[torch.Tensor],
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    activation: str = "silu",
    b13: Optional[torch.Tensor] = None,
    b2: Optional[torch.Tensor] = None,
    activation_params: Optional[ActivationParams] = None,
    apply_router_weight_on_input: bool = False,
    expert_map: Optional[torch.Tensor] = None,
    backend: str = "auto",
    owner: str = "fused_experts",
) -> torch.Tensor:
    """Run the routed experts: out[t] = sum_j w[t,j] * expert_{ids[t,j]}(x[t]).

    Args:
        hidden_states: [T, H] fp32/bf16/fp16.
        w13: [E, 2I, H] (gate | up) for gated activations, [E, I, H] otherwise; or an
            ExpertWeights (then w2, b13, b2 must be None / are taken from it).
        w2: [E, H, I].
        topk_weights: [T, k] float (fp32 expected).  topk_ids: [T, k] int32.
        activation: "silu", "gelu", "gelu_tanh", "swigluoai", "swiglu_limit", "swiglustep",
            "silu_no_mul", "gelu_no_mul", "relu2_no_mul".
        b13: [E, 2I] or [E, I] optional.  b2: [E, H] optional.
        activation_params: ActivationParams (swigluoai alpha/limit; swiglu_limit, swiglustep limit).
        apply_router_weight_on_input: multiply the expert input by the weight (Llama-4).
        expert_map: [E_global] int32, global -> local id or -1; topk_ids are then global.
        backend: "auto" (the oracle picks) or a backend name.
        owner: who calls, in the oracle's log of its choice (logged once per owner; a layer
            passes its name).
    Returns:
        [T, H] in hidden_states' dtype.
    """
    if isinstance(w13, ExpertWeights):
        if w2 is not None or b13 is not None or b2 is not None:
            raise ValueError("pass either an ExpertWeights as w13 or the tensors w13, w2, b13, b2, not both")
        weights = w13
    else:
        weights = ExpertWeights(w13=w13, w2=w2, b13=b13, b2=b2)
    if activation_params is not None and not isinstance(activation_params, ActivationParams):
        raise TypeError(f"activation_params must be an ActivationParams, got {type(activation_params).__name__}")
    check_experts_inputs(hidden_states, weights, topk_weights, topk_ids, activation, expert_map)
    out = experts_forward(
        hidden_states, weights, topk_weights, topk_ids, activation=activation,
        activation_params=activation_params, apply_router_weight_on_input=apply_router_weight_on_input,
        expert_map=expert_map, backend=backend, owner=owner, out_dtype=hidden_states.dtype,
    )
    return out.to(hidden_states.dtype)


def experts_forward(
    x: torch.Tensor,
    weights: ExpertWeights,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    activation: str,
    activation_params: Optional[ActivationParams],
    apply_router_weight_on_input: bool,
    expert_map: Optional[torch.Tensor],
    backend: str,
    owner: str,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Checked inputs -> oracle -> backend. Returns [T, H] fp32 (the runner adds shared experts in fp32).

    out_dtype: x's dtype lets a backend that sets `native_out_dtype` write it directly (its
    sum over k still accumulates in fp32), sparing a cast pass; others are cast once.
    """
    if apply_router_weight_on_input and topk_ids.shape[1] != 1:
        raise ValueError(f"apply_router_weight_on_input needs top_k == 1, got top_k={topk_ids.shape[1]}")
    choose_backend = _oracle().choose_backend
    problem = problem_of(x, weights, topk_ids.shape[1], activation,
                         apply_router_weight_on_input, expert_map is not None, topk_weights)
    if _grad_through_routing_only(problem, x, weights, apply_router_weight_on_input):
        # A trainable gate over frozen or quantized experts: the experts themselves need no
        # autograd, only the weighted sum over k does (see _routed_by_slot).
        one = dataclasses.replace(problem, top_k=1, requires_grad=False)
        slot_backend = choose_backend(one, backend, owner=owner).backend
        if _oracle().refusal(slot_backend, problem) is not None:  # it cannot backpropagate itself
            return _routed_by_slot(slot_backend, x, weights, topk_weights, topk_ids, problem, activation=activation,
                                   activation_params=activation_params, expert_map=expert_map, out_dtype=out_dtype)
    chosen = choose_backend(problem, backend, owner=owner).backend
    T, H = x.shape
    if T == 0:
        return _in_graph(x.new_zeros((0, H), dtype=out_dtype), problem, x, weights, topk_weights)
    native = {"out_dtype": out_dtype} if getattr(chosen, "native_out_dtype", False) else {}
    out = chosen.apply(
        x.contiguous(), weights, topk_weights.float().contiguous(),
        topk_ids.to(torch.int32).contiguous(), activation=activation,
        activation_params=activation_params or _DEFAULT_PARAMS,
        apply_router_weight_on_input=apply_router_weight_on_input, expert_map=expert_map, **native,
    ).to(out_dtype)
    return _in_graph(out, problem, x, weights, topk_weights)


def _in_graph(out: torch.Tensor, problem: ExpertsProblem, x: torch.Tensor, weights: ExpertWeights,
              topk_weights: torch.Tensor) -> torch.Tensor:
    """out, joined to the autograd graph of the inputs that require grad when it is not (no tokens,
    or none local): their gradients through it are zeros, instead of backward() failing."""
    if not problem.requires_grad or out.requires_grad:
        return out
    link = sum(t.sum() * 0 for t in (x, topk_weights, *(t for _, t in weights.per_expert_tensors()))
               if t.requires_grad)
    return out + link.to(out.dtype)


def _grad_through_routing_only(problem: ExpertsProblem, x: torch.Tensor, weights: ExpertWeights,
                               on_input: bool) -> bool:
    """Whether gradients reach only the routing weights (not x, not the experts' tensors)."""
    return (problem.requires_grad and not on_input and not x.requires_grad
            and not any(t.requires_grad for _, t in weights.per_expert_tensors()))


def _routed_by_slot(backend, x, weights, topk_weights, topk_ids, problem, *, activation, activation_params,
                    expert_map, out_dtype) -> torch.Tensor:
    """The routed output when gradients flow only into topk_weights [T, k], on a backend without autograd.

    The backend runs without autograd on the T k assignments as rows of one expert each (x's
    row repeated, weight 1), giving each assignment's unweighted output; the weighted sum over
    k is then taken in fp32 by torch, differentiable in topk_weights. The products are the
    call's own; only the order of the sum over k may differ."""
    T, k = topk_ids.shape
    H = x.shape[1]
    if T == 0:
        return _in_graph(x.new_zeros((0, H), dtype=out_dtype), problem, x, weights, topk_weights)
    with torch.no_grad():
        rows = backend.apply(
            x.repeat_interleave(k, 0).contiguous(), weights,
            torch.ones(T * k, 1, dtype=torch.float32, device=x.device),
            topk_ids.reshape(T * k, 1).to(torch.int32).contiguous(), activation=activation,
            activation_params=activation_params or _DEFAULT_PARAMS, apply_router_weight_on_input=False,
            expert_map=expert_map,
        ).float()  # [T k, H]
    return (topk_weights.float().unsqueeze(-1) * rows.view(T, k, H)).sum(1).to(out_dtype)

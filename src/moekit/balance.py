"""Routing-level load balancing for training: auxiliary losses and the aux-loss-free bias update.

Letters: T tokens, E experts, k experts per token, L layers, B sequences of S tokens (T = B*S).

- `load_balancing_loss`: Switch Transformer / Mixtral loss, E * sum_e f_e * P_e with f_e the
  top-k assignments of expert e per token and P_e its mean router probability; the same
  value as transformers' `load_balancing_loss_func`.
- `router_z_loss`: ST-MoE z-loss, the mean squared log-sum-exp of the logits.
- `sequence_balance_loss`: DeepSeek-V3's sequence-wise balance loss.
- `update_correction_bias`: DeepSeek-V3's auxiliary-loss-free balancing, the selection bias
  moves by gamma towards the under-loaded experts after each step.

Gradients flow through the probabilities / scores only; the top-k choice and the counts are
piecewise constant. All sums run in fp32 (fp64 for fp64 inputs) with tensor ops only (no
host synchronisation), so every function can run inside a captured or compiled training
step. Where no token counts (T = 0 or an all-zero mask) the losses are 0, not NaN.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Union

import torch

from .routing.select import stable_topk

__all__ = [
    "load_balancing_loss",
    "router_z_loss",
    "sequence_balance_loss",
    "expert_counts",
    "update_correction_bias",
]

Logits = Union[torch.Tensor, Sequence[torch.Tensor]]


def _as_layers(router_logits: Logits) -> List[torch.Tensor]:
    """One [T, E] tensor, or a tuple/list of them (one per layer) -> list of [T_l, E] tensors."""
    layers = [router_logits] if isinstance(router_logits, torch.Tensor) else router_logits
    if not isinstance(layers, (list, tuple)) or len(layers) == 0:
        got = "an empty sequence" if isinstance(layers, (list, tuple)) else type(router_logits).__name__
        raise TypeError(
            f"router_logits must be a [T, E] tensor or a non-empty tuple/list of them (one per layer), got {got}")
    E = None
    for i, z in enumerate(layers):
        if not isinstance(z, torch.Tensor):
            raise TypeError(f"router_logits[{i}] must be a torch.Tensor, got {type(z).__name__}")
        if z.dim() != 2 or not z.is_floating_point():
            raise ValueError(f"router_logits[{i}] must be a 2-D float tensor [T, E], got {z.dtype} {tuple(z.shape)}")
        E = z.shape[1] if E is None else E
        if z.shape[1] != E:
            raise ValueError(f"every layer's router_logits must have E={E} columns, got {z.shape[1]} in layer {i}")
    return list(layers)


def _acc_dtype(t: torch.Tensor) -> torch.dtype:
    """The accumulation dtype: fp32, or fp64 for fp64 inputs (exact enough for gradcheck)."""
    return torch.promote_types(t.dtype, torch.float32)


def _row_weights(attention_mask: Optional[torch.Tensor], T: int, device: torch.device,
                 dtype: torch.dtype) -> Optional[torch.Tensor]:
    """attention_mask [B, S] (B*S = T; 1 = real token, 0 = padding) -> [T] in dtype, or None."""
    if attention_mask is None:
        return None
    if not isinstance(attention_mask, torch.Tensor):
        raise TypeError(f"attention_mask must be a torch.Tensor, got {type(attention_mask).__name__}")
    if attention_mask.numel() != T:
        raise ValueError(
            f"attention_mask must have one entry per token row (T={T}), got shape {tuple(attention_mask.shape)}")
    return attention_mask.reshape(-1).to(device=device, dtype=dtype)


def _nonzero(d: torch.Tensor) -> torch.Tensor:
    """d where d != 0, else 1: the numerators are 0 there, so the quotient is 0, not NaN."""
    return torch.where(d != 0, d, torch.ones_like(d))


def _float_tensor(name: str, t, shape: str, dim: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor {shape}, got {type(t).__name__}")
    if not t.is_floating_point():
        raise TypeError(f"{name} must be a float tensor {shape}, got {t.dtype}")
    if t.dim() != dim:
        raise ValueError(f"{name} must be {dim}-D {shape}, got shape {tuple(t.shape)}")


def _check_ids(name: str, ids: torch.Tensor, T: Optional[int], num_experts: int) -> None:
    if not isinstance(ids, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(ids).__name__}")
    if ids.dim() != 2 or (T is not None and ids.shape[0] != T):
        rows = "T" if T is None else f"T={T}"
        raise ValueError(f"{name} must be [{rows}, k], got shape {tuple(ids.shape)}")
    if ids.is_floating_point() or ids.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor, got {ids.dtype}")
    # Range check only where reading values costs no device synchronisation.
    if ids.device.type == "cpu" and ids.numel():
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= num_experts:
            raise ValueError(f"{name} must lie in [0, {num_experts}), got values in [{lo}, {hi}]")


def _check_top_k(top_k, num_experts: int) -> None:
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be an int in [1, E={num_experts}], got {top_k!r}")


def load_balancing_loss(
    router_logits: Logits,
    top_k: int,
    num_experts: Optional[int] = None,
    attention_mask: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Switch/Mixtral load-balancing loss, E * sum_e (count_e / N) * (sum of p_e / N).

    p = softmax(logits) in fp32 (fp64 for fp64 logits), count_e = top-k assignments to e
    (ties to the lower expert index), N = counted token rows over all layers. Perfectly
    uniform routing gives k. Equals transformers' `load_balancing_loss_func(router_logits,
    E, top_k, attention_mask)`, which computes the softmax in the logits' dtype (so bf16
    logits differ by bf16 rounding).

    Args:
        router_logits: [T, E] or a tuple/list of per-layer [T_l, E] (any float dtype).
        top_k: k, in [1, E].
        num_experts: E; None takes it from the logits, otherwise it must equal their width.
        attention_mask: [B, S] with B*S = T (every layer then needs the same T); 1 marks
            real tokens, 0 padding; other values weight the rows.
    Returns:
        [] fp32 (fp64) scalar; differentiable w.r.t. the logits through p.
    """
    layers = _as_layers(router_logits)
    E = layers[0].shape[1]
    if num_experts is not None and num_experts != E:
        raise ValueError(f"num_experts must equal the logits' width E={E}, got {num_experts}")
    _check_top_k(top_k, E)
    device, acc = layers[0].device, _acc_dtype(layers[0])
    counts = torch.zeros(E, dtype=acc, device=device)  # [E] assignments
    prob_sum = torch.zeros(E, dtype=acc, device=device)  # [E] sum of p over rows
    rows = torch.zeros((), dtype=acc, device=device)
    for z in layers:
        T = z.shape[0]
        m = _row_weights(attention_mask, T, device, acc)  # [T] or None
        p = torch.softmax(z.to(device=device, dtype=acc), dim=-1)  # [T, E]
        ids = stable_topk(p, top_k)  # [T, k]
        m_T = torch.ones(T, dtype=acc, device=device) if m is None else m  # [T]
        counts = counts.scatter_add(0, ids.reshape(-1), m_T.repeat_interleave(top_k))
        prob_sum = prob_sum + (p * m_T.unsqueeze(-1)).sum(dim=0)
        rows = rows + m_T.sum()
    rows = _nonzero(rows)
    return E * torch.sum((counts / rows) * (prob_sum / rows))


def router_z_loss(router_logits: Logits, attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """ST-MoE router z-loss: mean over token rows of logsumexp(logits)^2, in fp32 (fp64 for fp64).

    Args:
        router_logits: [T, E] or a tuple/list of per-layer [T_l, E]; rows of all layers
            are averaged together.
        attention_mask: [B, S] with B*S = T for every layer; 0 excludes a padding row.
    Returns:
        [] fp32 (fp64) scalar.
    """
    layers = _as_layers(router_logits)
    device, acc = layers[0].device, _acc_dtype(layers[0])
    total = torch.zeros((), dtype=acc, device=device)
    rows = torch.zeros((), dtype=acc, device=device)
    for z in layers:
        m = _row_weights(attention_mask, z.shape[0], device, acc)  # [T] or None
        lse2 = torch.logsumexp(z.to(device=device, dtype=acc), dim=-1).square()  # [T]
        total = total + (lse2.sum() if m is None else (lse2 * m).sum())
        rows = rows + (z.shape[0] if m is None else m.sum())
    return total / _nonzero(rows)


def sequence_balance_loss(
    scores: torch.Tensor,
    topk_ids: torch.Tensor,
    seq_len: int,
    alpha: float = 1e-4,
    attention_mask: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """DeepSeek-V3 sequence-wise balance loss, averaged over the B sequences of the batch.

    Per sequence of n real tokens: f_e = E / (k n) * count_e (its selections of e),
    s' = s / (sum_e s + 1e-20) per token, P_e = mean over its tokens of s'_e, and
    loss = alpha * sum_e f_e P_e (alpha at perfectly balanced routing). Sequences without
    a real token are left out of the mean.

    Args:
        scores: [T, E] affinity scores s over all experts (sigmoid or softmax of the logits,
            without the correction bias); T = B * seq_len, sequences contiguous.
        topk_ids: [T, k] int experts selected for each token (as routed, bias included).
        seq_len: S, tokens per sequence (>= 1, divides T).
        alpha: the balance factor (DeepSeek-V3 uses 1e-4).
        attention_mask: [B, S]; 0 marks padding tokens, which count nowhere.
    Returns:
        [] fp32 (fp64) scalar; differentiable w.r.t. scores.
    """
    _float_tensor("scores", scores, "[T, E]", 2)
    T, E = scores.shape
    _check_ids("topk_ids", topk_ids, T, E)
    k = topk_ids.shape[1]
    _check_top_k(k, E)
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1 or T % seq_len:
        raise ValueError(f"seq_len must be an int >= 1 dividing T={T}, got {seq_len!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not alpha >= 0:
        raise ValueError(f"alpha must be a number >= 0, got {alpha!r}")
    if topk_ids.device != scores.device:
        raise ValueError(f"topk_ids is on {topk_ids.device}, expected {scores.device} (the device of scores)")
    B, S = T // seq_len, seq_len
    acc = _acc_dtype(scores)
    m = _row_weights(attention_mask, T, scores.device, acc)
    m_BS = scores.new_ones((B, S), dtype=acc) if m is None else m.view(B, S)
    n_B = _nonzero(m_BS.sum(dim=1))  # [B] real tokens per sequence
    s = scores.to(acc)  # [T, E]
    s_norm = s / (s.sum(dim=-1, keepdim=True) + 1e-20)  # [T, E]
    P_BE = (s_norm.view(B, S, E) * m_BS.unsqueeze(-1)).sum(dim=1) / n_B.unsqueeze(-1)  # [B, E]
    ones_BSk = m_BS.unsqueeze(-1).expand(B, S, k).reshape(B, S * k)
    count_BE = s.new_zeros((B, E)).scatter_add(1, topk_ids.long().view(B, S * k), ones_BSk)  # [B, E]
    f_BE = count_BE * (E / k) / n_B.unsqueeze(-1)  # [B, E]
    per_seq = (f_BE * P_BE).sum(dim=1)  # [B]
    real = (m_BS.sum(dim=1) != 0).to(acc)  # [B]
    return alpha * (per_seq * real).sum() / _nonzero(real.sum())


def expert_counts(
    topk_ids: torch.Tensor, num_experts: int, attention_mask: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """Assignments per expert, without a host synchronisation (no bincount).

    Args:
        topk_ids: [T, k] int expert ids in [0, E).
        num_experts: E.
        attention_mask: [B, S] bool or 0/1 integer with B*S = T; 0 rows are not counted.
    Returns:
        [E] int64 on topk_ids' device.
    """
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts must be an int >= 1, got {num_experts!r}")
    _check_ids("topk_ids", topk_ids, None, num_experts)
    T, k = topk_ids.shape
    ones = torch.ones((T, k), dtype=torch.int64, device=topk_ids.device)
    if attention_mask is not None:
        if not isinstance(attention_mask, torch.Tensor) or attention_mask.is_floating_point():
            raise TypeError("attention_mask must be a bool or integer (0/1) tensor for counting, got "
                            f"{getattr(attention_mask, 'dtype', type(attention_mask).__name__)}")
        if attention_mask.numel() != T:
            raise ValueError(f"attention_mask must have T={T} entries, got shape {tuple(attention_mask.shape)}")
        ones = ones * attention_mask.reshape(T, 1).to(device=topk_ids.device, dtype=torch.int64)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=topk_ids.device)
    return counts.scatter_add_(0, topk_ids.reshape(-1).long(), ones.reshape(-1))


def update_correction_bias(bias: torch.Tensor, load: torch.Tensor, gamma: float = 1e-3) -> torch.Tensor:
    """Aux-loss-free balancing step (DeepSeek-V3): bias_e += gamma * sign(mean load - load_e).

    In place, on the bias' device, without a host synchronisation; experts at exactly the
    mean load keep their bias. Call it after each optimiser step, outside autograd.

    Args:
        bias: [E] float, the router's selection-only correction bias (e.g. FusedMoE's
            e_score_correction_bias buffer).
        load: either the step's routing ids [T, k] (integer, as returned by `route`) or
            per-expert counts [E] (integer or float), e.g. an EPLB recorder's window summed
            over steps and mapped to logical experts with `eplb.physical_to_logical_load`.
            A 2-D tensor is read as ids, a 1-D one as counts.
        gamma: the bias update speed (finite, > 0; DeepSeek-V3 uses 1e-3).
    Returns:
        bias (the same tensor, updated).
    """
    _float_tensor("bias", bias, "[E]", 1)
    if isinstance(gamma, bool) or not isinstance(gamma, (int, float)) or not 0 < gamma < float("inf"):
        raise ValueError(f"gamma must be a finite number > 0, got {gamma!r}")
    E = bias.shape[0]
    if not isinstance(load, torch.Tensor):
        raise TypeError(f"load must be a torch.Tensor (ids [T, k] or counts [E]), got {type(load).__name__}")
    if load.device != bias.device:
        raise ValueError(f"load is on {load.device}, expected {bias.device} (the device of bias)")
    if load.dim() == 2:
        counts = expert_counts(load, E)
    elif load.dim() == 1:
        if load.shape[0] != E or load.dtype == torch.bool:
            raise ValueError(f"load as counts must be a numeric [E={E}] tensor, got {load.dtype} {tuple(load.shape)}")
        # A NaN count makes the mean NaN and sign(NaN) is 0: no bias would move. Checked where
        # reading values costs no device synchronisation (as _check_ids).
        if load.device.type == "cpu" and not bool(((load >= 0) & (load < float("inf"))).all()):
            raise ValueError("load as counts must be finite and >= 0, got a NaN, inf or negative entry")
        counts = load
    else:
        raise ValueError(f"load must be ids [T, k] or counts [E={E}], got shape {tuple(load.shape)}")
    with torch.no_grad():
        c = counts.to(torch.float32)  # [E]
        bias.add_(torch.sign(c.mean() - c).to(bias.dtype), alpha=gamma)
    return bias

"""Small pure tensor helpers shared by the experts backends."""

from __future__ import annotations

from typing import List, NamedTuple, Optional, Tuple

import torch

from .. import native
from .base import cached_for, version_of
from ..activations import apply_activation, is_gated
from ..config import ActivationParams

__all__ = ["local_ids", "sort_by_expert", "weighted_combine", "SortedRows", "sort_rows", "unsort_rows", "add_bias_by_span",
           "span_segments", "token_slots", "decode_by_token"]


def local_ids(topk_ids: torch.Tensor, expert_map: Optional[torch.Tensor]) -> torch.Tensor:
    """Map ids [T, k] to local expert ids (int64); -1 where the expert lives elsewhere."""
    ids = topk_ids.long()
    if expert_map is None:
        return ids
    return expert_map.long()[ids]


def sort_by_expert(ids_flat: torch.Tensor, num_experts: int):
    """Stable sort of flattened assignments by local expert (non-local -1 ids go last).

    Args:
        ids_flat: [T*k] int64 local ids, -1 for non-local.
    Returns:
        order [T*k] int64 (assignment index of each sorted row), counts [E] int64.
    """
    key = torch.where(ids_flat < 0, torch.full_like(ids_flat, num_experts), ids_flat)
    key_sorted, order = torch.sort(key, stable=True)
    # Counts from the sorted keys: bincount would read the maximum back to the host (a sync
    # that breaks CUDA-graph capture).
    bounds = torch.arange(num_experts + 1, device=key.device, dtype=key.dtype)
    counts = torch.diff(torch.searchsorted(key_sorted, bounds))
    return order, counts


def weighted_combine(
    y_sorted: torch.Tensor, w_sorted: Optional[torch.Tensor], order: torch.Tensor, T: int, k: int
) -> torch.Tensor:
    """Bring sorted per-assignment rows home and take the weighted sum over k, in fp32.

    Deterministic (no atomics): rows and weights are gathered into their assignment slot
    t*k + j through the inverse permutation, in their own dtype (half the bytes for bf16; a
    gather runs about 4x faster than the scatter by `order` on CPU), then one batched
    [1, k] x [k, H] product per token sums them in fp32 in a fixed order.

    Args:
        y_sorted: [T*k, H] expert outputs in sorted order (rows of non-local experts zero).
        w_sorted: [T*k, 1] fp32 routing weights in sorted order, or None for an unweighted sum.
        order: [T*k] assignment index of each sorted row.
    Returns:
        [T, H] fp32.
    """
    H = y_sorted.shape[-1]
    slot_of = torch.empty_like(order)  # sorted position of each assignment t*k + j
    slot_of[order] = torch.arange(order.numel(), device=order.device, dtype=order.dtype)
    y_TkH = y_sorted.index_select(0, slot_of).view(T, k, H).float()
    if w_sorted is None:
        return y_TkH.sum(dim=1)
    w_flat = w_sorted.float().index_select(0, slot_of)
    return torch.bmm(w_flat.view(T, 1, k), y_TkH).view(T, H)


class SortedRows(NamedTuple):
    """Assignments sorted by local expert, for host-driven (CPU) backends.

    rows: [n, H] the GEMM1 input of each local assignment, grouped by expert.
    spans: (e, start, end) per expert with rows, in order; rows[start:end] belong to e.
    order: [T*k] assignment index of each sorted position.  w_sorted: [T*k, 1] fp32.
    """

    rows: torch.Tensor
    spans: List[Tuple[int, int, int]]
    order: torch.Tensor
    w_sorted: torch.Tensor


def sort_rows(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_map: Optional[torch.Tensor],
    num_experts: int,
    apply_router_weight_on_input: bool,
    row_dtype: torch.dtype,
) -> SortedRows:
    """Gather each local assignment's input row, grouped by expert (reads the counts to the host once).

    Args:
        x: [T, H].  topk_weights: [T, k] fp32.  topk_ids: [T, k] int32.
        expert_map: [E_global] int32 or None.
        row_dtype: dtype of the rows (router weights on the input are applied in fp32 first).
    """
    k = topk_ids.shape[1]
    order, counts = sort_by_expert(local_ids(topk_ids, expert_map).reshape(-1), num_experts)
    spans, start = [], 0
    for e, n in enumerate(counts.tolist()):
        if n:
            spans.append((e, start, start + n))
            start += n
    w_sorted = topk_weights.reshape(-1)[order].float().unsqueeze(-1)  # [T*k, 1]
    rows = x[order[:start] // k]  # [n, H]
    if apply_router_weight_on_input:
        rows = rows.float() * w_sorted[:start]
    return SortedRows(rows.to(row_dtype), spans, order, w_sorted)


def unsort_rows(y: torch.Tensor, sr: SortedRows, T: int, k: int, apply_router_weight_on_input: bool) -> torch.Tensor:
    """Expert outputs y [n, H] fp32 (in sort_rows' order; or [T*k, H] with zero rows past the n
    local ones) -> weighted, summed over k: [T, H] fp32."""
    y_sorted = y
    if y.shape[0] != T * k:
        y_sorted = y.new_zeros((T * k, y.shape[1]))  # rows >= n stay zero (non-local experts)
        y_sorted[:y.shape[0]] = y
    return weighted_combine(y_sorted, None if apply_router_weight_on_input else sr.w_sorted, sr.order, T, k)


def span_segments(spans):
    """(experts [S] int64, starts [S + 1] int64) of sort_rows' spans: the native kernels' segments."""
    experts = torch.tensor([e for e, _, _ in spans], dtype=torch.long)
    starts = torch.tensor([0] + [b for _, _, b in spans], dtype=torch.long)
    return experts, starts


def add_bias_by_span(h: torch.Tensor, bias: Optional[torch.Tensor], spans) -> torch.Tensor:
    """Add bias[e] (fp32) in place to the rows h[a:b] of each (e, a, b) in `spans`; returns h."""
    if bias is not None:
        for e, a, b in spans:
            h[a:b].add_(bias[e].float())
    return h


def token_slots(topk_weights: torch.Tensor, topk_ids: torch.Tensor, expert_map: Optional[torch.Tensor]):
    """For host-driven decode paths: (t, experts, experts as int64 [n], slot weights fp32 [n]) for
    each token t with n >= 1 local slots, in slot order (slots of other ranks' experts left out)."""
    for t, row in enumerate(local_ids(topk_ids, expert_map).tolist()):
        if min(row) >= 0:  # every slot local (always without an expert map): no gather
            yield t, row, torch.tensor(row, dtype=torch.long), topk_weights[t].float()
            continue
        slots = [j for j, e in enumerate(row) if e >= 0]
        if slots:
            experts = [row[j] for j in slots]
            yield t, experts, torch.tensor(experts, dtype=torch.long), topk_weights[t, slots].float()


def native_decode(lib, weights, kind: str, group_size: int = 0):
    """decode_by_token's `fused` for these weights: (lib, w13's and w2's native.Projection of
    `kind` with scales and zero points from weights.scales, the biases as fp32 tables or None).

    Built once while the weights live (base.cached_for), again when the library, kind, group
    size, any of the tensors or where their data lies (a projection holds their addresses)
    differs.
    """
    s = weights.scales
    tensors = (weights.w13, weights.w2, weights.b13, weights.b2, *(s.get(n) for n in _PROJECTION_SCALES))
    key = (lib, kind, group_size, *tensors, *(0 if t is None else t.data_ptr() for t in tensors),
           *(0 if b is None else version_of(b) for b in (weights.b13, weights.b2)))  # fp32 copies of biases go stale

    def build():
        projections = (native.projection(getattr(weights, name), kind, scale=s.get(f"{name}_scale"),
                                         zero=s.get(f"{name}_zero"), group_size=group_size) for name in ("w13", "w2"))
        return (lib, *projections, fp32_bias(weights.b13), fp32_bias(weights.b2))

    return cached_for(weights, "native_decode", key, build)


_PROJECTION_SCALES = ("w13_scale", "w13_zero", "w2_scale", "w2_zero")


def fp32_bias(b: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """A bias table as the native kernels take it: fp32, contiguous (b itself where it is), or None."""
    return None if b is None else b.detach().float().contiguous()


def decode_by_token(products, gemm_dtype, x, weights, topk_weights, topk_ids, activation, activation_params,
                    on_input, expert_map, fused=None) -> torch.Tensor:
    """Decode path of the host-driven backends, token by token, no sort: [T, H] fp32.

    A token's products over its n local slots fill one [n, N] buffer per GEMM
    (`products(name, rows, experts, expert ids [n] int64, out)`: rows [1 or n, K] in gemm_dtype,
    out [n, N] gemm_dtype, returns out), then its biases and activation run over all n slots
    at once. The weighted sum over the slots in slot order (deterministic). With `fused`
    (`native_decode`'s, gemm_dtype fp32) every token's whole FFN instead runs in one native
    call (NativeLibrary.decode): the same products, the activation as torch's kernels write
    it (up to the last bits of exp, erf, tanh: silu and swigluoai run on a vector exp within
    2e-7 of expf where the build has AVX-512), the same sum order.
    """
    H, N1 = weights.w2.shape[1], weights.w13.shape[1]
    if fused is not None and min(H, N1, weights.w2.shape[2], topk_ids.shape[1]) > 0:
        lib, p13, p2, b13, b2 = fused
        params = activation_params or ActivationParams()
        out = x.new_empty((topk_ids.shape[0], H), dtype=torch.float32)
        return lib.decode(p13, p2, topk_ids.contiguous(), topk_weights.float().contiguous(), x.float().contiguous(),
                          out, activation=activation, alpha=params.alpha, limit=params.limit, on_input=on_input,
                          expert_map=None if expert_map is None else expert_map.contiguous(), b13=b13, b2=b2,
                          trusted=True)
    out = x.new_zeros((topk_ids.shape[0], H), dtype=torch.float32)
    for t, es, e_idx, w_t in token_slots(topk_weights, topk_ids, expert_map):
        n = len(es)
        rows = (x[t:t + 1].float() * w_t[:, None]).to(gemm_dtype) if on_input else x[t:t + 1].to(gemm_dtype)
        h = products("w13", rows, es, e_idx, torch.empty((n, N1), dtype=gemm_dtype)).float()  # [n, 2I]
        if weights.b13 is not None:
            h += weights.b13.index_select(0, e_idx).float()
        a = apply_activation(h, activation, activation_params).to(gemm_dtype).contiguous()  # [n, I]
        y = products("w2", a, es, e_idx, torch.empty((n, H), dtype=gemm_dtype)).float()  # [n, H]
        if weights.b2 is not None:
            y += weights.b2.index_select(0, e_idx).float()
        if on_input:
            torch.sum(y, dim=0, keepdim=True, out=out[t:t + 1])
        else:
            torch.mm(w_t.view(1, n), y, out=out[t:t + 1])
    return out


def bf16_sorted(lib, sr: SortedRows, weights, T: int, k: int, activation: str,
                activation_params: Optional[ActivationParams], on_input: bool, scheme=None) -> torch.Tensor:
    """Sorted bf16 rows through moekit's vdpbf16ps kernels (NativeLibrary.bf16_gate_up /
    bf16_gemm): a gated GEMM1 with its biases and activation in one call, its output rounded to
    bf16 for GEMM2 (as torch's bf16 path rounds it), fp32 sums; [T, H] fp32 like unsort_rows.
    bf16 weights, or with `scheme` (a weight-only QuantScheme) the stored weights, dequantized
    to bf16 a block at a time in the kernels."""
    experts, starts = span_segments(sr.spans)
    gated = is_gated(activation)
    n, s = sr.rows.shape[0], weights.scales
    I = weights.w13.shape[1] // 2 if gated else weights.w13.shape[1]  # (w2's rows may be packed)
    quant = {} if scheme is None else dict(int4=scheme.weight_dtype == "int4", group_size=scheme.group_size)

    def of(name):
        return {} if scheme is None else dict(scale=s[f"{name}_scale"], zero=s.get(f"{name}_zero"), **quant)

    if gated:
        params = activation_params or ActivationParams()
        b13 = cached_for(weights, "bf16_sorted b13", (weights.b13, 0 if weights.b13 is None else version_of(weights.b13)),
                         lambda: fp32_bias(weights.b13))  # (the fp32 copy goes stale on an in-place write)
        a = lib.bf16_gate_up(weights.w13, experts, sr.rows, sr.rows.new_empty((n, I)), starts, activation=activation,
                             alpha=params.alpha, limit=params.limit, b13=b13, trusted=True, **of("w13"))
    else:
        h = lib.bf16_gemm(weights.w13, experts, sr.rows, sr.rows.new_empty((n, I), dtype=torch.float32), starts,
                          trusted=True, **of("w13"))
        a = apply_activation(add_bias_by_span(h, weights.b13, sr.spans), activation,
                             activation_params).to(torch.bfloat16)
    y = lib.bf16_gemm(weights.w2, experts, a, a.new_empty((n, weights.w2.shape[1]), dtype=torch.float32), starts,
                      trusted=True, **of("w2"))
    return unsort_rows(add_bias_by_span(y, weights.b2, sr.spans), sr, T, k, on_input)

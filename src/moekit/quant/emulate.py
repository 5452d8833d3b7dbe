"""Reference emulation of every quantization scheme: dequantize, then a per-expert fp32 loop.

This is what the `reference` backend runs for quantized weights, and the ground truth the
quantized backends are tested against. Weights are dequantized exactly (q * scale, minus
zero points). For w8a8 schemes every GEMM input is quantized and dequantized first, as
the scheme defines:

- "token": one dynamic scale per GEMM input row (a token for GEMM1, an assignment (t, j)
  for GEMM2);
- "group": one dynamic scale per row and 1 x activation_group columns;
- "tensor": the static per-expert scale (scales["a13_scale"][e], ["a2_scale"][e]) when the
  weights carry one, else one dynamic scale over all GEMM input rows of the call that reach
  a local expert (GEMM2: over every assignment's activated intermediate row).

fp8 has no CPU GEMM in torch; fp8 problems on CPU run here.
"""

from __future__ import annotations

from typing import List, Optional

import torch

from ..activations import apply_activation
from ..config import ActivationParams
from ..experts.base import ExpertWeights
from ..experts.common import local_ids
from .layout import scheme_of
from .quantize import dequantize_weight, fake_quantize_activation
from .schemes import QuantScheme

__all__ = ["emulated_experts", "dequantize_expert", "TOLERANCE"]

# PERF.md: relative error ||out - ref|| / ||ref|| a quantized backend may have against this
# emulation, per precision (the oracle's keys).
TOLERANCE = {"fp8": 3.5e-2, "int8": 6.5e-2, "int8_w8a16": 2e-2, "int4_w4a16": 2e-2}


def dequantize_expert(weights: ExpertWeights, e: int, scheme: QuantScheme):
    """Expert e's weights as fp32: (w13 [2I or I, H], w2 [H, I])."""
    out = []
    for name in ("w13", "w2"):
        zero = weights.scales.get(f"{name}_zero")
        out.append(dequantize_weight(
            getattr(weights, name)[e:e + 1], weights.scales[f"{name}_scale"][e:e + 1],
            None if zero is None else zero[e:e + 1], scheme)[0])
    return out[0], out[1]


def _fake_quant_rows(rows: List[torch.Tensor], scheme: QuantScheme,
                     static: Optional[torch.Tensor]) -> List[torch.Tensor]:
    """Quantize-dequantize each expert's GEMM input rows [n_e, K] per the scheme."""
    if scheme.weight_only:
        return rows
    if static is not None:
        return [fake_quantize_activation(r, scheme, static[e]) for e, r in enumerate(rows)]
    if scheme.activation_granularity == "tensor":
        # One dynamic scale over every row of the call: quantize them together.
        sizes = [r.shape[0] for r in rows]
        fq = fake_quantize_activation(torch.cat(rows), scheme)
        return list(fq.split(sizes))
    return [fake_quantize_activation(r, scheme) for r in rows]


def emulated_experts(
    x: torch.Tensor,
    weights: ExpertWeights,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    activation: str = "silu",
    activation_params: Optional[ActivationParams] = None,
    apply_router_weight_on_input: bool = False,
    expert_map: Optional[torch.Tensor] = None,
    act_dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """Routed output [T, H] fp32 of quantized experts, emulated in fp32.

    Args:
        x: [T, H] float.  weights: quantized ExpertWeights (quant set).
        topk_weights: [T, k] fp32.  topk_ids: [T, k] int32.  expert_map: [E_global] int32 or None.
        act_dtype: the dtype GEMM1's activation is stored in before GEMM2's input is quantized
            (a kernel that stores it in x's dtype rounds it there first); None keeps fp32. A
            value next to a quantization step can land on either side of it depending on that
            rounding, one step apart, which on a small problem moves the output by several
            percent; emulating the kernel's rounding compares like with like.
    """
    scheme = scheme_of(weights)
    T, H = x.shape
    E = weights.num_experts
    ids_Tk = local_ids(topk_ids, expert_map)
    # Step 1: every expert's assignments and GEMM1 input rows.
    assign, rows = [], []
    for e in range(E):
        t, j = (ids_Tk == e).nonzero(as_tuple=True)
        x_e = x[t].float()  # [n_e, H]
        w_e = topk_weights[t, j].float().unsqueeze(-1)  # [n_e, 1]
        if apply_router_weight_on_input:
            x_e = x_e * w_e
        assign.append((t, w_e))
        rows.append(x_e)
    # Step 2: GEMM1 and the activation, on the quantized-dequantized inputs.
    rows = _fake_quant_rows(rows, scheme, weights.scales.get("a13_scale"))
    deq = [dequantize_expert(weights, e, scheme) if rows[e].shape[0] else None for e in range(E)]
    acts = []
    for e in range(E):
        if deq[e] is None:
            acts.append(rows[e].new_zeros((0, weights.w2.shape[2] * scheme.pack)))
            continue
        h = rows[e] @ deq[e][0].t()  # [n_e, 2I]
        if weights.b13 is not None:
            h = h + weights.b13[e].float()
        acts.append(apply_activation(h, activation, activation_params))  # [n_e, I]
    # Step 3: GEMM2 on the quantized-dequantized activations, weight, sum.
    if act_dtype is not None:
        acts = [a.to(act_dtype).float() for a in acts]
    acts = _fake_quant_rows(acts, scheme, weights.scales.get("a2_scale"))
    out = x.new_zeros((T, H), dtype=torch.float32)
    for e in range(E):
        if deq[e] is None:
            continue
        y = acts[e] @ deq[e][1].t()  # [n_e, H]
        if weights.b2 is not None:
            y = y + weights.b2[e].float()
        t, w_e = assign[e]
        if not apply_router_weight_on_input:
            y = y * w_e
        out = out.index_add(0, t, y)
    return out

"""Top-k selection primitives: deterministic (ties go to the lowest expert index).

torch.topk leaves the order of equal values unspecified, so selection uses a stable
descending sort: among equal scores the lower expert index comes first. This matters in
bf16, where random logits tie often.
"""

from __future__ import annotations

import torch

__all__ = ["stable_topk", "group_mask", "renormalize"]


def stable_topk(c: torch.Tensor, k: int) -> torch.Tensor:
    """Indices [T, k] (int64) of the k largest entries of c [T, N], lowest index first on ties."""
    return torch.sort(c, dim=-1, descending=True, stable=True).indices[:, :k]


def group_mask(c: torch.Tensor, num_groups: int, topk_group: int, group_score: str) -> torch.Tensor:
    """Mask c [T, E] to the topk_group best of num_groups contiguous expert groups.

    Group score: "top2_sum" = sum of the two largest entries of the group (DeepSeek-V3),
    "max" = the largest entry (DeepSeek-V2). Entries outside the kept groups become -inf.
    An -inf entry (an expert never picked) adds nothing in second place: a group whose
    only pickable expert is strong still competes with its score alone.
    Returns [T, E] fp32.
    """
    T, E = c.shape
    c_TGn = c.view(T, num_groups, E // num_groups)
    if group_score == "top2_sum":
        top_TGn = c_TGn.topk(min(2, E // num_groups), dim=-1).values
        g_TG = top_TGn[..., 0]
        if top_TGn.shape[-1] == 2:
            second_TG = top_TGn[..., 1]
            g_TG = g_TG + second_TG.masked_fill(second_TG == float("-inf"), 0.0)
    else:
        g_TG = c_TGn.amax(dim=-1)
    keep_Tg = stable_topk(g_TG, topk_group)
    drop_TG = torch.ones_like(g_TG, dtype=torch.bool).scatter_(1, keep_Tg, False)
    return c_TGn.masked_fill(drop_TG.unsqueeze(-1), float("-inf")).view(T, E)  # the mask broadcasts over n


def renormalize(w: torch.Tensor, eps: float = 0.0, clamp: bool = False) -> torch.Tensor:
    """w / sum(w) over the last dim; eps is added to (or, with clamp, a floor of) the sum."""
    denom = w.sum(dim=-1, keepdim=True)
    if clamp:
        denom = denom.clamp_min(eps)
    elif eps:
        denom = denom + eps
    return w / denom

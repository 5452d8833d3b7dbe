"""Routing: logits [T, E] -> TopK(weights [T, k] fp32, ids [T, k] int32). See ROUTING.md."""

from .router import TopK, check_router_logits, route
from .scoring import SCORE_FNS, score
from .select import group_mask, renormalize, stable_topk

__all__ = ["TopK", "route", "check_router_logits", "SCORE_FNS", "score", "group_mask", "renormalize", "stable_topk"]

"""Scoring functions: logits z [T, E] fp32 -> scores p [T, E] fp32."""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["SCORE_FNS", "score"]


def _softmax(z: torch.Tensor) -> torch.Tensor:
    return torch.softmax(z, dim=-1)


def _sigmoid(z: torch.Tensor) -> torch.Tensor:
    return torch.sigmoid(z)


def _sqrtsoftplus(z: torch.Tensor) -> torch.Tensor:
    return torch.sqrt(F.softplus(z))


SCORE_FNS = {"softmax": _softmax, "sigmoid": _sigmoid, "sqrtsoftplus": _sqrtsoftplus}


def score(z: torch.Tensor, scoring: str) -> torch.Tensor:
    """p = scoring(z) for z [T, E] fp32."""
    return SCORE_FNS[scoring](z)

"""Argument checks shared by the modules that load weights (errors name the argument)."""

from __future__ import annotations

import torch

__all__ = ["check_float_tensor"]


def check_float_tensor(name: str, t, shape) -> None:
    """Raise TypeError/ValueError unless `t` is a float tensor of exactly `shape`."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {list(shape)}, got {list(t.shape)}")
    if not t.is_floating_point():
        raise TypeError(f"{name} must be a float tensor, got {t.dtype}")

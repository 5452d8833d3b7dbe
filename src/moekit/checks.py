"""Argument checks shared by the modules that load weights (errors name the argument)."""

from __future__ import annotations

import torch

__all__ = ["check_float_tensor", "copy_biases"]


def check_float_tensor(name: str, t, shape) -> None:
    """Raise TypeError/ValueError unless `t` is a float tensor of exactly `shape`."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {list(shape)}, got {list(t.shape)}")
    if not t.is_floating_point():
        raise TypeError(f"{name} must be a float tensor, got {t.dtype}")


@torch.no_grad()
def copy_biases(module, b13=None, b2=None) -> None:
    """Copy given biases into module.b13 / module.b2 (shapes checked); None leaves one as it is."""
    copies = []
    for name, given in (("b13", b13), ("b2", b2)):
        if given is None:
            continue
        param = getattr(module, name)
        if param is None:
            raise ValueError(f"{name} was given but the layer was built with bias=False")
        check_float_tensor(name, given, param.shape)
        copies.append((param, given))
    for param, given in copies:  # after every check: a refused call leaves both biases as they were
        param.copy_(given)

"""Argument checks shared by the modules that load weights (errors name the argument), and when
checks that read a tensor's values may run."""

from __future__ import annotations

import torch

from .config import settings

__all__ = ["check_float_tensor", "copy_biases", "host_checks", "cuda_capturing"]


def cuda_capturing(t: torch.Tensor) -> bool:
    """Whether t's CUDA stream is being captured into a CUDA graph (False while torch.compile
    traces: the query returns no tensor, so a traced graph could not hold it)."""
    return (t.device.type == "cuda" and not torch.compiler.is_compiling()
            and torch.cuda.is_current_stream_capturing())


def host_checks(t: torch.Tensor) -> bool:
    """Whether value checks that read t (a host sync) may run now: never while torch.compile
    traces (a graph cannot branch on values); else always on CPU, and on accelerators unless
    Settings.check_ids is off or a CUDA graph is being captured."""
    if torch.compiler.is_compiling():
        return False
    if t.device.type == "cpu":
        return True
    return settings.check_ids and not cuda_capturing(t)


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
    """Copy given biases into module.b13 / module.b2 (shapes checked); None leaves one as it is.
    Both are checked before either is written, so a refused call changes nothing."""
    given = [(name, t) for name, t in (("b13", b13), ("b2", b2)) if t is not None]
    for name, t in given:
        param = getattr(module, name)
        if param is None:
            raise ValueError(f"{name} was given but the layer was built with bias=False")
        check_float_tensor(name, t, param.shape)
    for name, t in given:
        getattr(module, name).copy_(t)

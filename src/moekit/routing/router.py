"""The router: a pure function of (logits, RoutingConfig, correction bias) -> TopK.

Every variant of ROUTING.md; all arithmetic in fp32. Ties go to the lowest expert index.
On CUDA one Triton launch routes (moekit.kernels.triton_router: every variant but custom
functions, without autograd); elsewhere, and for what it does not cover, torch ops do
(route_torch).
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import torch

from ..checks import host_checks
from ..config import RoutingConfig
from .scoring import score
from .select import group_mask, renormalize, stable_topk

__all__ = ["TopK", "route", "route_torch", "check_router_logits"]


class TopK(NamedTuple):
    """Routing result: weights [T, k] fp32 and ids [T, k] int32 (logical expert ids)."""

    weights: torch.Tensor
    ids: torch.Tensor


_NAN_MESSAGE = ("router_logits contains NaN, +inf or a row with no finite logit (a token that can pick no "
                "expert); routing over them is undefined")
_BIAS_MESSAGE = "correction_bias must be finite, got NaN or inf entries"


def check_router_logits(router_logits: torch.Tensor, nan: bool = True) -> None:
    """Type and shape of router_logits; with nan, also that no logit is NaN or +inf and that every
    row has a finite logit (see _check_values; -inf alone means "never this expert")."""
    if not isinstance(router_logits, torch.Tensor):
        raise TypeError(f"router_logits must be a torch.Tensor, got {type(router_logits).__name__}")
    if router_logits.dim() != 2:
        raise ValueError(f"router_logits must be 2-D [T, E], got shape {tuple(router_logits.shape)}")
    if not router_logits.is_floating_point():
        raise TypeError(f"router_logits must be a floating tensor, got {router_logits.dtype}")
    # NaN logits: an error, never a silent pick. The check costs a host sync, so it runs on
    # CPU tensors (and on accelerators outside graph capture, see Settings.check_ids).
    if nan:
        _check_values(router_logits, _bad_logits, _NAN_MESSAGE)


def _bad_logits(z: torch.Tensor) -> torch.Tensor:
    """[] bool: a NaN or +inf logit, or a row without a finite logit (all -inf)."""
    return (torch.isnan(z) | torch.isposinf(z)).any() | torch.isneginf(z).all(-1).any()


def _check_values(t: torch.Tensor, bad, message: str) -> None:
    """Raise ValueError(message) if bad(t) ([] bool) holds, where value checks may run
    (checks.host_checks). While torch.compile traces CPU tensors the check becomes an assertion
    inside the graph (a RuntimeError with the same message); on accelerators it is skipped there,
    as in CUDA-graph capture (a device-side assert would end the process's CUDA context)."""
    if not t.numel():
        return
    if torch.compiler.is_compiling():
        if t.device.type == "cpu":
            torch._assert_async(~bad(t), message)
    elif host_checks(t) and bool(bad(t)):
        raise ValueError(message)


def _kernel_routes(z: torch.Tensor, cfg: RoutingConfig, bias: Optional[torch.Tensor]) -> bool:
    """Whether the one-launch Triton router (moekit.kernels.triton_router) takes this call: CUDA
    (not ROCm), Triton importable, no autograd through the logits or the bias, not inside
    torch.compile (which traces the torch path), and a config and E it covers."""
    if torch.compiler.is_compiling():  # first: dynamo would trace through the cached lookup below
        return False
    if z.device.type != "cuda" or getattr(torch.version, "hip", None) or not _triton_available():
        return False
    if torch.is_grad_enabled() and (z.requires_grad or (bias is not None and bias.requires_grad)):
        return False
    from ..kernels.triton_router import kernel_refusal  # noqa: PLC0415

    return kernel_refusal(cfg, z.shape[1]) is None


@functools.lru_cache(maxsize=1)
def _triton_available() -> bool:
    try:
        import triton  # noqa: F401, PLC0415
    except ImportError:
        return False
    return True


def _score_then_topk(z: torch.Tensor, cfg: RoutingConfig, bias: Optional[torch.Tensor]) -> TopK:
    T, E = z.shape
    p = score(z, cfg.scoring)  # [T, E] unbiased scores: they become the weights
    c = p if bias is None else p + bias.float()  # [T, E] selection scores
    # -inf logits come last whatever the bias (and softmax scores that underflow to 0 do not tie with them)
    c = c.masked_fill(z == float("-inf"), float("-inf"))
    grouped = cfg.uses_groups(E)
    if grouped:
        c = group_mask(c, cfg.num_expert_group, cfg.topk_group, cfg.group_score_for(bias is not None))
    ids = stable_topk(c, cfg.top_k)  # [T, k]
    w = p.gather(1, ids)  # [T, k]
    if cfg.renormalize:
        eps, clamp = cfg.renorm_eps(grouped, bias is not None)
        w = renormalize(w, eps, clamp=clamp)
    return TopK(w, ids)


def _topk_then(z: torch.Tensor, cfg: RoutingConfig) -> TopK:
    ids = stable_topk(z, cfg.top_k)  # [T, k] on raw logits
    zk = z.gather(1, ids)  # [T, k]
    if cfg.order == "topk_then_softmax":
        return TopK(torch.softmax(zk, dim=-1), ids)
    w = torch.sigmoid(zk)
    return TopK(renormalize(w) if cfg.renormalize else w, ids)


def _custom(z: torch.Tensor, cfg: RoutingConfig, hidden_states: Optional[torch.Tensor]) -> TopK:
    T, E = z.shape
    out = cfg.custom(hidden_states, z, cfg.top_k)
    if not (isinstance(out, (tuple, list)) and len(out) == 2):
        raise TypeError("custom routing function must return (weights [T, k], ids [T, k])")
    w, ids = out
    if not (isinstance(w, torch.Tensor) and isinstance(ids, torch.Tensor)):
        raise TypeError(f"custom routing function must return tensors (weights [T, k], ids [T, k]), "
                        f"got {type(w).__name__} and {type(ids).__name__}")
    if w.device != z.device or ids.device != z.device:
        raise ValueError(f"custom routing function returned weights on {w.device} and ids on {ids.device}, "
                         f"expected both on {z.device} (the device of router_logits)")
    if tuple(w.shape) != (T, cfg.top_k) or tuple(ids.shape) != (T, cfg.top_k):
        raise ValueError(
            f"custom routing function returned weights {tuple(w.shape)} and ids {tuple(ids.shape)}, "
            f"expected both [{T}, {cfg.top_k}]"
        )
    if ids.is_floating_point() or ids.dtype == torch.bool:
        raise TypeError(f"custom routing function returned ids of dtype {ids.dtype}, expected an integer dtype")
    _check_values(ids, lambda t: (t.min() < 0) | (t.max() >= E), f"custom routing function returned ids outside [0, {E})")
    if not w.is_floating_point():
        raise TypeError(f"custom routing function returned weights of dtype {w.dtype}, expected a float dtype")
    _check_values(w, lambda t: ~torch.isfinite(t).all(), "custom routing function returned NaN or infinite weights")
    return TopK(w.float(), ids)


def route(
    router_logits: torch.Tensor,
    config: RoutingConfig,
    correction_bias: Optional[torch.Tensor] = None,
    *,
    hidden_states: Optional[torch.Tensor] = None,
) -> TopK:
    """Select k experts per token and their weights.

    Args:
        router_logits: [T, E] any float dtype (cast to fp32).
        config: the RoutingConfig.
        correction_bias: [E] fp32 selection-only bias b (DeepSeek-V3), or None.
        hidden_states: [T, H], passed to a custom routing function only.
    Returns:
        TopK(weights [T, k] fp32, ids [T, k] int32); weights are renormalised and multiplied
        by routed_scaling_factor when the config says so (scale_on="router").
    """
    check_router_logits(router_logits, nan=False)
    if not isinstance(config, RoutingConfig):
        raise TypeError(f"config must be a RoutingConfig, got {type(config).__name__}")
    T, E = router_logits.shape
    config.validate_for(E)
    if correction_bias is not None:
        if not isinstance(correction_bias, torch.Tensor):
            raise TypeError(f"correction_bias must be a torch.Tensor [{E}] or None, got {type(correction_bias).__name__}")
        if not correction_bias.is_floating_point():
            raise TypeError(f"correction_bias must be a float tensor [{E}], got {correction_bias.dtype}")
        if tuple(correction_bias.shape) != (E,):
            raise ValueError(f"correction_bias must have shape [{E}], got {tuple(correction_bias.shape)}")
        if config.custom is not None:
            raise ValueError("correction_bias does not apply to a custom routing function (config.custom is set)")
        if config.order != "score_then_topk":
            raise ValueError(f"correction_bias needs order='score_then_topk', got order={config.order!r}")
    if _kernel_routes(router_logits, config, correction_bias):
        from ..kernels.triton_router import triton_route  # noqa: PLC0415 (triton is optional)

        w, ids, nan = triton_route(router_logits, config, correction_bias, check_nan=host_checks(router_logits))
        if nan is not None and bool(nan):  # the kernel's flag covers the bias too
            raise ValueError(_NAN_MESSAGE if correction_bias is None else f"{_NAN_MESSAGE}, or {_BIAS_MESSAGE}")
        return TopK(w, ids)
    check_router_logits(router_logits)
    if correction_bias is not None:
        _check_values(correction_bias, lambda t: ~torch.isfinite(t).all(), _BIAS_MESSAGE)
    return route_torch(router_logits, config, correction_bias, hidden_states=hidden_states)


def route_torch(
    router_logits: torch.Tensor,
    config: RoutingConfig,
    correction_bias: Optional[torch.Tensor] = None,
    *,
    hidden_states: Optional[torch.Tensor] = None,
) -> TopK:
    """route()'s math in torch ops, on any device (route() checks its arguments first; on CUDA
    it runs the one-launch kernel instead where that covers the call)."""
    z = router_logits.float()  # [T, E]
    if config.custom is not None:
        w, ids = _custom(z, config, hidden_states)
    elif config.order == "score_then_topk":
        w, ids = _score_then_topk(z, config, correction_bias)
    else:
        w, ids = _topk_then(z, config)
    if config.routed_scaling_factor != 1.0 and config.scale_on == "router":
        w = w * config.routed_scaling_factor
    return TopK(w.contiguous(), ids.to(torch.int32).contiguous())

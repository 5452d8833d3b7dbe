"""Peers run in the same process as moekit: transformers' experts implementations
("eager", "grouped_mm") and a plain torch grouped-GEMM layer."""

from __future__ import annotations

from typing import Callable, Dict

import torch

__all__ = ["transformers_experts", "plain_grouped_gemm", "make_peers"]


def transformers_experts(w13: torch.Tensor, w2: torch.Tensor, implementation: str) -> Callable:
    """A transformers MixtralExperts module holding (w13, w2) run through `implementation`.

    Returns f(x [T, H], weights [T, k], ids [T, k]) -> [T, H]. Needs transformers 5.x.
    """
    try:
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralExperts
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError("transformers peers need `pip install moekit[hf]`") from err
    E, twoI, H = w13.shape
    cfg = MixtralConfig(num_local_experts=E, hidden_size=H, intermediate_size=twoI // 2, hidden_act="silu")
    cfg._experts_implementation = implementation
    with torch.device("meta"):
        mod = MixtralExperts(cfg)
    mod.gate_up_proj = torch.nn.Parameter(w13, requires_grad=False)
    mod.down_proj = torch.nn.Parameter(w2, requires_grad=False)

    def run(x, weights, ids):
        return mod(x, ids.long(), weights.to(x.dtype))

    return run


def plain_grouped_gemm(w13: torch.Tensor, w2: torch.Tensor) -> Callable:
    """The textbook torch layer: sort by expert, torch grouped_mm twice, index_add back."""
    gmm = getattr(torch.nn.functional, "grouped_mm", None) or torch._grouped_mm
    E = w13.shape[0]
    I = w2.shape[2]

    def run(x, weights, ids):
        T, k = ids.shape
        flat = ids.reshape(-1).long()
        order = torch.argsort(flat)
        offs = torch.cumsum(torch.bincount(flat, minlength=E), 0).to(torch.int32)
        xs = x[order // k]
        h = gmm(xs, w13.transpose(1, 2), offs=offs)
        a = torch.nn.functional.silu(h[:, :I]) * h[:, I:]
        y = gmm(a, w2.transpose(1, 2), offs=offs) * weights.reshape(-1)[order, None].to(x.dtype)
        return torch.zeros_like(x).index_add_(0, order // k, y)

    return run


def make_peers(w13: torch.Tensor, w2: torch.Tensor) -> Dict[str, Callable]:
    """Every peer that can run here, by name."""
    peers = {"torch_grouped_gemm": plain_grouped_gemm(w13, w2)}
    for impl in ("eager", "grouped_mm"):
        try:
            peers[f"hf_{impl}"] = transformers_experts(w13, w2, impl)
        except ImportError:
            pass
    return peers

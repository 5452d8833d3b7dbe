"""What one rank holds of a FusedMoE layer, how full checkpoints are cut to it, and the
configuration fingerprint every rank must share.

Under expert parallelism a rank holds E_local whole experts (placement.py); under
tensor parallelism it holds every expert's I-slice (tensor_parallel.py). load_weights
takes either the full tensors (and cuts this rank's part) or this rank's part.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch

from .config import ParallelConfig
from .placement import expert_map, local_experts, split_bounds
from .tensor_parallel import shard_intermediate

__all__ = ["Shard", "make_shard", "fingerprint_fields"]


@dataclass(frozen=True)
class Shard:
    """This rank's part of a layer of E experts with intermediate size I.

    expert_ids: [E_local] int64 global ids of the experts held (all E under TP).
    expert_map: [E] int32 global -> local id, -1 elsewhere; None under TP.
    i_start, i_end: the I-slice held ([0, I) under EP).
    """

    parallel: ParallelConfig
    num_experts: int
    intermediate_size: int
    expert_ids: torch.Tensor
    expert_map: Optional[torch.Tensor]
    i_start: int
    i_end: int

    @property
    def local_experts(self) -> int:
        return self.expert_ids.numel()

    @property
    def local_intermediate(self) -> int:
        return self.i_end - self.i_start

    def select(self, w13, w2, b13=None, b2=None, *, gated: bool) -> Tuple:
        """Cut full canonical tensors to this rank, or pass this rank's tensors through.

        Args:
            w13: [E or E_local, 2I, H] (EP) / [E, 2I or 2I_r, H] (TP).  w2: [E.., H, I..].
            b13, b2: optional biases of the same leading shapes.  gated: the activation is gated.
        Returns:
            (w13, w2, b13, b2) of the local shapes (RoutedExperts.load_weights checks them).
        """
        p = self.parallel
        if p.ep_size > 1:
            E, E_l = self.num_experts, self.local_experts
            n = w13.shape[0] if isinstance(w13, torch.Tensor) and w13.dim() == 3 else None
            if n == E:
                # the others are cut by index too: check they hold all E experts like w13 first
                _check_dim((("w2", w2), ("b13", b13), ("b2", b2)), 0, E, f"all E={E} experts (dim 0), as w13 does")
                return tuple(None if t is None else t.index_select(0, self.expert_ids.to(t.device))
                             for t in (w13, w2, b13, b2))
            if n != E_l:
                raise ValueError(
                    f"w13 must hold all E={E} experts or this rank's E_local={E_l} (rank {p.ep_rank} of "
                    f"{p.ep_size}), got shape {None if n is None else tuple(w13.shape)}"
                )
            return w13, w2, b13, b2
        if p.tp_size > 1:
            I, I_r = self.intermediate_size, self.local_intermediate
            n = w2.shape[2] if isinstance(w2, torch.Tensor) and w2.dim() == 3 else None
            if n == I:
                # w13 and b13 are cut by row ranges: check they hold the full I first
                rows = 2 * I if gated else I
                _check_dim((("w13", w13), ("b13", b13)), 1, rows,
                           f"{'2I' if gated else 'I'}={rows} rows (dim 1) for the full I={I} that w2 holds")
                return shard_intermediate(w13, w2, b13, b2, p.tp_size, p.tp_rank, gated)
            if n != I_r:
                raise ValueError(
                    f"w2 must be [E, H, I] with the full I={I} or this rank's slice I_r={I_r} (rank {p.tp_rank} "
                    f"of {p.tp_size}), got shape {None if n is None else tuple(w2.shape)}"
                )
            # b2 is never sliced: it is added once, by rank 0.
            return w13, w2, b13, (None if b2 is None or p.tp_rank == 0 else torch.zeros_like(b2))
        return w13, w2, b13, b2


def _check_dim(named, dim: int, size: int, expected: str) -> None:
    """Raise ValueError unless every tensor of `named` ((name, tensor or None) pairs) has `size` at `dim`."""
    for name, t in named:
        if t is not None and not (isinstance(t, torch.Tensor) and t.dim() > dim and t.shape[dim] == size):
            got = f"shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must hold {expected}, got {got}")


def make_shard(parallel: ParallelConfig, num_experts: int, intermediate_size: int) -> Shard:
    """This rank's part of a layer with E = num_experts and I = intermediate_size."""
    E, I = num_experts, intermediate_size
    if parallel.ep_size > 1:
        held = local_experts(E, parallel.ep_size, parallel.ep_rank, parallel.placement)
        emap = expert_map(E, parallel.ep_size, parallel.ep_rank, parallel.placement)
        return Shard(parallel, E, I, held, emap, 0, I)
    if parallel.tp_size > 1 and I < parallel.tp_size:
        raise ValueError(
            f"intermediate_size must be >= tp_size={parallel.tp_size} (every rank holds a slice of I), got {I}"
        )
    i0, i1 = split_bounds(I, parallel.tp_size, parallel.tp_rank)
    return Shard(parallel, E, I, torch.arange(E), None, i0, i1)


def fingerprint_fields(parallel: ParallelConfig, *, num_experts: int, hidden_size: int, intermediate_size: int,
                       routing, activation: str, bias: bool, dtype: Optional[torch.dtype],
                       shared, quant=None, activation_params=None) -> List[Tuple[str, object]]:
    """The (name, value) pairs every rank of a parallel layer must agree on (quant: the QuantScheme
    or None; activation_params: the ActivationParams or None for the defaults)."""
    from ..config import ActivationParams  # noqa: PLC0415

    import torch.distributed as dist  # noqa: PLC0415

    custom = routing.custom
    routing_key = repr(dataclasses.replace(routing, custom=None))
    if custom is not None:
        routing_key += "|" + getattr(custom, "__qualname__", type(custom).__qualname__)
    return [
        ("group_size", dist.get_world_size(parallel.group)),
        ("ep_size", parallel.ep_size),
        ("tp_size", parallel.tp_size),
        ("placement", parallel.placement),
        ("dispatcher", parallel.dispatcher_name),
        ("max_tokens_per_rank", parallel.max_tokens_per_rank),
        ("num_experts", num_experts),
        ("top_k", routing.top_k),
        ("hidden_size", hidden_size),
        ("intermediate_size", intermediate_size),
        ("activation", activation),
        ("bias", bias),
        ("dtype", str(dtype or torch.get_default_dtype())),  # the layer's dtype: None is the default dtype
        ("shared_experts", repr(shared)),
        ("routing", routing_key),
        ("quant", "none" if quant is None else f"{quant.name}, group_size={quant.group_size}, "
                                             f"symmetric={quant.symmetric}"),
        ("activation_params", repr(activation_params or ActivationParams())),
    ]

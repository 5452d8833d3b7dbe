"""Tensor parallelism of the intermediate dimension I (the alternative to expert parallelism).

Every rank holds every expert but only an I-slice of it ("linear" split of I), runs the
routed experts on the same tokens as every other rank, and an all-reduce sums the
partial outputs. This is exact because the experts are additive over I:

    W2 act(W13 x) = sum over slices s of W2[:, s] act(W13[s] x)      (act is elementwise)

The down-projection bias b2 must be added once, so rank 0 keeps it and the other ranks
hold zeros. Every rank must pass the same tokens to forward.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.distributed as dist

from .base import Dispatched, Dispatcher
from .config import ParallelConfig
from .ep_common import check_no_grad
from .placement import split_bounds

__all__ = ["AllReduceDispatcher", "shard_intermediate"]


def shard_intermediate(
    w13: torch.Tensor,
    w2: torch.Tensor,
    b13: Optional[torch.Tensor],
    b2: Optional[torch.Tensor],
    tp_size: int,
    tp_rank: int,
    gated: bool,
) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """This rank's I-slice of full expert weights.

    Args:
        w13: [E, 2I, H] (gate rows 0..I-1, up rows I..2I-1) or [E, I, H] non-gated.
        w2: [E, H, I].  b13: [E, 2I] or [E, I] or None.  b2: [E, H] or None.
    Returns:
        w13 [E, 2I_r, H] (gate slice then up slice), w2 [E, H, I_r], b13 [E, 2I_r],
        b2 [E, H] (zeros on ranks other than 0), with [i0, i1) = split_bounds(I, tp_size, tp_rank).
    """
    I = w2.shape[2]
    i0, i1 = split_bounds(I, tp_size, tp_rank)
    if gated:
        w13_r = torch.cat((w13[:, i0:i1], w13[:, I + i0:I + i1]), dim=1)
        b13_r = None if b13 is None else torch.cat((b13[:, i0:i1], b13[:, I + i0:I + i1]), dim=1)
    else:
        w13_r = w13[:, i0:i1]
        b13_r = None if b13 is None else b13[:, i0:i1]
    b2_r = None if b2 is None else (b2 if tp_rank == 0 else torch.zeros_like(b2))
    return w13_r, w2[:, :, i0:i1], b13_r, b2_r


class AllReduceDispatcher(Dispatcher):
    """Tokens stay in place; combine sums the ranks' partial outputs with an all-reduce."""

    name = "all_reduce"
    graph_safe = True

    def __init__(self, parallel: ParallelConfig) -> None:
        if parallel.tp_size < 2:
            raise ValueError(f"AllReduceDispatcher needs tp_size >= 2, got tp_size={parallel.tp_size}")
        self.group = parallel.group

    def dispatch(self, x, topk_weights, topk_ids) -> Dispatched:
        return Dispatched(x, topk_weights, topk_ids, None)

    def combine(self, y: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        """y [T, H] partial outputs of this rank's I-slice -> [T, H] fp32 sum over ranks."""
        check_no_grad(y, "the experts' output")
        out = y.float().contiguous()
        dist.all_reduce(out, group=self.group)
        return out

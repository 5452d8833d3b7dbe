"""The dispatcher contract (prepare/finalize) and the `local` dispatcher.

A dispatcher sends each token to the ranks that own its experts (dispatch) and brings
the weighted results home (combine). Dispatchers own no parameters: they move data.
dispatch returns an explicit frozen object that combine takes back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

__all__ = ["Dispatched", "Dispatcher", "LocalDispatcher"]


@dataclass(frozen=True)
class Dispatched:
    """What dispatch hands the experts and, through `handle`, combine.

    x: [T_recv, H] tokens to compute here.  topk_weights: [T_recv, k] fp32.
    topk_ids: [T_recv, k] int32 global ids (expert_map makes them local).
    expert_map: [E_global] int32 or None.  handle: dispatcher-private metadata for combine.
    more_rounds: whether any rank has tokens for another round (dispatchers that agree on
        the rounds in dispatch, see Dispatcher.rounds_in_dispatch; False otherwise).
    """

    x: torch.Tensor
    topk_weights: torch.Tensor
    topk_ids: torch.Tensor
    expert_map: Optional[torch.Tensor]
    handle: Any = None
    more_rounds: bool = False


class Dispatcher:
    """Base class: `dispatch` then `combine`.

    Rounds: the runner splits a rank's tokens into chunks, and under expert parallelism every
    rank must make the same number of dispatch rounds. A dispatcher either answers
    `num_chunks` up front, or (rounds_in_dispatch True) takes `dispatch(..., more=)`, whether
    this rank has tokens after this round, and answers Dispatched.more_rounds for all ranks
    from a collective it makes anyway: the runner then loops until no rank has more.
    """

    name = ""
    # dispatch and combine make no host synchronisation: a whole layer step can be captured in
    # a CUDA graph (FusedMoE's eager_graphs replays them only then)
    graph_safe = False

    @property
    def rounds_in_dispatch(self) -> bool:
        return False

    def dispatch(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> Dispatched:
        raise NotImplementedError

    def combine(self, y: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        """y [T_recv, H] fp32 partial outputs -> [T, H] fp32 for this rank's own tokens."""
        raise NotImplementedError

    def refuse(self, x: torch.Tensor) -> None:
        """Called by a rank that refuses the call before dispatching x [T, H] (it raises next):
        join the round's first collective so the other ranks raise too, rather than wait for
        this rank until the process group's timeout. Dispatchers without a status to carry
        that (every one but `all_to_all`) do nothing."""

    def num_chunks(self, x: torch.Tensor, chunk_size: int) -> int:
        """How many dispatch rounds the runner makes for x [T, H] (at least one, even for T = 0).

        Expert-parallel dispatchers return the same number on every rank, since each round
        is a collective every rank must join.
        """
        return max(1, -(-x.shape[0] // chunk_size))


class LocalDispatcher(Dispatcher):
    """No parallelism: every expert is local."""

    name = "local"
    graph_safe = True

    def dispatch(self, x, topk_weights, topk_ids) -> Dispatched:
        return Dispatched(x, topk_weights, topk_ids, None)

    def combine(self, y, dispatched) -> torch.Tensor:
        return y

"""Expert placement: which rank holds which expert, as pure index math (no distributed code).

Letters: E global experts (physical slots when EPLB adds replicas), P ranks, r a rank.

    "linear":      rank r holds the contiguous block [start_r, start_r + n_r) with
                   n_r = E // P + (1 if r < E % P else 0) and start_r = r * (E // P) + min(r, E % P).
    "round_robin": rank r holds the experts e with e % P == r; local id = e // P.

Every rank must hold at least one expert (E >= P): a rank without experts would only
forward tokens, which is a configuration mistake rather than a layout.
"""

from __future__ import annotations

from typing import List, Tuple

import torch

from .config import PLACEMENTS

__all__ = ["split_sizes", "split_bounds", "local_experts", "expert_owner", "expert_map", "non_local_expert"]


def _check(num_experts: int, num_ranks: int, placement: str) -> None:
    if isinstance(num_ranks, bool) or not isinstance(num_ranks, int) or num_ranks < 1:
        raise ValueError(f"num_ranks must be an int >= 1, got {num_ranks!r}")
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < num_ranks:
        raise ValueError(
            f"num_experts must be an int >= the number of ranks {num_ranks} (every rank holds at least one "
            f"expert), got {num_experts!r}"
        )
    if placement not in PLACEMENTS:
        raise ValueError(f"placement must be one of {list(PLACEMENTS)}, got {placement!r}")


def split_sizes(n: int, parts: int) -> List[int]:
    """Sizes of the "linear" split of n items into `parts` blocks: the first n % parts get one more."""
    if parts < 1 or n < 0:
        raise ValueError(f"need n >= 0 and parts >= 1, got n={n}, parts={parts}")
    base, extra = divmod(n, parts)
    return [base + (1 if r < extra else 0) for r in range(parts)]


def split_bounds(n: int, parts: int, index: int) -> Tuple[int, int]:
    """[start, end) of block `index` in the "linear" split of n items into `parts` blocks."""
    if not 0 <= index < parts:
        raise ValueError(f"index must be in [0, {parts}), got {index}")
    base, extra = divmod(n, parts)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


def local_experts(num_experts: int, num_ranks: int, rank: int, placement: str) -> torch.Tensor:
    """Global ids of the experts rank `rank` holds, in local order.

    Returns:
        [E_local] int64; entry i is the global id of local expert i.
    """
    _check(num_experts, num_ranks, placement)
    if not 0 <= rank < num_ranks:
        raise ValueError(f"rank must be in [0, {num_ranks}), got {rank}")
    if placement == "linear":
        start, end = split_bounds(num_experts, num_ranks, rank)
        return torch.arange(start, end, dtype=torch.int64)
    return torch.arange(rank, num_experts, num_ranks, dtype=torch.int64)


def expert_owner(num_experts: int, num_ranks: int, placement: str) -> torch.Tensor:
    """The rank holding each expert.

    Returns:
        [E] int64 owner rank per global expert id.
    """
    _check(num_experts, num_ranks, placement)
    if placement == "round_robin":
        return torch.arange(num_experts, dtype=torch.int64) % num_ranks
    sizes = torch.tensor(split_sizes(num_experts, num_ranks), dtype=torch.int64)
    return torch.repeat_interleave(torch.arange(num_ranks, dtype=torch.int64), sizes)


def expert_map(num_experts: int, num_ranks: int, rank: int, placement: str) -> torch.Tensor:
    """Global -> local expert id on rank `rank`, -1 where another rank holds the expert.

    Returns:
        [E] int32.
    """
    held = local_experts(num_experts, num_ranks, rank, placement)  # [E_local]
    out = torch.full((num_experts,), -1, dtype=torch.int32)
    out[held] = torch.arange(held.numel(), dtype=torch.int32)
    return out


def non_local_expert(num_experts: int, num_ranks: int, rank: int, placement: str) -> int:
    """A global expert id that rank `rank` does not hold (padding rows point at it so that
    every experts backend skips them). Needs num_ranks >= 2."""
    if num_ranks < 2:
        raise ValueError(f"every expert is local with num_ranks={num_ranks}; need num_ranks >= 2")
    owner = expert_owner(num_experts, num_ranks, placement)
    return int((owner != rank).nonzero()[0, 0])

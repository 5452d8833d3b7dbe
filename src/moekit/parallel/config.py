"""ParallelConfig: how one FusedMoE layer is split over the ranks of a process group.

Two exclusive ways to split a layer:

- expert parallelism (ep_size > 1): each rank holds E_local of the E experts (the
  placement rule below) and a dispatcher moves tokens to the ranks that hold their
  experts and the weighted results back;
- tensor parallelism of the intermediate dimension (tp_size > 1, EP off): every rank
  holds every expert but only an I-slice of it, computes a partial output for the same
  tokens, and an all-reduce sums the partial outputs.

Placement of E experts over P ranks (moekit.parallel.placement does the index math):
    "linear": rank r holds a contiguous block; the first E % P ranks hold E // P + 1
        experts, the others E // P. Example E=10, P=4: [0 1 2] [3 4 5] [6 7] [8 9].
    "round_robin": rank r holds experts r, r + P, r + 2P, ... Example E=10, P=4:
        [0 4 8] [1 5 9] [2 6] [3 7].
The I-slices of tensor parallelism follow the "linear" rule over I.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

__all__ = ["ParallelConfig", "PLACEMENTS", "EP_DISPATCHERS", "CAPACITY_DISPATCHERS", "TP_DISPATCHERS"]

PLACEMENTS = ("linear", "round_robin")
PEER_MEMORY = ("auto", "symmetric", "ipc")
EP_DISPATCHERS = ("all_to_all", "allgather_reducescatter", "static_all_to_all", "p2p_all_to_all")
CAPACITY_DISPATCHERS = ("static_all_to_all", "p2p_all_to_all")  # buffers sized by max_tokens_per_rank
TP_DISPATCHERS = ("all_reduce",)


def _check_int(name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


@dataclass(frozen=True)
class ParallelConfig:
    """How a FusedMoE layer is split over a process group (see the module docstring).

    Fields:
        ep_size, ep_rank: expert-parallel group size P and this rank's index in it.
        tp_size, tp_rank: tensor-parallel group size and rank (sharding of I); only when
            ep_size == 1.
        group: the torch.distributed ProcessGroup; None means the default (world) group.
        placement: "linear" | "round_robin" (expert placement, EP only).
        dispatcher: EP: "all_to_all" (default), "allgather_reducescatter" or
            "static_all_to_all" (fixed capacity, no host sync, CUDA-graph capturable) or
            "p2p_all_to_all" (the same through peer-mapped GPU memory: one host, CUDA, Triton);
            TP: "all_reduce" (default). None picks the default of the mode. With one rank
            (ep_size == tp_size == 1) every expert is local and no dispatcher runs.
        max_tokens_per_rank: the most tokens one rank passes to one forward. Required by
            the capacity dispatchers (it sizes the buffers); with the dynamic dispatchers it
            is optional and, when set, lets every forward skip the agreement on the
            number of chunks (a collective and a host sync). More tokens is an error.
        timeout_s: bound on the configuration exchange at construction, and on a p2p_all_to_all
            barrier's wait for a peer, in seconds.
        peer_memory: how p2p_all_to_all maps the peers' GPU memory: "auto" (torch symmetric
            memory, else CUDA IPC), "symmetric" or "ipc".
    """

    ep_size: int = 1
    ep_rank: int = 0
    tp_size: int = 1
    tp_rank: int = 0
    group: Any = None
    placement: str = "linear"
    dispatcher: Optional[str] = None
    max_tokens_per_rank: Optional[int] = None
    timeout_s: float = 60.0
    peer_memory: str = "auto"

    def __post_init__(self) -> None:
        _check_int("ep_size", self.ep_size, 1)
        _check_int("tp_size", self.tp_size, 1)
        _check_int("ep_rank", self.ep_rank, 0)
        _check_int("tp_rank", self.tp_rank, 0)
        if self.ep_rank >= self.ep_size:
            raise ValueError(f"ep_rank must be in [0, ep_size={self.ep_size}), got {self.ep_rank}")
        if self.tp_rank >= self.tp_size:
            raise ValueError(f"tp_rank must be in [0, tp_size={self.tp_size}), got {self.tp_rank}")
        if self.ep_size > 1 and self.tp_size > 1:
            raise ValueError(
                f"expert parallelism and tensor parallelism are exclusive, got ep_size={self.ep_size} "
                f"and tp_size={self.tp_size}"
            )
        if self.placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {list(PLACEMENTS)}, got {self.placement!r}")
        # one rank (tensor_parallel() or expert_parallel() of a world of one) takes either mode's names
        allowed = TP_DISPATCHERS if self.tp_size > 1 else EP_DISPATCHERS if self.ep_size > 1 else (
            EP_DISPATCHERS + TP_DISPATCHERS)
        if self.dispatcher is not None and self.dispatcher not in allowed:
            mode = ("tensor parallelism (tp_size > 1)" if self.tp_size > 1 else "expert parallelism"
                    if self.ep_size > 1 else "one rank")
            raise ValueError(f"dispatcher for {mode} must be one of {list(allowed)}, got {self.dispatcher!r}")
        if self.max_tokens_per_rank is not None:
            _check_int("max_tokens_per_rank", self.max_tokens_per_rank, 1)
        if self.dispatcher in CAPACITY_DISPATCHERS and self.max_tokens_per_rank is None:
            raise ValueError(
                f"dispatcher {self.dispatcher!r} needs max_tokens_per_rank (it sizes the buffers), got None")
        if isinstance(self.timeout_s, bool) or not (isinstance(self.timeout_s, (int, float)) and self.timeout_s > 0):
            raise ValueError(f"timeout_s must be a number > 0, got {self.timeout_s!r}")
        if self.peer_memory not in PEER_MEMORY:
            raise ValueError(f"peer_memory must be one of {list(PEER_MEMORY)}, got {self.peer_memory!r}")

    @classmethod
    def expert_parallel(cls, group=None, **fields) -> "ParallelConfig":
        """EP over `group` (None: the world group), ep_size and ep_rank read from it."""
        import torch.distributed as dist  # noqa: PLC0415

        _require_member(group)
        return cls(ep_size=dist.get_world_size(group), ep_rank=dist.get_rank(group), group=group, **fields)

    @classmethod
    def tensor_parallel(cls, group=None, **fields) -> "ParallelConfig":
        """Sharding of I over `group` (None: the world group), tp_size and tp_rank read from it."""
        import torch.distributed as dist  # noqa: PLC0415

        _require_member(group)
        return cls(tp_size=dist.get_world_size(group), tp_rank=dist.get_rank(group), group=group, **fields)

    @property
    def size(self) -> int:
        """Ranks the layer is split over (ep_size or tp_size)."""
        return max(self.ep_size, self.tp_size)

    @property
    def rank(self) -> int:
        """This rank's index in the group."""
        return self.ep_rank if self.ep_size > 1 else self.tp_rank

    @property
    def dispatcher_name(self) -> str:
        """The dispatcher this config selects: "local" when the layer is not split (a group of one
        rank holds every expert, so a script written for P ranks also runs on one)."""
        if self.size == 1:
            return "local"
        if self.dispatcher is not None:
            return self.dispatcher
        return "all_reduce" if self.tp_size > 1 else "all_to_all"

    def check_group(self) -> None:
        """Raise ValueError unless torch.distributed is set up and the group matches size and rank."""
        if self.size == 1:
            return
        import torch.distributed as dist  # noqa: PLC0415

        _require_initialized()
        size, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        field = "ep" if self.ep_size > 1 else "tp"
        if size != self.size or rank != self.rank:
            raise ValueError(
                f"{field}_size/{field}_rank must match the process group, got {field}_size={self.size}, "
                f"{field}_rank={self.rank} but the group has size {size} and this process is rank {rank}"
            )


def _require_initialized() -> None:
    import torch.distributed as dist  # noqa: PLC0415

    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(
            "parallel layers need torch.distributed initialised first (torch.distributed.init_process_group), "
            "got an uninitialised default group"
        )


def _require_member(group) -> None:
    """torch.distributed is set up and this process belongs to `group` (None: the world group)."""
    import torch.distributed as dist  # noqa: PLC0415

    _require_initialized()
    if group is not None and dist.get_rank(group) < 0:
        raise ValueError(
            f"group must contain this process (global rank {dist.get_rank()}), got a group it is not a member of; "
            "build the layer only on the group's ranks"
        )

"""Configuration and records of an elastic deployment: ElasticConfig, StageEvent, TransitionReport."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Optional, Tuple

from .model import ModelSpec

__all__ = ["ElasticConfig", "ElasticError", "StageEvent", "TransitionReport"]


class ElasticError(RuntimeError):
    """The deployment cannot serve any more; the message names why."""


class BatchFailed(RuntimeError):
    """One batch failed max_attempts runs and left the queue; the deployment serves on.

    Attributes: batch (its id) and why (the last run's failure)."""

    def __init__(self, batch: int, why: str) -> None:
        super().__init__(f"batch {batch} failed on every one of its runs and was dropped from the queue "
                         f"(controller.batch_errors[{batch}]); last: {why}")
        self.batch, self.why = batch, why


@dataclass(frozen=True)
class ElasticConfig:
    """How an elastic expert-parallel deployment runs.

    Fields:
        spec: the served model.  checkpoint: its safetensors file (model.write_checkpoint).
        max_slots_per_rank: expert slots one rank can hold (the capacity rule, plan.py).
        num_redundant: replicas beyond the E experts (R rounds E + this up to a multiple of P).
        num_groups: expert groups of the EPLB policy (must divide E).
        collective_timeout_s: gloo timeout of every generation group: the longest a member
            waits in a collective on a dead or hung peer, or for a member that never comes
            to a rendezvous. A member that vanishes in the middle of a rendezvous costs the
            others up to 5x this (measured on torch 2.13: gloo retries the connection).
        command_timeout_s: the longest the controller waits for a worker's reply; commands
            that build a group (redistribute, switch) get `rendezvous_bound_s` more.
        join_timeout_s: how long new workers have to announce themselves alive.
        heartbeat_interval_s / heartbeat_timeout_s: a worker whose heartbeat counter stays
            still for heartbeat_timeout_s is declared failed.
        max_attempts: runs of one batch, and rebuilds in a row, before giving up.
        load_window: EPLB window (steps) of recorded load that placements are planned from.
        threads_per_worker: torch threads in each worker.  host: the store's address.
    """

    spec: ModelSpec
    checkpoint: str
    max_slots_per_rank: int
    num_redundant: int = 0
    num_groups: int = 1
    collective_timeout_s: float = 10.0
    command_timeout_s: float = 60.0
    join_timeout_s: float = 120.0
    heartbeat_interval_s: float = 0.5
    heartbeat_timeout_s: float = 10.0
    max_attempts: int = 3
    load_window: int = 1000
    threads_per_worker: int = 1
    host: str = "127.0.0.1"

    def __post_init__(self) -> None:
        if not isinstance(self.spec, ModelSpec):
            raise TypeError(f"spec must be a ModelSpec, got {type(self.spec).__name__}")
        for name in ("max_slots_per_rank", "num_groups", "max_attempts", "load_window", "threads_per_worker"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        if isinstance(self.num_redundant, bool) or not isinstance(self.num_redundant, int) or self.num_redundant < 0:
            raise ValueError(f"num_redundant must be an int >= 0, got {self.num_redundant!r}")
        if self.spec.num_experts % self.num_groups:
            raise ValueError(f"num_groups={self.num_groups} must divide the number of experts {self.spec.num_experts}")
        for name in ("collective_timeout_s", "command_timeout_s", "join_timeout_s", "heartbeat_interval_s",
                     "heartbeat_timeout_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(f"{name} must be a number > 0, got {v!r}")
        if not Path(self.checkpoint).is_file():
            raise ValueError(f"checkpoint must be an existing safetensors file, got {self.checkpoint!r}")

    @property
    def rendezvous_bound_s(self) -> float:
        """The longest building a generation group can take: 6 x collective_timeout_s (see that field)."""
        return 6 * self.collective_timeout_s


@dataclass(frozen=True)
class StageEvent:
    """One stage of one transition.

    transition: the transition's id.  kind: "start", "scale_down", "scale_up", "replace" (as
    many members, some swapped), "recover" or "rollback".  stage: "prepare", "redistribute",
    "switch", "cleanup", or "detect" (a fault noticed).  start, end: time.monotonic().
    ok: whether the stage succeeded.  detail: what it did, or why it failed.
    """

    transition: int
    kind: str
    stage: str
    start: float
    end: float
    ok: bool
    detail: str

    @property
    def seconds(self) -> float:
        return self.end - self.start


@dataclass(frozen=True)
class TransitionReport:
    """The outcome of one transition.

    ok: the target world serves.  failed_stage, reason: where and why it failed (for a
    recovery, reason is the fault that caused it). members_after: the world serving now
    (the old one after a failed prepare or a rollback). counts: expert rows copied,
    received, messages and rows loaded from the checkpoint. events: its StageEvents.
    """

    transition: int
    kind: str
    ok: bool
    members_before: Tuple[str, ...]
    members_after: Tuple[str, ...]
    failed_stage: Optional[str] = None
    reason: str = ""
    counts: Dict[str, int] = field(default_factory=dict)
    events: Tuple[StageEvent, ...] = ()

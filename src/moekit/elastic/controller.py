"""The driver-side controller of elastic expert parallelism: stages, batches and faults.

The controller hosts the rendezvous store (groups.py), starts workers as separate processes
(multiprocessing "spawn", stable ids "w0", "w1", ...) and talks to each through its own pipe:
one command at a time, one Reply per command (worker.py). One pipe per worker rather than a
shared result queue, because a worker SIGKILLed while writing to a shared queue could leave
its lock held and wedge every other worker's replies, and because a closed pipe tells the
controller at once that the process is gone.

Serving. `submit(x)` (thread-safe) gives a batch an id and queues it; `serve()` runs queued
batches one at a time: the batch is split over the serving members in rank order (uneven
slices; a member may get 0 tokens: every member still joins the layers' collectives), each
member runs its slice through all layers, and the slices are put back together. A batch
completes exactly once (results[id], completion_log); a batch interrupted by a failure goes
back to the front of the queue and runs again on the rebuilt world; after max_attempts
failed runs the controller gives up with ElasticError rather than loop.

A planned transition (`transition`, `scale_down`, `scale_up`) goes through four stages, each
recorded as a StageEvent (stage, start, end, ok, detail) in `events`:
  1. prepare: the request is validated (plan.validate_request: unknown ids, an empty target,
     the capacity rule) before anything happens; the target is published in the store; new
     workers are started and must announce themselves alive within join_timeout_s while the
     old world keeps serving queued batches; the members report their recorded load and the
     plan is made (EPLB policy over the new number of ranks). A failure here changes nothing
     of the serving world: joiners are stopped and the report says why.
  2. redistribute: the union of old and new workers joins a transition generation and every
     worker fills its staging slots (worker.py; live weights untouched). Serving pauses from
     here to the end of the switch. On failure, if every old member is alive, they rebuild a
     generation over their untouched live weights and the old placement (a "rollback");
     otherwise the survivors rebuild without the dead (the fault path below).
  3. switch: every worker leaves the transition group; the members join the new generation
     and swap staged slots, placement and EPLB state in; the layers are rebuilt.
  4. cleanup: leaving workers are stopped and their processes joined.

Fault path. A worker is declared failed when its process exits or its pipe closes (seen at
once), when its heartbeat stops for heartbeat_timeout_s (a hung process), or when it does
not answer a command within command_timeout_s; it is then killed (fenced) so that it cannot
come back. Survivors blocked in a collective with it fail within collective_timeout_s (at
once for a killed peer: its sockets close). Between batches the members' liveness is
checked on every serve tick. The survivors then rebuild: a new placement over them, experts
that survive elsewhere moved by rearrangement, the others read from the checkpoint by their
new holders, and the interrupted batch runs again. Where that is impossible (no survivor,
too few survivors for the capacity rule, lost experts and an unreadable checkpoint) serve()
raises ElasticError naming why, and queued batches stay queued (`pending`).
"""

from __future__ import annotations

import logging
import multiprocessing
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.connection import wait as wait_connections
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ..parallel.placement import split_sizes
from .groups import MEMBERS_KEY, LivenessMonitor, alive_key, host_store, target_key
from .model import ModelSpec
from .plan import TransitionPlan, place, plan_transition, validate_request, world_problem
from .worker import Inspect, Redistribute, Reply, Report, Run, Stop, Switch, WorkerArgs, worker_main

__all__ = ["ElasticConfig", "ElasticController", "ElasticError", "StageEvent", "TransitionReport"]

log = logging.getLogger("moekit.elastic")
_POLL_S = 0.05


class ElasticError(RuntimeError):
    """The deployment cannot serve any more; the message names why."""


@dataclass(frozen=True)
class ElasticConfig:
    """How an elastic expert-parallel deployment runs.

    Fields:
        spec: the served model.  checkpoint: its safetensors file (model.write_checkpoint).
        max_slots_per_rank: expert slots one rank can hold (the capacity rule, plan.py).
        num_redundant: replicas beyond the E experts (R rounds E + this up to a multiple of P).
        num_groups: expert groups of the EPLB policy.
        collective_timeout_s: gloo timeout of every generation group: the longest a member
            waits on a dead or hung peer (and on a rendezvous).
        command_timeout_s: the longest the controller waits for a worker's reply.
        join_timeout_s: how long new workers have to announce themselves alive.
        heartbeat_interval_s / heartbeat_timeout_s: a worker whose heartbeat counter stays
            still for heartbeat_timeout_s is declared failed.
        max_attempts: runs of one batch (and rebuilds in a row) before giving up.
        load_window: EPLB window (steps) of recorded load used to plan placements.
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
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0:
                raise ValueError(f"{name} must be a number > 0, got {v!r}")
        if not Path(self.checkpoint).is_file():
            raise ValueError(f"checkpoint must be an existing safetensors file, got {self.checkpoint!r}")


@dataclass(frozen=True)
class StageEvent:
    """One stage of one transition: kind is "start", "scale_down", "scale_up", "replace", "recover" or "rollback"."""

    transition: int
    kind: str
    stage: str
    start: float  # time.monotonic()
    end: float
    ok: bool
    detail: str

    @property
    def seconds(self) -> float:
        return self.end - self.start


@dataclass(frozen=True)
class TransitionReport:
    """The outcome of a transition: ok, or the stage that failed and why (the serving world is `members_after`)."""

    transition: int
    kind: str
    ok: bool
    members_before: Tuple[str, ...]
    members_after: Tuple[str, ...]
    failed_stage: Optional[str] = None
    reason: str = ""
    counts: Dict[str, int] = field(default_factory=dict)
    events: Tuple[StageEvent, ...] = ()


@dataclass
class _Handle:
    process: multiprocessing.process.BaseProcess
    conn: object


class ElasticController:
    """Runs an elastic expert-parallel deployment from the driver process (see the module docstring).

    Args:
        config: ElasticConfig.
    """

    def __init__(self, config: ElasticConfig) -> None:
        if not isinstance(config, ElasticConfig):
            raise TypeError(f"config must be an ElasticConfig, got {type(config).__name__}")
        self.config = config
        spec = config.spec
        self._ctx = multiprocessing.get_context("spawn")
        self._store = host_store(config.host)
        self._liveness = LivenessMonitor(self._store, config.heartbeat_timeout_s, config.heartbeat_interval_s)
        self._workers: Dict[str, _Handle] = {}
        self._holdings: Dict[str, tuple] = {}
        self._load = torch.zeros(spec.num_layers, spec.num_experts, dtype=torch.float64)
        self._ids = {"worker": 0, "seq": 0, "generation": 0, "transition": 0, "batch": 0}
        self.members: Tuple[str, ...] = ()
        self.phy2log: Optional[tuple] = None
        self.generation: Optional[int] = None
        self.events: List[StageEvent] = []
        self.reports: List[TransitionReport] = []
        self.failed: Dict[str, str] = {}  # fenced worker -> why
        self._broken: Optional[str] = None
        self._lock = threading.Lock()
        self._pending: deque = deque()
        self._inputs: Dict[int, torch.Tensor] = {}
        self.results: Dict[int, torch.Tensor] = {}
        self.completion_log: List[int] = []
        self.attempts: Dict[int, int] = {}
        self.interrupted = 0
        self._running: Optional[int] = None

    # -- ids, events ---------------------------------------------------------------------
    def _next(self, kind: str) -> int:
        self._ids[kind] += 1
        return self._ids[kind] - 1

    def _event(self, tid: int, kind: str, stage: str, start: float, ok: bool, detail: str = "") -> StageEvent:
        ev = StageEvent(tid, kind, stage, start, time.monotonic(), ok, detail)
        self.events.append(ev)
        (log.info if ok else log.warning)("transition %d (%s) %s: %s in %.3f s%s", tid, kind, stage,
                                          "ok" if ok else "FAILED", ev.seconds, f": {detail}" if detail else "")
        return ev

    # -- workers -------------------------------------------------------------------------
    def _spawn(self) -> str:
        c, wid = self.config, f"w{self._next('worker')}"
        args = WorkerArgs(wid, c.host, self._store.port, c.spec, str(c.checkpoint), c.collective_timeout_s,
                          c.heartbeat_interval_s, c.load_window, c.threads_per_worker)
        mine, theirs = self._ctx.Pipe()
        p = self._ctx.Process(target=worker_main, args=(args, theirs), name=f"moekit-elastic-{wid}", daemon=True)
        p.start()
        theirs.close()
        self._workers[wid] = _Handle(p, mine)
        self._holdings[wid] = tuple(() for _ in range(c.spec.num_layers))
        return wid

    def worker_pid(self, worker: str) -> int:
        """The process id of a running worker."""
        if worker not in self._workers:
            raise ValueError(f"worker must be a running worker id {sorted(self._workers)}, got {worker!r}")
        return self._workers[worker].process.pid

    def _fence(self, worker: str, why: Optional[str]) -> None:
        """Forget a worker and make sure its process is gone: killed unless it exits within 5 s
        (a failed worker, why given, is killed at once: it must not come back)."""
        h = self._workers.pop(worker, None)
        if h is None:
            return
        if why is not None and h.process.is_alive():
            h.process.kill()
        h.process.join(timeout=5)
        if h.process.is_alive():
            h.process.kill()
            h.process.join(timeout=5)
        h.conn.close()
        self._liveness.forget(worker)
        if why is not None:
            self.failed[worker] = why
            log.warning("worker %s failed: %s", worker, why)

    def _exchange(self, commands: Dict[str, object], timeout_s: float) -> Tuple[Dict[str, Reply], Dict[str, str]]:
        """Send each worker its command, wait for the replies. Returns (replies, failed: worker -> why);
        failed workers (exited, pipe closed, heartbeat stopped, no reply in time) are fenced."""
        replies: Dict[str, Reply] = {}
        failed: Dict[str, str] = {}
        waiting: Dict[str, int] = {}
        for w, cmd in commands.items():
            h = self._workers.get(w)
            try:
                if h is None:
                    raise EOFError("not running")
                h.conn.send(cmd)
                waiting[w] = cmd.seq
            except (OSError, EOFError) as err:
                failed[w] = f"cannot send {type(cmd).__name__}: {err}"
        deadline = time.monotonic() + timeout_s
        while waiting:
            by_conn = {self._workers[w].conn: w for w in waiting}
            for conn in wait_connections(list(by_conn), timeout=_POLL_S):
                w = by_conn[conn]
                try:
                    reply = conn.recv()
                except (EOFError, OSError):
                    failed[w] = "its pipe closed (the process ended)"
                    del waiting[w]
                    continue
                if reply.seq == waiting[w]:  # older replies (of an abandoned command) are dropped
                    replies[w] = reply
                    self._holdings[w] = reply.holdings
                    del waiting[w]
            for w in list(waiting):
                h = self._workers[w]
                if not h.process.is_alive() and not h.conn.poll():
                    failed[w] = f"its process exited with code {h.process.exitcode}"
                    del waiting[w]
            for w in self._liveness.stale(list(waiting)):
                failed[w] = f"its heartbeat stopped for {self.config.heartbeat_timeout_s} s"
                del waiting[w]
            if waiting and time.monotonic() > deadline:
                name = type(next(iter(commands.values()))).__name__
                failed.update({w: f"no reply to {name} within {timeout_s} s" for w in waiting})
                waiting.clear()
        for w, why in failed.items():
            self._fence(w, why)
        return replies, failed

    def _command(self, cls, workers: Sequence[str], timeout_s: Optional[float] = None, **fields):
        return self._exchange({w: cls(seq=self._next("seq"), **fields) for w in workers},
                              self.config.command_timeout_s if timeout_s is None else timeout_s)

    # -- batches -------------------------------------------------------------------------
    def submit(self, x: torch.Tensor) -> int:
        """Queue a batch x [T, H] (any thread); returns its id. serve() runs it."""
        H = self.config.spec.hidden_size
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a torch.Tensor [T, H], got {type(x).__name__}")
        if x.dim() != 2 or x.shape[1] != H or not x.is_floating_point():
            raise ValueError(f"x must be a float tensor [T, H={H}], got {x.dtype} {tuple(x.shape)}")
        with self._lock:
            bid = self._next("batch")
            self._inputs[bid] = x.detach().cpu()
            self.attempts[bid] = 0
            self._pending.append(bid)
        return bid

    @property
    def pending(self) -> int:
        """Batches queued (not yet completed, not running)."""
        return len(self._pending)

    @property
    def in_flight(self) -> Optional[int]:
        """The id of the batch being run now, or None."""
        return self._running

    @property
    def submitted(self) -> int:
        return self._ids["batch"]

    def _run_next(self) -> None:
        with self._lock:
            bid = self._pending.popleft()
            x = self._inputs[bid]
        self.attempts[bid] += 1
        members = self.members
        parts = torch.split(x, split_sizes(x.shape[0], len(members)))
        cmds = {w: Run(self._next("seq"), self.generation, bid, part.float().numpy()) for w, part in zip(members, parts)}
        self._running = bid
        try:
            replies, failed = self._exchange(cmds, self.config.command_timeout_s)
        finally:
            self._running = None
        errors = {w: r.error for w, r in replies.items() if not r.ok}
        if not failed and not errors:
            out = torch.cat([torch.from_numpy(replies[w].value) for w in members]).to(x.dtype)
            if bid in self.results:
                raise RuntimeError(f"batch {bid} completed twice")  # an invariant of the queue, never expected
            self.results[bid] = out
            self.completion_log.append(bid)
            with self._lock:
                del self._inputs[bid]
            return
        with self._lock:
            self._pending.appendleft(bid)
        self.interrupted += 1
        why = "; ".join([f"{w} failed: {m}" for w, m in failed.items()] + [f"{w}: {m}" for w, m in errors.items()])
        if self.attempts[bid] >= self.config.max_attempts:
            self._broken = f"batch {bid} failed {self.attempts[bid]} times; last: {why}"
            raise ElasticError(self._broken)
        self._recover(f"batch {bid} interrupted ({why})")

    def _require_serving(self) -> None:
        if self._broken is not None:
            raise ElasticError(self._broken)
        if self.generation is None:
            raise ElasticError("no world is serving: call start() first")

    def _tick(self) -> bool:
        """One unit of serving: detect failed members, then run one queued batch. Returns whether one ran."""
        dead = {w: f"its process exited with code {self._workers[w].process.exitcode}" for w in self.members
                if w in self._workers and not self._workers[w].process.is_alive()}
        dead.update({w: f"its heartbeat stopped for {self.config.heartbeat_timeout_s} s"
                     for w in self._liveness.stale(self.members)})
        for w, why in dead.items():
            self._fence(w, why)
        gone = [w for w in self.members if w not in self._workers]
        if gone:
            self._recover("; ".join(f"{w} failed: {self.failed.get(w, 'unknown')}" for w in gone))
        if not self._pending:
            return False
        self._run_next()
        return True

    def serve(self, until: Optional[Callable[[], bool]] = None, timeout_s: float = 600.0) -> None:
        """Run queued batches until `until()` is true (default: until none is queued), recovering from faults.

        Raises TimeoutError after timeout_s, ElasticError when the deployment cannot serve.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            self._require_serving()
            if (until() if until is not None else not self._pending):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"serve: still not done after {timeout_s} s ({len(self._pending)} batches queued)")
            if not self._tick():
                time.sleep(_POLL_S / 5)

    # -- stages --------------------------------------------------------------------------
    def _await_alive(self, joiners: Sequence[str], timeout_s: float, serve: bool) -> Optional[str]:
        """Wait for joiners' announcements (serving queued batches meanwhile). Returns why it failed, or None."""
        deadline, waiting = time.monotonic() + timeout_s, set(joiners)
        while True:
            for w in sorted(waiting):
                h = self._workers[w]
                if self._store.check([alive_key(w)]):
                    waiting.discard(w)
                    self._liveness.watch(w)
                elif not h.process.is_alive():
                    return f"joiner {w} exited with code {h.process.exitcode} before announcing itself"
            if not waiting:
                return None
            if time.monotonic() > deadline:
                return f"joiners {sorted(waiting)} did not announce themselves alive within {timeout_s} s"
            if not (serve and self._tick()):
                time.sleep(_POLL_S / 5)

    def _plan(self, members: Sequence[str], helpers: Sequence[str] = ()) -> TransitionPlan:
        c = self.config
        holdings = {w: self._holdings[w] for w in tuple(members) + tuple(helpers)}
        phy2log = place(self._load, len(members), num_redundant=c.num_redundant, num_groups=c.num_groups,
                        holdings=[holdings[w] for w in members])
        return plan_transition(holdings, members, phy2log, helpers)

    def _collect_load(self) -> Optional[str]:
        """Sum the members' recorded load into the planning load. Returns why it failed, or None."""
        replies, failed = self._command(Report, self.members)
        if failed:
            return "; ".join(f"{w} failed: {m}" for w, m in failed.items())
        load = sum(torch.from_numpy(r.value).double() for r in replies.values())
        if float(load.sum()) > 0:
            self._load = load
        return None

    def _apply(self, tid: int, kind: str, plan: TransitionPlan) -> Tuple[bool, str, str]:
        """Redistribute and switch to `plan`. Returns (ok, failed stage, why)."""
        self.generation = None
        t0 = time.monotonic()
        gen = self._next("generation")
        replies, failed = self._exchange(
            {w: Redistribute(self._next("seq"), gen, len(plan.union), plan.workers[w]) for w in plan.union},
            self.config.command_timeout_s)
        why = _failures(failed, replies)
        self._event(tid, kind, "redistribute", t0, not why, why or f"{plan.counts()} over {len(plan.union)} workers")
        if why:
            return False, "redistribute", why
        t0 = time.monotonic()
        gen, P = self._next("generation"), len(plan.members)
        replies, failed = self._exchange(
            {w: Switch(self._next("seq"), gen, u if u < P else None, P, plan.phy2log, True)
             for u, w in enumerate(plan.union)}, self.config.command_timeout_s)
        why = _failures(failed, replies)
        self._event(tid, kind, "switch", t0, not why, why or f"generation {gen}: {list(plan.members)}")
        if why:
            return False, "switch", why
        self.members, self.phy2log, self.generation = plan.members, plan.phy2log, gen
        self._store.set(MEMBERS_KEY, f"{gen}:{','.join(plan.members)}")
        return True, "", ""

    def _rejoin(self, tid: int, members: Sequence[str], phy2log) -> bool:
        """Rebuild a generation over the members' untouched live weights (a rollback)."""
        t0, gen, P = time.monotonic(), self._next("generation"), len(members)
        replies, failed = self._exchange(
            {w: Switch(self._next("seq"), gen, r, P, phy2log, False) for r, w in enumerate(members)},
            self.config.command_timeout_s)
        why = _failures(failed, replies)
        self._event(tid, "rollback", "switch", t0, not why, why or f"generation {gen}: {list(members)}")
        if why:
            return False
        self.members, self.phy2log, self.generation = tuple(members), phy2log, gen
        self._store.set(MEMBERS_KEY, f"{gen}:{','.join(members)}")
        return True

    def _cleanup(self, tid: int, kind: str, leaving: Sequence[str]) -> None:
        """Stop the running workers of `leaving` that are not members, and join their processes."""
        t0 = time.monotonic()
        leaving = [w for w in leaving if w in self._workers and w not in self.members]
        self._command(Stop, leaving, timeout_s=min(10.0, self.config.command_timeout_s))
        for w in leaving:
            self._fence(w, None)
        self._event(tid, kind, "cleanup", t0, True, f"stopped {leaving}" if leaving else "")

    def _rebuild(self, tid: int, kind: str, candidates: Sequence[str], reason: str) -> TransitionPlan:
        """Make the running `candidates` the serving world (moving or reloading experts); ElasticError if impossible."""
        c, E = self.config, self.config.spec.num_experts
        for _ in range(c.max_attempts):
            members = [w for w in candidates if w in self._workers]
            helpers = [w for w in self._workers if w not in members and any(self._holdings[w])]
            if not members:
                self._broken = f"{reason}; no worker is left to serve"
                raise ElasticError(self._broken)
            problem = world_problem(E, c.num_redundant, len(members), c.max_slots_per_rank)
            if problem is not None:
                self._broken = f"{reason}; cannot rebuild on the {len(members)} surviving workers {members}: {problem}"
                raise ElasticError(self._broken)
            plan = self._plan(members, helpers)
            if plan.counts()["loaded"] and not Path(c.checkpoint).is_file():
                self._broken = (f"{reason}; some experts have no surviving copy and the checkpoint "
                                f"{c.checkpoint} cannot be read")
                raise ElasticError(self._broken)
            ok, stage, why = self._apply(tid, kind, plan)
            if ok:
                self._cleanup(tid, kind, helpers)
                return plan
            reason = f"{reason}; then {stage} failed: {why}"
        self._broken = f"rebuilding failed {c.max_attempts} times in a row: {reason}"
        raise ElasticError(self._broken)

    def _recover(self, reason: str) -> None:
        """The fault path: the running members rebuild without the failed ones."""
        tid, now = self._next("transition"), time.monotonic()
        self._event(tid, "recover", "detect", now, True, reason)
        before = self.members
        plan = self._rebuild(tid, "recover", list(self.members), reason)
        self._report(tid, "recover", True, before, None, reason, plan.counts())

    # -- public transitions --------------------------------------------------------------
    def start(self, num_workers: int) -> TransitionReport:
        """Start num_workers workers and the first generation (experts read from the checkpoint)."""
        c = self.config
        if self.members or self._broken:
            raise RuntimeError("start() runs once, on a new controller")
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
            raise ValueError(f"num_workers must be an int >= 1, got {num_workers!r}")
        problem = world_problem(c.spec.num_experts, c.num_redundant, num_workers, c.max_slots_per_rank)
        if problem is not None:
            raise ValueError(f"num_workers={num_workers} refused: {problem}")
        tid, t0 = self._next("transition"), time.monotonic()
        workers = [self._spawn() for _ in range(num_workers)]
        why = self._await_alive(workers, c.join_timeout_s, serve=False)
        self._event(tid, "start", "prepare", t0, why is None, why or "")
        ok, stage, why = (False, "prepare", why) if why else self._apply(tid, "start", self._plan(workers))
        if not ok:
            for w in list(self._workers):
                self._fence(w, f"start failed in {stage}")
            self._broken = f"start failed in {stage}: {why}"
            raise ElasticError(self._broken)
        self._cleanup(tid, "start", ())
        return self._report(tid, "start", True, (), None, "")

    def transition(self, keep: Sequence[str], add: int = 0, *, join_timeout_s: Optional[float] = None,
                   kind: Optional[str] = None) -> TransitionReport:
        """Change the serving world to `keep` (members that stay, in their new rank order) plus `add` new workers.

        Invalid requests raise ValueError/TypeError before anything changes. A failed
        transition returns ok=False with the failed stage and the reason; the serving world
        is then the old one (failure in prepare, or a rollback) or the survivors'.
        """
        self._require_serving()
        c = self.config
        keep = validate_request(self.members, keep, add, num_experts=c.spec.num_experts,
                                num_redundant=c.num_redundant, max_slots_per_rank=c.max_slots_per_rank)
        kind = kind or ("scale_up" if len(keep) + add > len(self.members) else
                        "scale_down" if len(keep) + add < len(self.members) else "replace")
        timeout = c.join_timeout_s if join_timeout_s is None else join_timeout_s
        tid, t0, before = self._next("transition"), time.monotonic(), self.members
        self._store.set(target_key(tid), ",".join(keep) + f"+{add}")
        joiners = [self._spawn() for _ in range(add)]
        try:
            why = self._await_alive(joiners, timeout, serve=True)
            lost = [w for w in keep if w not in self.members]
            why = why or (f"members {lost} failed while preparing" if lost else None) or self._collect_load()
        except BaseException:
            for w in joiners:
                self._fence(w, "the transition was abandoned")
            raise
        plan = None if why else self._plan(keep + tuple(joiners), [w for w in self.members if w not in keep])
        self._event(tid, kind, "prepare", t0, why is None, why or f"target {list(plan.members)}")
        if why:
            for w in joiners:
                self._fence(w, f"prepare failed: {why}")
            return self._report(tid, kind, False, before, "prepare", why)
        old_members, old_phy2log = self.members, self.phy2log
        ok, stage, why = self._apply(tid, kind, plan)
        if ok:
            self._cleanup(tid, kind, plan.union)
            return self._report(tid, kind, True, before, None, "", plan.counts())
        if stage == "redistribute" and all(w in self._workers for w in old_members) and \
                self._rejoin(tid, old_members, old_phy2log):
            self._cleanup(tid, "rollback", joiners)
        else:
            self._rebuild(tid, "recover", old_members if stage == "redistribute" else plan.members, why)
            self._cleanup(tid, "recover", plan.union)
        return self._report(tid, kind, False, before, stage, why)

    def scale_down(self, leave: Sequence[str]) -> TransitionReport:
        """Remove the workers `leave` (their experts are handed over before they exit)."""
        if isinstance(leave, str) or not isinstance(leave, Sequence):
            raise TypeError(f"leave must be a sequence of worker ids, got {leave!r}")
        unknown = [w for w in leave if w not in self.members]
        if unknown:
            raise ValueError(f"leave names unknown worker ids {unknown}; the serving members are {list(self.members)}")
        return self.transition([w for w in self.members if w not in leave], 0, kind="scale_down")

    def scale_up(self, add: int, *, join_timeout_s: Optional[float] = None) -> TransitionReport:
        """Start `add` new workers and make them members (they receive their experts from the others)."""
        return self.transition(self.members, add, join_timeout_s=join_timeout_s, kind="scale_up")

    def _report(self, tid, kind, ok, before, stage, why, counts=None) -> TransitionReport:
        report = TransitionReport(tid, kind, ok, tuple(before), self.members, stage, why, dict(counts or {}),
                                  tuple(e for e in self.events if e.transition == tid))
        self.reports.append(report)
        return report

    # -- inspection, shutdown ------------------------------------------------------------
    def inspect(self) -> Dict[str, dict]:
        """Every member's rank, holdings ([L][S] experts) and slot bytes (per layer, name -> uint8 [S, n])."""
        self._require_serving()
        replies, failed = self._command(Inspect, self.members)
        why = _failures(failed, replies)
        if why:
            raise RuntimeError(f"inspect failed: {why}")
        return {w: dict(rank=r, **replies[w].value) for r, w in enumerate(self.members)}

    def shutdown(self) -> None:
        """Stop every worker (bounded) and close the store. Idempotent."""
        self._command(Stop, list(self._workers), timeout_s=5.0)
        for w in list(self._workers):
            self._fence(w, None)
        self.generation = None
        self._broken = self._broken or "the controller was shut down"

    def __enter__(self) -> "ElasticController":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def _failures(failed: Dict[str, str], replies: Dict[str, Reply]) -> str:
    """One line naming every failed worker and every error reply ("" when all went well)."""
    parts = [f"{w} failed: {m}" for w, m in failed.items()]
    parts += [f"{w}: {r.error}" for w, r in replies.items() if not r.ok]
    return "; ".join(parts)

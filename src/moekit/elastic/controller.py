"""The driver-side controller of elastic expert parallelism: stages, serving and the fault path.

The controller hosts the rendezvous store (groups.py), runs the workers (pool.py, worker.py)
and owns the serving world: its members in rank order, its placement and its generation.

Serving. `submit(x)` (any thread) queues a batch under an id (batches.py); `serve()` runs
queued batches one at a time: the batch is split over the members in rank order (uneven
slices; a member may get 0 tokens and still joins the layers' collectives), each member
runs its slice through all layers, and the slices are put back together. A batch completes
exactly once; one interrupted by a failure goes back to the front of the queue and runs
again on the rebuilt world; after max_attempts failed runs the batch leaves the queue
(`batch_errors`) and serve() raises BatchFailed, the world rebuilt to serve the rest.

A planned transition (`transition`, `scale_down`, `scale_up`) has four stages, each recorded
as a StageEvent in `events` (and logged on the "moekit.elastic" logger):
  1. prepare: the request is validated before anything happens (plan.validate_request:
     unknown ids, an empty target, the capacity rule); the target is published in the
     store; new workers are started and must announce themselves alive within the join
     timeout while the old world keeps serving queued batches; the members report their
     recorded load and the plan is made (EPLB policy over the new number of ranks). A
     failure here leaves the serving world untouched; joiners are stopped.
  2. redistribute: old and new workers join a transition generation and fill their staging
     slots (worker.py; live weights only read). Serving pauses from here to the end of the
     switch: a worker holds one process group at a time (groups.py), so the old group ends
     when the transition group starts. On failure, if every old member is alive they
     rebuild a generation over their untouched live weights and the old placement (a
     "rollback": the old world serves again, in a new group); otherwise the survivors
     rebuild without the dead, as on the fault path. A member that vanishes in the middle
     of the rendezvous holds the others up to ElasticConfig.rendezvous_bound_s (gloo
     retries the connection), so group-building commands are waited for that much longer.
  3. switch: every worker leaves the transition group; the members join the new generation
     and swap in the staged slots, the new placement and a new EPLB state.
  4. cleanup: leaving workers are stopped and their processes joined.

Fault path. Failures are noticed while waiting for replies and, between batches, on every
serve tick (pool.py: process exit and closed pipes at once, a stopped heartbeat after
heartbeat_timeout_s, a missing reply after command_timeout_s). Survivors blocked in a
collective with a dead peer fail within collective_timeout_s (at once for a killed peer:
its sockets close). The survivors then rebuild: a new placement over them, experts that
survive elsewhere moved by rearrangement, the others read from the checkpoint by their new
holders. Where that is impossible (no survivor, too few survivors for the capacity rule,
lost experts and an unreadable checkpoint) ElasticError names why, and queued batches stay
queued (`pending`).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ..parallel.placement import split_sizes
from .batches import BatchQueue
from .config import BatchFailed, ElasticConfig, ElasticError, StageEvent, TransitionReport
from .groups import MEMBERS_KEY, host_store, target_key
from .plan import TransitionPlan, place, plan_transition, validate_request, world_problem
from .pool import POLL_S, WorkerPool, failures
from .worker import Inspect, Redistribute, Report, Run, Stop, Switch

__all__ = ["ElasticController"]

log = logging.getLogger("moekit.elastic")


def _check_seconds(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name} must be a number of seconds > 0, got {value!r}")


class ElasticController:
    """Runs an elastic expert-parallel deployment from the driver process (see the module docstring).

    Args:
        config: ElasticConfig.
    Attributes:
        members: the serving world's worker ids, in rank order.  phy2log: its placement [L][R].
        generation: its generation number (None while no world serves).
        events: every StageEvent.  reports: every TransitionReport.  batches: the BatchQueue.
    """

    def __init__(self, config: ElasticConfig) -> None:
        if not isinstance(config, ElasticConfig):
            raise TypeError(f"config must be an ElasticConfig, got {type(config).__name__}")
        self.config = config
        self._group_timeout_s = config.command_timeout_s + config.rendezvous_bound_s
        self._store = host_store(config.host)
        self.pool = WorkerPool(config, self._store)
        self.batches = BatchQueue(config.spec.hidden_size)
        self._load = torch.zeros(config.spec.num_layers, config.spec.num_experts, dtype=torch.float64)
        self._generation_ids = 0
        self._transition_ids = 0
        self.members: Tuple[str, ...] = ()
        self.phy2log: Optional[tuple] = None
        self.generation: Optional[int] = None
        self.events: List[StageEvent] = []
        self.reports: List[TransitionReport] = []
        self._broken: Optional[str] = None

    # -- views ---------------------------------------------------------------------------
    @property
    def results(self) -> Dict[int, torch.Tensor]:
        return self.batches.results

    @property
    def completion_log(self) -> List[int]:
        return self.batches.completion_log

    @property
    def pending(self) -> int:
        return self.batches.pending

    @property
    def submitted(self) -> int:
        return self.batches.submitted

    @property
    def in_flight(self) -> Optional[int]:
        return self.batches.in_flight

    @property
    def interrupted(self) -> int:
        return self.batches.interrupted

    @property
    def failed(self) -> Dict[str, str]:
        return self.pool.failed

    @property
    def batch_errors(self) -> Dict[int, str]:
        """Batches dropped after max_attempts failed runs: id -> the last failure."""
        return self.batches.errors

    @property
    def workers(self) -> Tuple[str, ...]:
        """Ids of every running worker process (members, joiners, leavers not yet stopped)."""
        return self.pool.running

    def worker_pid(self, worker: str) -> int:
        return self.pool.pid(worker)

    def submit(self, x: torch.Tensor) -> int:
        """Queue a copy of the batch x [T, H] (from any thread); returns its id. serve() runs it.

        Raises ElasticError once the deployment cannot serve (shut down, or given up)."""
        if self._broken is not None:
            raise ElasticError(f"cannot take batches: {self._broken}")
        return self.batches.submit(x)

    # -- bookkeeping ---------------------------------------------------------------------
    def _new_generation(self) -> int:
        self._generation_ids += 1
        return self._generation_ids

    def _new_transition(self) -> int:
        self._transition_ids += 1
        return self._transition_ids - 1

    def _event(self, tid: int, kind: str, stage: str, start: float, ok: bool, detail: str = "") -> None:
        ev = StageEvent(tid, kind, stage, start, time.monotonic(), ok, detail)
        self.events.append(ev)
        (log.info if ok else log.warning)("transition %d (%s) %s: %s in %.3f s%s", tid, kind, stage,
                                          "ok" if ok else "FAILED", ev.seconds, f": {detail}" if detail else "")

    def _report(self, tid, kind, ok, before, stage, why, counts=None) -> TransitionReport:
        report = TransitionReport(tid, kind, ok, tuple(before), self.members, stage, why, dict(counts or {}),
                                  tuple(e for e in self.events if e.transition == tid))
        self.reports.append(report)
        return report

    def _fail(self, why: str) -> None:
        self._broken = why
        raise ElasticError(why)

    def _require_serving(self) -> None:
        if self._broken is not None:
            raise ElasticError(self._broken)
        if self.generation is None:
            raise ElasticError("no world is serving: call start() first")

    def _serving_world(self, plan_or_members, phy2log, gen: int) -> None:
        self.members, self.phy2log, self.generation = tuple(plan_or_members), phy2log, gen
        self._store.set(MEMBERS_KEY, f"{gen}:{','.join(self.members)}")

    # -- serving -------------------------------------------------------------------------
    def _run_next(self) -> None:
        bid, x = self.batches.next()
        members = self.members
        parts = torch.split(x, split_sizes(x.shape[0], len(members)))
        seq = self.pool.next_seq
        replies, failed = self.pool.exchange(
            {w: Run(seq(), self.generation, bid, part.float().numpy()) for w, part in zip(members, parts)},
            self.config.command_timeout_s)
        why = failures(failed, replies)
        if not why:
            self.batches.complete(bid, torch.cat([torch.from_numpy(replies[w].value) for w in members]).to(x.dtype))
            return
        if self.batches.attempts[bid] >= self.config.max_attempts:
            # The batch, not the world, is the likely cause: drop it, rebuild, serve the rest.
            self.batches.give_up(bid, why)
            self._recover(f"batch {bid} failed {self.batches.attempts[bid]} times ({why})")
            raise BatchFailed(bid, why)
        self.batches.requeue(bid)
        self._recover(f"batch {bid} interrupted ({why})")

    def _tick(self) -> bool:
        """One unit of serving: rebuild around failed members, then run one queued batch. Returns whether one ran."""
        self.pool.check(self.members)
        gone = [w for w in self.members if w not in self.pool.running]
        if gone:
            self._recover("; ".join(f"{w} failed: {self.pool.failed.get(w, 'it stopped')}" for w in gone))
        if not self.batches.pending:
            return False
        self._run_next()
        return True

    def serve(self, until: Optional[Callable[[], bool]] = None, timeout_s: float = 600.0) -> None:
        """Run queued batches until `until()` is true (default: until none is queued), recovering from faults.

        Raises TimeoutError once timeout_s has passed, ElasticError when the deployment cannot
        serve, BatchFailed when a batch failed max_attempts runs (it is dropped; call serve()
        again for the rest). The deadline is checked between batches: a batch in flight runs to its end, or to
        ElasticConfig.command_timeout_s and the rebuild after it, first.
        """
        if until is not None and not callable(until):
            raise TypeError(f"until must be a callable returning bool, or None, got {until!r}")
        _check_seconds("timeout_s", timeout_s)
        deadline = time.monotonic() + timeout_s
        while True:
            self._require_serving()
            if until() if until is not None else not self.batches.pending:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"serve: not done after {timeout_s} s ({self.batches.pending} batches queued)")
            if not self._tick():
                time.sleep(POLL_S / 5)

    # -- stages --------------------------------------------------------------------------
    def _await_alive(self, joiners: Sequence[str], timeout_s: float, serve: bool) -> Optional[str]:
        """Wait for the joiners' announcements, serving queued batches meanwhile. Returns why it failed, or None."""
        deadline, waiting = time.monotonic() + timeout_s, set(joiners)
        while True:
            for w in sorted(waiting):
                state = self.pool.announced(w)
                if state is None:
                    return f"joiner {w} exited with code {self.pool.exit_code(w)} before announcing itself"
                if state:
                    waiting.discard(w)
            if not waiting:
                return None
            if time.monotonic() > deadline:
                return f"joiners {sorted(waiting)} did not announce themselves alive within {timeout_s} s"
            if not (serve and self._tick()):
                time.sleep(POLL_S / 5)

    def _collect_load(self) -> Optional[str]:
        """Sum the members' recorded load into the planning load. Returns why it failed, or None."""
        replies, failed = self.pool.command(Report, self.members)
        if failed:
            return failures(failed, {})
        load = sum(torch.from_numpy(r.value).double() for r in replies.values())
        if float(load.sum()) > 0:  # a fresh world has recorded nothing yet: keep the last load
            self._load = load
        return None

    def _plan(self, members: Sequence[str], helpers: Sequence[str] = ()) -> TransitionPlan:
        c = self.config
        holdings = {w: self.pool.holdings[w] for w in tuple(members) + tuple(helpers)}
        phy2log = place(self._load, len(members), num_redundant=c.num_redundant, num_groups=c.num_groups,
                        holdings=[holdings[w] for w in members])
        return plan_transition(holdings, members, phy2log, helpers)

    def _apply(self, tid: int, kind: str, plan: TransitionPlan) -> Tuple[bool, str, str]:
        """Stages 2 and 3: redistribute into staging, then switch. Returns (ok, failed stage, why)."""
        self.generation = None
        t0, gen, seq = time.monotonic(), self._new_generation(), self.pool.next_seq
        replies, failed = self.pool.exchange(
            {w: Redistribute(seq(), gen, len(plan.union), plan.workers[w]) for w in plan.union}, self._group_timeout_s)
        why = failures(failed, replies)
        self._event(tid, kind, "redistribute", t0, not why, why or f"{plan.counts()} over {len(plan.union)} workers")
        if why:
            return False, "redistribute", why
        t0, gen, P = time.monotonic(), self._new_generation(), len(plan.members)
        replies, failed = self.pool.exchange(
            {w: Switch(seq(), gen, u if u < P else None, P, plan.phy2log, True) for u, w in enumerate(plan.union)},
            self._group_timeout_s)
        why = failures(failed, replies)
        self._event(tid, kind, "switch", t0, not why, why or f"generation {gen}: {list(plan.members)}")
        if why:
            return False, "switch", why
        self._serving_world(plan.members, plan.phy2log, gen)
        return True, "", ""

    def _rollback(self, tid: int, members: Sequence[str], phy2log) -> bool:
        """Rebuild a generation over the members' untouched live weights and placement."""
        t0, gen, P = time.monotonic(), self._new_generation(), len(members)
        replies, failed = self.pool.exchange(
            {w: Switch(self.pool.next_seq(), gen, r, P, phy2log, False) for r, w in enumerate(members)},
            self._group_timeout_s)
        why = failures(failed, replies)
        self._event(tid, "rollback", "switch", t0, not why, why or f"generation {gen}: {list(members)}")
        if not why:
            self._serving_world(members, phy2log, gen)
        return not why

    def _cleanup(self, tid: int, kind: str, leaving: Sequence[str]) -> None:
        """Stage 4: stop the running workers of `leaving` that are not members and join their processes."""
        t0 = time.monotonic()
        leaving = [w for w in leaving if w in self.pool.running and w not in self.members]
        self.pool.command(Stop, leaving, timeout_s=min(10.0, self.config.command_timeout_s))
        for w in leaving:
            self.pool.fence(w, None)
        self._event(tid, kind, "cleanup", t0, True, f"stopped {leaving}" if leaving else "")

    def _rebuild(self, tid: int, kind: str, candidates: Sequence[str], reason: str) -> TransitionPlan:
        """Make the running `candidates` the serving world, moving or reloading experts; ElasticError if impossible."""
        c = self.config
        for _ in range(c.max_attempts):
            members = [w for w in candidates if w in self.pool.running]
            helpers = [w for w in self.pool.running if w not in members and any(self.pool.holdings[w])]
            if not members:
                self._fail(f"{reason}; no worker is left to serve")
            problem = world_problem(c.spec.num_experts, c.num_redundant, len(members), c.max_slots_per_rank)
            if problem is not None:
                self._fail(f"{reason}; cannot rebuild on the {len(members)} surviving workers {members}: {problem}")
            plan = self._plan(members, helpers)
            if plan.counts()["loaded"] and not Path(c.checkpoint).is_file():
                self._fail(f"{reason}; some experts have no surviving copy and the checkpoint {c.checkpoint} "
                           "cannot be read")
            ok, stage, why = self._apply(tid, kind, plan)
            if ok:
                self._cleanup(tid, kind, helpers)
                return plan
            reason = f"{reason}; then {stage} failed: {why}"
        self._fail(f"rebuilding failed {c.max_attempts} times in a row: {reason}")

    def _recover(self, reason: str) -> None:
        """The fault path: the running members rebuild without the failed ones."""
        tid, before = self._new_transition(), self.members
        self._event(tid, "recover", "detect", time.monotonic(), True, reason)
        plan = self._rebuild(tid, "recover", list(self.members), reason)
        self._report(tid, "recover", True, before, None, reason, plan.counts())

    # -- public transitions --------------------------------------------------------------
    def start(self, num_workers: int) -> TransitionReport:
        """Start num_workers workers and the first generation (every expert read from the checkpoint)."""
        c = self.config
        if self.members or self._broken:
            raise RuntimeError("start() runs once, on a new controller")
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
            raise ValueError(f"num_workers must be an int >= 1, got {num_workers!r}")
        problem = world_problem(c.spec.num_experts, c.num_redundant, num_workers, c.max_slots_per_rank)
        if problem is not None:
            raise ValueError(f"num_workers={num_workers} refused: {problem}")
        tid, t0 = self._new_transition(), time.monotonic()
        workers = [self.pool.spawn() for _ in range(num_workers)]
        why = self._await_alive(workers, c.join_timeout_s, serve=False)
        self._event(tid, "start", "prepare", t0, why is None, why or f"started {workers}")
        ok, stage, why = (False, "prepare", why) if why else self._apply(tid, "start", self._plan(workers))
        if not ok:
            for w in self.pool.running:
                self.pool.fence(w, f"start failed in {stage}")
            self._fail(f"start failed in {stage}: {why}")
        self._cleanup(tid, "start", ())
        return self._report(tid, "start", True, (), None, "")

    def transition(self, keep: Sequence[str], add: int = 0, *,
                   join_timeout_s: Optional[float] = None) -> TransitionReport:
        """Change the serving world to `keep` (members that stay, in their new rank order) plus `add` new workers.

        Invalid requests raise ValueError or TypeError before anything changes. A failed
        transition returns a report with ok=False, the failed stage and the reason; the
        serving world is then the old one (prepare failed, or a rollback) or the survivors'.
        """
        self._require_serving()
        c = self.config
        keep = validate_request(self.members, keep, add, num_experts=c.spec.num_experts,
                                num_redundant=c.num_redundant, max_slots_per_rank=c.max_slots_per_rank)
        if join_timeout_s is not None:
            _check_seconds("join_timeout_s", join_timeout_s)
        P = len(keep) + add
        kind = "scale_up" if P > len(self.members) else "scale_down" if P < len(self.members) else "replace"
        tid, t0, before = self._new_transition(), time.monotonic(), self.members
        self._store.set(target_key(tid), ",".join(keep) + f"+{add}")
        joiners = [self.pool.spawn() for _ in range(add)]
        try:
            why = self._await_alive(joiners, c.join_timeout_s if join_timeout_s is None else join_timeout_s, True)
            lost = [w for w in keep if w not in self.members]
            why = why or (f"members {lost} failed while preparing" if lost else None) or self._collect_load()
        except BaseException:
            for w in joiners:
                self.pool.fence(w, "the transition was abandoned")
            raise
        plan = None if why else self._plan(keep + tuple(joiners), [w for w in self.members if w not in keep])
        self._event(tid, kind, "prepare", t0, why is None, why or f"target {list(plan.members)}")
        if why:
            for w in joiners:
                self.pool.fence(w, f"prepare failed: {why}")
            if any(w not in self.pool.running for w in self.members):  # a member failed to report its load
                self._recover(why)
            return self._report(tid, kind, False, before, "prepare", why)
        old_members, old_phy2log = self.members, self.phy2log
        ok, stage, why = self._apply(tid, kind, plan)
        if ok:
            self._cleanup(tid, kind, plan.union)
            return self._report(tid, kind, True, before, None, "", plan.counts())
        if stage == "redistribute" and all(w in self.pool.running for w in old_members) and \
                self._rollback(tid, old_members, old_phy2log):
            self._cleanup(tid, "rollback", joiners)
        else:
            self._rebuild(tid, "recover", old_members if stage == "redistribute" else plan.members, why)
            self._cleanup(tid, "recover", plan.union)
        return self._report(tid, kind, False, before, stage, why)

    def scale_down(self, leave: Sequence[str]) -> TransitionReport:
        """Remove the members `leave`; they hand their experts over before they exit."""
        if isinstance(leave, str) or not isinstance(leave, Sequence):
            raise TypeError(f"leave must be a sequence of worker ids, got {leave!r}")
        unknown = [w for w in leave if w not in self.members]
        if unknown:
            raise ValueError(f"leave names unknown worker ids {unknown}; the serving members are {list(self.members)}")
        return self.transition([w for w in self.members if w not in leave], 0)

    def scale_up(self, add: int, *, join_timeout_s: Optional[float] = None) -> TransitionReport:
        """Start `add` new workers and make them members; they receive their experts from the others."""
        return self.transition(self.members, add, join_timeout_s=join_timeout_s)

    # -- inspection, shutdown ------------------------------------------------------------
    def inspect(self) -> Dict[str, dict]:
        """Per member: its rank, holdings ([L][S] experts) and slot bytes (per layer, name -> uint8 [S, n])."""
        self._require_serving()
        replies, failed = self.pool.command(Inspect, self.members)
        why = failures(failed, replies)
        if why:
            raise RuntimeError(f"inspect failed: {why}")
        return {w: dict(rank=r, **replies[w].value) for r, w in enumerate(self.members)}

    def shutdown(self) -> None:
        """Stop every worker (bounded waits) and end serving. Idempotent."""
        self.pool.command(Stop, self.pool.running, timeout_s=5.0)
        for w in self.pool.running:
            self.pool.fence(w, None)
        self.generation = None
        self._broken = self._broken or "the controller was shut down"

    def __enter__(self) -> "ElasticController":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

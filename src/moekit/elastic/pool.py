"""The worker processes of an elastic deployment and the pipes to them.

Workers are started with multiprocessing's "spawn" context and get stable ids "w0", "w1",
... in start order. Each has its own pipe: one command at a time, one Reply per command
(worker.py). One pipe per worker rather than one shared result queue, because a worker
SIGKILLed while writing to a shared queue can leave the queue's lock held and wedge every
other worker's replies, and because a closed pipe tells the controller at once that its
process is gone.

A worker is declared failed when its process exits or its pipe closes (seen at once), when
its heartbeat stops for the heartbeat timeout (a hung process), or when it does not answer
a command in time. A failed worker is fenced: killed, so that it cannot come back.
"""

from __future__ import annotations

import logging
import multiprocessing
import time
from dataclasses import dataclass
from multiprocessing.connection import wait as wait_connections
from typing import Dict, Optional, Sequence, Tuple

from .config import ElasticConfig
from .groups import LivenessMonitor, alive_key
from .plan import Holdings
from .worker import Reply, WorkerArgs, worker_main

__all__ = ["WorkerPool", "failures"]

log = logging.getLogger("moekit.elastic")
POLL_S = 0.05


@dataclass
class _Handle:
    process: multiprocessing.process.BaseProcess
    conn: object


class WorkerPool:
    """Starts, talks to and fences the workers of one deployment.

    Args:
        config: ElasticConfig.  store: the rendezvous store the controller hosts.
    Attributes:
        holdings: worker id -> its live slots' experts, as its last reply said.
        failed: fenced worker id -> why.
    """

    def __init__(self, config: ElasticConfig, store) -> None:
        self.config, self.store = config, store
        self._ctx = multiprocessing.get_context("spawn")
        self._liveness = LivenessMonitor(store, config.heartbeat_timeout_s, config.heartbeat_interval_s)
        self._workers: Dict[str, _Handle] = {}
        self._next_id = 0
        self._seq = 0
        self.holdings: Dict[str, Holdings] = {}
        self.failed: Dict[str, str] = {}

    # -- processes -----------------------------------------------------------------------
    def spawn(self) -> str:
        """Start a new worker process; returns its id (it announces itself alive when ready)."""
        c, wid = self.config, f"w{self._next_id}"
        self._next_id += 1
        args = WorkerArgs(wid, c.host, self.store.port, c.spec, str(c.checkpoint), c.collective_timeout_s,
                          c.heartbeat_interval_s, c.load_window, c.threads_per_worker)
        mine, theirs = self._ctx.Pipe()
        p = self._ctx.Process(target=worker_main, args=(args, theirs), name=f"moekit-elastic-{wid}", daemon=True)
        p.start()
        theirs.close()
        self._workers[wid] = _Handle(p, mine)
        self.holdings[wid] = tuple(() for _ in range(c.spec.num_layers))
        return wid

    @property
    def running(self) -> Tuple[str, ...]:
        """Ids of the worker processes not fenced or stopped, in start order."""
        return tuple(self._workers)

    def pid(self, worker: str) -> int:
        if worker not in self._workers:
            raise ValueError(f"worker must be a running worker id {sorted(self._workers)}, got {worker!r}")
        return self._workers[worker].process.pid

    def announced(self, worker: str) -> Optional[bool]:
        """True once the worker announced itself alive (its heartbeat is then watched), None if its process
        ended, else False."""
        h = self._workers[worker]
        if self.store.check([alive_key(worker)]):
            self._liveness.watch(worker)
            return True
        return None if not h.process.is_alive() else False

    def exit_code(self, worker: str) -> Optional[int]:
        return self._workers[worker].process.exitcode if worker in self._workers else None

    def check(self, workers: Sequence[str]) -> Dict[str, str]:
        """Fence the workers among `workers` whose process ended or whose heartbeat stopped; worker -> why."""
        dead = {w: f"its process exited with code {self._workers[w].process.exitcode}" for w in workers
                if w in self._workers and not self._workers[w].process.is_alive()}
        dead.update({w: f"its heartbeat stopped for {self.config.heartbeat_timeout_s} s"
                     for w in self._liveness.stale(workers)})
        for w, why in dead.items():
            self.fence(w, why)
        return dead

    def fence(self, worker: str, why: Optional[str]) -> None:
        """Forget a worker and make sure its process is gone: a failed worker (why given) is killed at
        once; a stopped one gets 5 s to exit first."""
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

    # -- commands ------------------------------------------------------------------------
    def next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def command(self, cls, workers: Sequence[str], timeout_s: Optional[float] = None, **fields):
        """Send cls(seq=..., **fields) to every worker in `workers`; see exchange."""
        return self.exchange({w: cls(seq=self.next_seq(), **fields) for w in workers},
                             self.config.command_timeout_s if timeout_s is None else timeout_s)

    def exchange(self, commands: Dict[str, object], timeout_s: float) -> Tuple[Dict[str, Reply], Dict[str, str]]:
        """Send each worker its command and wait for the replies.

        Returns (replies, failed: worker -> why). Failed workers (exited, pipe closed,
        heartbeat stopped, no reply within timeout_s) are fenced. Replies to older
        commands (abandoned after a failure) are dropped.
        """
        replies: Dict[str, Reply] = {}
        failed: Dict[str, str] = {}
        waiting: Dict[str, int] = {}
        for w, cmd in commands.items():
            try:
                if w not in self._workers:
                    raise EOFError("not running")
                self._workers[w].conn.send(cmd)
                waiting[w] = cmd.seq
            except (OSError, EOFError) as err:
                failed[w] = f"cannot send {type(cmd).__name__}: {err}"
        deadline = time.monotonic() + timeout_s
        while waiting:
            by_conn = {self._workers[w].conn: w for w in waiting}
            for conn in wait_connections(list(by_conn), timeout=POLL_S):
                w = by_conn[conn]
                try:
                    reply = conn.recv()
                except (EOFError, OSError):
                    failed[w] = "its pipe closed (the process ended)"
                    del waiting[w]
                    continue
                if reply.seq == waiting[w]:
                    replies[w] = reply
                    self.holdings[w] = reply.holdings
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
            self.fence(w, why)
        return replies, failed


def failures(failed: Dict[str, str], replies: Dict[str, Reply]) -> str:
    """One line naming every failed worker and every error reply ("" when all went well)."""
    parts = [f"{w} failed: {m}" for w, m in failed.items()]
    parts += [f"{w}: {r.error}" for w, r in replies.items() if not r.ok]
    return "; ".join(parts)


"""Generation groups over one rendezvous store, and the liveness signals kept in that store.

The controller hosts a TCPStore (the rendezvous store); every worker, including ones started
long after, connects to it as a client. Each process group a worker joins is a *generation*
g, built from the keys under the prefix "gen{g}/" of that store. The controller numbers
generations and never reuses a number, so the keys of an abandoned generation (a member died
half way) cannot mix with a later one.

Why the generation group is the process's default group. Measured on torch 2.13: a raw
`dist.ProcessGroupGloo(PrefixStore(...), rank, size)` built without a default group is not
usable with most `torch.distributed` calls (all_to_all_single, broadcast(src), P2POp,
new_group and get_rank fail with "not registered" or "default group not initialized"), and
moekit's expert-parallel dispatchers and EPLB's rearrangement use those calls. So a worker
holds exactly one group at a time, its default group: `join_generation` runs
`init_process_group("gloo", store=PrefixStore("gen{g}/", store), ...)` and `leave_generation`
runs `destroy_process_group()`. Also measured there: a gloo collective whose peer was
SIGKILLed fails at once ("Connection closed by peer"); one whose peer hangs fails after the
group's timeout; destroy_process_group() after such a failure returns at once; a rendezvous
that a member never joins fails after the same timeout, one whose member vanishes half
way through after up to 5 times that (gloo retries the connection); a process can build
and destroy any number of generations one after the other.

Generations are gloo groups and workers compute on the CPU. A GPU deployment would build
NCCL generations instead (and meet NCCL's rule that the first batch_isend_irecv of a group
involves every rank); it is not provided here.

Store keys (all small strings):
    alive/{worker}     the worker's pid, set once it has connected and read its gates:
                       the announcement a joiner must make within the join timeout.
    heartbeat/{worker} a counter the worker's heartbeat thread increments every interval.
    target/{id}        the member list transition `id` aims at (published in prepare).
    members            the serving members, comma-separated, and its generation.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Dict, Iterable, List, Tuple

import torch.distributed as dist

__all__ = [
    "alive_key",
    "heartbeat_key",
    "target_key",
    "MEMBERS_KEY",
    "host_store",
    "connect_store",
    "join_generation",
    "leave_generation",
    "Heartbeat",
    "LivenessMonitor",
]

MEMBERS_KEY = "members"


def alive_key(worker: str) -> str:
    return f"alive/{worker}"


def heartbeat_key(worker: str) -> str:
    return f"heartbeat/{worker}"


def target_key(transition: int) -> str:
    return f"target/{transition}"


def host_store(host: str, port: int = 0, timeout_s: float = 30.0) -> dist.TCPStore:
    """Host the rendezvous store (port 0: any free port; read it back from .port)."""
    return dist.TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s))


def connect_store(host: str, port: int, timeout_s: float = 30.0) -> dist.TCPStore:
    """Connect to the rendezvous store as a client."""
    return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))


def leave_generation() -> None:
    """Destroy this process's generation group, if it has one."""
    if dist.is_initialized():
        dist.destroy_process_group()


def join_generation(store: dist.Store, generation: int, rank: int, world_size: int, timeout_s: float) -> None:
    """Leave the current generation, then join generation `generation` as `rank` of `world_size`.

    The rendezvous and every later collective of the group are bounded by timeout_s: a member
    that never joins, dies or hangs makes the others fail after at most that long.
    """
    leave_generation()
    _reset_group_counter()
    try:
        dist.init_process_group("gloo", store=dist.PrefixStore(f"gen{generation}/", store), rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=timeout_s))
    except BaseException:
        leave_generation()
        _reset_group_counter()
        raise


def _reset_group_counter() -> None:
    """Make this process's next default group take the name every other member uses.

    torch names a default group after a per-process counter (its rendezvous keys contain
    the name) and resets the counter only in destroy_process_group(). An init that fails
    half-way (a peer died during the rendezvous) advances the counter with no group to
    destroy, so this process would wait forever on keys no other member writes. With no
    group alive, the counter must be 0, as it is in a process that never failed.
    """
    if not dist.is_initialized():
        dist.distributed_c10d._world.group_count = 0


class Heartbeat:
    """A worker-side daemon thread incrementing heartbeat/{worker} every interval_s.

    It uses its own store connection, so a main thread busy in a collective does not delay it.
    It stops by itself when the store goes away (the controller ended).
    """

    def __init__(self, host: str, port: int, worker: str, interval_s: float) -> None:
        self._stop = threading.Event()
        self._args = (host, port, heartbeat_key(worker), interval_s)
        self._thread = threading.Thread(target=self._run, name=f"moekit-heartbeat-{worker}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        host, port, key, interval_s = self._args
        try:
            store = connect_store(host, port, timeout_s=max(5.0, 4 * interval_s))
            store.add(key, 1)
            while not self._stop.wait(interval_s):
                store.add(key, 1)
        except Exception:  # noqa: BLE001 (the store is gone: the controller ended; nothing to signal to)
            return


class LivenessMonitor:
    """Controller-side view of the workers' heartbeat counters.

    A worker is stale when its counter has not moved for timeout_s by the controller's own
    clock (no clock is shared with workers). Reads are rate-limited to one per interval_s.
    """

    def __init__(self, store: dist.Store, timeout_s: float, interval_s: float) -> None:
        self.store, self.timeout_s, self.interval_s = store, timeout_s, interval_s
        self._seen: Dict[str, Tuple[int, float]] = {}  # worker -> (counter, when it last changed)
        self._last_read = 0.0

    def watch(self, worker: str) -> None:
        self._seen[worker] = (self._read(worker), time.monotonic())

    def forget(self, worker: str) -> None:
        self._seen.pop(worker, None)

    def _read(self, worker: str) -> int:
        return int(self.store.add(heartbeat_key(worker), 0))

    def stale(self, workers: Iterable[str]) -> List[str]:
        """The watched workers among `workers` whose heartbeat stopped for timeout_s."""
        now = time.monotonic()
        if now - self._last_read < self.interval_s:
            return []
        self._last_read = now
        out = []
        for w in workers:
            if w not in self._seen:
                continue
            count, since = self._seen[w]
            current = self._read(w)
            if current != count:
                self._seen[w] = (current, now)
            elif now - since > self.timeout_s:
                out.append(w)
        return out

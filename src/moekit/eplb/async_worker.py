"""Asynchronous EPLB: a background thread plans and stages one layer at a time.

The worker runs the policy, then for each layer whose placement changes it exchanges that
layer's rows with the other ranks (`EplbState.exchange`, on its own process group so it
never interleaves with the main thread's collectives) into a staging buffer: at most one
layer of extra memory. It then waits. At each `step()` the main thread asks every rank
(a one-number all-reduce, MIN) whether its worker has the layer staged; only when all have
does every rank commit that layer (weights and maps, in place, between steps) and release
its worker to the next layer. Ranks therefore switch each layer at the same step.

Status codes in that all-reduce: -1 failed, 0 busy, 1 a layer is staged, 2 finished.
When any rank reports a failure every rank abandons the rearrangement: each run carries a
generation number, and a worker of an abandoned generation stops at its next wait and writes
no status over a later run's.
"""

from __future__ import annotations

import threading
import time
from contextlib import nullcontext
from typing import Optional, Tuple

import torch
import torch.distributed as dist

from .rearrange import StagedLayer

__all__ = ["AsyncRearranger"]

FAILED, BUSY, STAGED, FINISHED = -1, 0, 1, 2


class AsyncRearranger:
    """The background half of an EplbState in mode "async".

    Args:
        state: the EplbState (its maps and weights are read by the worker, written by the
            main thread only).
        group: the worker's process group (same ranks as state.group), or None for one process.
    """

    def __init__(self, state, group=None) -> None:
        self.state = state
        self.group = group
        self.active = False
        self.closed = False  # EplbState.close() released the group
        self._status = BUSY
        self._error: Optional[BaseException] = None
        self._staged: Optional[Tuple[int, torch.Tensor, StagedLayer]] = None
        self._lock = threading.Lock()
        self._release = threading.Event()  # this run's: the main thread lets the worker go on
        self._generation = 0  # of the run in progress; a worker of an older one stops
        self._thread: Optional[threading.Thread] = None

    def start(self, logical_load: torch.Tensor) -> None:
        """Begin a rearrangement for a load [L, E] (identical on every rank)."""
        if self.active:
            raise RuntimeError("a rearrangement is already in progress")
        if self.closed:
            raise RuntimeError("EplbState.close() has stopped the asynchronous worker; no rearrangement can start")
        self.active = True
        with self._lock:
            self._generation += 1
            self._status, self._error, self._staged = BUSY, None, None
            self._release = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(logical_load, self._generation, self._release),
                                        name="moekit-eplb", daemon=True)
        self._thread.start()

    def _report(self, generation: int, **fields) -> bool:
        """Set status fields if this worker's run is still the current one; returns whether it is."""
        with self._lock:
            if generation != self._generation:
                return False
            for name, value in fields.items():
                setattr(self, name, value)
            return True

    def _run(self, logical_load: torch.Tensor, generation: int, release: threading.Event) -> None:
        state = self.state
        try:
            new = state.plan(logical_load)
            device = state.phy2log.device
            stream = torch.cuda.Stream(device) if device.type == "cuda" else None
            for layer in range(state.num_layers):
                if torch.equal(new[layer], state.phy2log_host[layer]):
                    continue
                with torch.cuda.stream(stream) if stream is not None else nullcontext():
                    staged = state.exchange(layer, new[layer], group=self.group)
                if stream is not None:
                    stream.synchronize()  # the main thread reads the buffer on its own stream
                if not self._report(generation, _staged=(layer, new[layer], staged), _status=STAGED):
                    return
                release.wait()
                release.clear()
                if generation != self._generation:  # abandoned while staged: a failure on some rank
                    return
            self._report(generation, _status=FINISHED)
        except BaseException as err:  # reported to the main thread at its next poll
            self._report(generation, _error=err, _status=FAILED)

    def poll(self) -> bool:
        """Main thread, once per step: commit the staged layer if every rank has it. Returns whether one was."""
        with self._lock:
            status = self._status
        flag = torch.tensor([status], dtype=torch.int64)
        if self.state.group is not None:
            flag = flag.to(self.state.phy2log.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.state.group)
        agreed = int(flag.item())  # between steps: a host read is fine here
        if agreed == FAILED:
            self.active = False
            with self._lock:  # abandon this run: a worker waiting with a staged layer stops
                self._generation += 1
            self._release.set()
            if self._error is not None:
                raise RuntimeError("the EPLB worker failed on this rank") from self._error
            raise RuntimeError("the EPLB worker failed on another rank")
        if agreed == STAGED:
            layer, new_row, staged = self._staged
            self.state.commit(layer, new_row, staged)
            with self._lock:
                self._staged, self._status = None, BUSY
            self._release.set()
            return True
        if agreed == FINISHED:
            self._thread.join()
            self.active = False
            self.state.rearrangements += 1
        return False

    def finish(self) -> None:
        """Main thread, on every rank together: poll until the rearrangement in progress is done."""
        while self.active:
            if not self.poll() and self.active:
                time.sleep(1e-3)  # the workers are transferring: let them

"""Batch bookkeeping of an elastic deployment: ids, the queue, exactly-once completion."""

from __future__ import annotations

import threading
from collections import deque
from typing import Deque, Dict, List, Optional, Tuple

import torch

__all__ = ["BatchQueue"]


class BatchQueue:
    """Submitted batches [T, H] by id: queued, running (at most one), completed exactly once.

    submit() may be called from any thread; the rest from the thread that serves.
    A batch taken by next() is either completed or put back at the front by requeue().

    Args:
        hidden_size: H of every batch.
    """

    def __init__(self, hidden_size: int) -> None:
        self.hidden_size = hidden_size
        self._lock = threading.Lock()
        self._queue: Deque[int] = deque()
        self._inputs: Dict[int, torch.Tensor] = {}
        self._next_id = 0
        self.in_flight: Optional[int] = None
        self.results: Dict[int, torch.Tensor] = {}
        self.completion_log: List[int] = []
        self.attempts: Dict[int, int] = {}
        self.errors: Dict[int, str] = {}  # batches given up on: id -> the last failure
        self.interrupted = 0

    def submit(self, x: torch.Tensor) -> int:
        """Queue a copy of x [T, H] (finite floats; the caller may reuse x at once); returns its id."""
        H = self.hidden_size
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a torch.Tensor [T, H], got {type(x).__name__}")
        if x.dim() != 2 or x.shape[1] != H or not x.is_floating_point() or x.device.type == "meta":
            raise ValueError(f"x must be a float tensor [T, H={H}] with data, got {x.dtype} {tuple(x.shape)} "
                             f"on {x.device}")
        x = x.detach().to("cpu", copy=True)
        if not bool(torch.isfinite(x).all()):  # it would fail on every world it ran on
            raise ValueError("x must be finite, got NaN or inf entries")
        with self._lock:
            bid = self._next_id
            self._next_id += 1
            self._inputs[bid] = x
            self.attempts[bid] = 0
            self._queue.append(bid)
        return bid

    @property
    def pending(self) -> int:
        """Batches queued (neither running nor completed)."""
        return len(self._queue)

    @property
    def submitted(self) -> int:
        return self._next_id

    def next(self) -> Tuple[int, torch.Tensor]:
        """Take the first queued batch (it becomes in_flight): (id, x)."""
        with self._lock:
            bid = self._queue.popleft()
            x = self._inputs[bid]
        self.attempts[bid] += 1
        self.in_flight = bid
        return bid, x

    def requeue(self, bid: int) -> None:
        """Put an interrupted batch back at the front of the queue."""
        with self._lock:
            self._queue.appendleft(bid)
        self.interrupted += 1
        self.in_flight = None

    def give_up(self, bid: int, why: str) -> None:
        """Drop the in-flight batch bid from the queue for good, recording why (no result will come)."""
        with self._lock:
            if bid in self._queue:
                self._queue.remove(bid)
            del self._inputs[bid]
        self.errors[bid] = why
        self.in_flight = None

    def complete(self, bid: int, out: torch.Tensor) -> None:
        """Record a batch's output; a second completion of one id is an error."""
        if bid in self.results:
            raise RuntimeError(f"batch {bid} completed twice")
        self.results[bid] = out
        self.completion_log.append(bid)
        with self._lock:
            del self._inputs[bid]
        self.in_flight = None

"""Run a function on every rank of a small gloo world (spawned processes, bounded waits).

Not a test module: the multi-process tests (tests/parallel, tests/eplb) import it. Each rank
runs fn(rank, size, *args) and returns a list of failure messages; run_world returns
{rank: messages} and turns a crash, a hang past the timeout or a raised exception into
messages too.
"""

from __future__ import annotations

import os
import tempfile
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["run_world"]


def _worker(rank, size, init_file, fn, args, queue, gloo_timeout_s):
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=size,
                                timeout=timedelta(seconds=gloo_timeout_s))
        result = fn(rank, size, *args)
        queue.put((rank, list(result)))
    except BaseException:  # noqa: BLE001 (reported to the parent, which fails the test)
        queue.put((rank, ["exception:\n" + traceback.format_exc()]))
    finally:
        queue.close()
        queue.join_thread()  # flush the result before leaving
        # A rank that gave up on a pending collective must not wait for it at exit.
        os._exit(0)


def run_world(size: int, fn, *args, timeout_s: float = 120.0, gloo_timeout_s: float = 60.0):
    """fn(rank, size, *args) -> list of failure strings, on `size` gloo ranks. Returns {rank: [failures]}."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [ctx.Process(target=_worker, args=(r, size, init_file, fn, args, queue, gloo_timeout_s))
                 for r in range(size)]
        for p in procs:
            p.start()
        results = {}
        try:
            for _ in range(size):
                rank, failures = queue.get(timeout=timeout_s)
                results[rank] = failures
        except Exception:  # noqa: BLE001 (queue.Empty: some rank hung or died)
            pass
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
    for r in range(size):
        results.setdefault(r, [f"rank {r} returned nothing within {timeout_s} s (hang or crash)"])
    return results

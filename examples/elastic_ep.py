"""Elastic expert parallelism on one machine (gloo): 4 -> 2 -> 3 ranks while serving, one rank killed.

    python examples/elastic_ep.py
    python examples/elastic_ep.py --experts 16 --hidden 64 --batches 60 --redundant 4

A driver thread submits a stream of batches (random sizes, 0 and 1 tokens included) while
the controller
  1. starts 4 workers (each reads its experts from the checkpoint),
  2. scales down to 2 (the two leaving ranks hand their experts over before they exit),
  3. asks for a joiner that cannot announce itself in time (prepare fails; the 2 keep serving),
  4. scales up to 3 (a new process joins and receives its experts from the others),
  5. loses a rank to SIGKILL in the middle of a batch: the survivors detect it, rebuild
     without it (experts that only it held are read back from the checkpoint) and the
     interrupted batch runs again.
Every batch is checked against the single-process model (reference backend) within
moekit's tolerance for the dtype. Prints one summary line (batches submitted / completed /
mismatched / lost, and the time of each stage of each transition); exit status 1 on any
lost, repeated or mismatched batch.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import threading
import time
from typing import Callable, Dict, Optional

import torch

from moekit.elastic import ElasticConfig, ElasticController, ModelSpec, ReferenceModel, write_checkpoint
from moekit.experts.reference import TOLERANCE


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--intermediate", type=int, default=16)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--redundant", type=int, default=2, help="redundant expert slots (replicas of hot experts)")
    p.add_argument("--max-slots", type=int, default=None,
                   help="expert slots one rank can hold (capacity rule; default: what the 2-rank stage needs, "
                        "ceil((experts + redundant) / 2))")
    p.add_argument("--batches", type=int, default=40)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--interval", type=float, default=0.05, help="seconds between submitted batches")
    p.add_argument("--timeout", type=float, default=5.0, help="gloo timeout and heartbeat timeout (s)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.max_slots is None:
        args.max_slots = -(-(args.experts + args.redundant) // 2)
    return args


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    if torch.isnan(out).any():
        return float("inf")
    denom = ref.double().norm().item()
    num = (out.double() - ref.double()).norm().item()
    return num / denom if denom else (0.0 if num == 0 else float("inf"))


def run(args, observe: Optional[Callable[[str, ElasticController], None]] = None) -> Dict:
    """Run the scenario; `observe(step, controller)` is called after each step (for checks). Returns a summary."""
    spec = ModelSpec(args.experts, args.hidden, args.intermediate, args.top_k, num_layers=args.layers)
    gen = torch.Generator().manual_seed(args.seed)
    sizes = [0, 1] + torch.randint(0, args.max_tokens + 1, (args.batches - 2,), generator=gen).tolist()
    xs = [torch.randn(T, args.hidden, generator=gen) for T in sizes]
    n = len(xs)
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = write_checkpoint(spec, os.path.join(tmp, "model.safetensors"), seed=args.seed)
        reference = ReferenceModel(spec, checkpoint, backend="reference")
        config = ElasticConfig(spec, str(checkpoint), max_slots_per_rank=args.max_slots,
                               num_redundant=args.redundant, collective_timeout_s=args.timeout,
                               heartbeat_timeout_s=args.timeout, command_timeout_s=6 * args.timeout)
        ctl = ElasticController(config)
        submitted_at: Dict[int, float] = {}
        fed, scaled_up, killed = threading.Event(), threading.Event(), threading.Event()
        kill = {}

        def feed():
            for i, x in enumerate(xs):
                if i == int(n * 0.6):
                    scaled_up.wait()  # keep batches for the kill phase
                bid = ctl.submit(x)
                submitted_at[bid] = time.monotonic()
                time.sleep(args.interval)
            fed.set()

        def kill_one():
            scaled_up.wait()
            victim = ctl.members[1]
            pid = ctl.worker_pid(victim)
            while ctl.in_flight is None or len(ctl.results) < int(n * 0.65):  # in the middle of a batch
                time.sleep(0.001)
            kill.update(worker=victim, pid=pid, at=time.monotonic(), batch=ctl.in_flight)
            os.kill(pid, signal.SIGKILL)
            killed.set()

        def serve_until(fraction: float):  # until that fraction of the stream has completed
            ctl.serve(until=lambda: len(ctl.results) >= int(n * fraction), timeout_s=120)

        try:
            ctl.start(4)
            _observe(observe, "start", ctl)
            feeder = threading.Thread(target=feed, name="feeder", daemon=True)
            feeder.start()
            serve_until(0.2)
            ctl.scale_down(leave=ctl.members[2:])
            _observe(observe, "scale_down", ctl)
            serve_until(0.35)
            failed = ctl.scale_up(1, join_timeout_s=0.01)  # no process can start that fast: prepare fails
            _observe(observe, "failed_join", ctl)
            serve_until(0.45)
            ctl.scale_up(1)
            _observe(observe, "scale_up", ctl)
            killer = threading.Thread(target=kill_one, name="killer", daemon=True)
            killer.start()
            scaled_up.set()
            ctl.serve(until=lambda: fed.is_set() and killed.is_set() and ctl.pending == 0, timeout_s=120)
            _observe(observe, "end", ctl)
        finally:
            ctl.shutdown()
        tol = TOLERANCE[spec.dtype]
        errors = {bid: _rel_err(ctl.results[bid], reference(x)) for bid, x in enumerate(xs) if bid in ctl.results}
    windows = [(min(e.start for e in r.events), max(e.end for e in r.events)) for r in ctl.reports if r.events]
    during = sum(any(a <= t <= b for a, b in windows) for t in submitted_at.values())
    detect = next((e for e in ctl.events if e.stage == "detect" and kill and e.start >= kill["at"]), None)
    return {
        "submitted": ctl.submitted,
        "completed": len(ctl.completion_log),
        "repeated": len(ctl.completion_log) - len(set(ctl.completion_log)),
        "lost": n - len(ctl.results),
        "mismatched": sum(err > tol for err in errors.values()),
        "max_rel_err": max(errors.values(), default=0.0),
        "interrupted": ctl.interrupted,
        "submitted_during_transitions": during,
        "failed_join": failed,
        "killed": kill,
        "detect_s": None if detect is None else detect.start - kill["at"],
        "reports": ctl.reports,
        "events": ctl.events,
        "members": ctl.members,
    }


def _observe(observe, step, ctl):
    if observe is not None:
        observe(step, ctl)


def summary_line(s: Dict) -> str:
    stages = " ".join(f"{r.kind}{'' if r.ok else '(FAILED in ' + r.failed_stage + ')'}"
                      f"[{' '.join(f'{e.stage}={e.seconds * 1e3:.0f}ms' for e in r.events)}]" for r in s["reports"])
    detect = "n/a" if s["detect_s"] is None else f"{s['detect_s'] * 1e3:.0f}ms"
    return (f"batches submitted={s['submitted']} completed={s['completed']} mismatched={s['mismatched']} "
            f"lost={s['lost']} repeated={s['repeated']} interrupted={s['interrupted']} "
            f"during_transitions={s['submitted_during_transitions']} max_rel_err={s['max_rel_err']:.2e} "
            f"kill->detect={detect} | {stages}")


def main(argv=None) -> int:
    s = run(parse(argv))
    print(summary_line(s))
    bad = s["lost"] or s["mismatched"] or s["repeated"] or s["completed"] != s["submitted"]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

"""The worker process of elastic expert parallelism: one expert-parallel rank, driven by commands.

A worker is a separate process with a stable id ("w3"). At start it connects to the
controller's rendezvous store, reads the router gates from the checkpoint, announces itself
alive (groups.alive_key) and starts its heartbeat; then it runs commands from its pipe one
at a time and answers each with one Reply carrying the command's seq. The step boundary is
the gap between two commands.

State:
    live     this worker's expert slots now: per layer the per-expert tensors [S, ...] and
             the expert of each slot (its holdings). Only a switch replaces them.
    staged   the slots of the coming world, filled by a redistribute, taken by the switch.
    serving  the generation it serves in: the FusedMoE layers built over that group, with
             an EPLB state recording the load per slot (None after a failure, during a
             transition, and before the first switch).

Commands (the stages are the controller's; see controller.py):
    Run          forward a batch slice in the serving generation; one EPLB step.
    Report       the load recorded in the serving window, per logical expert.
    Redistribute join a transition generation and fill `staged`: moekit.eplb.exchange_layer
                 does the local copies, sends and receives of the plan (all per-expert
                 tensors of a slot travel as one message), and experts whose holders died
                 are read from the checkpoint. The live weights are only read.
    Switch       leave the transition group, join the new generation and build the layers
                 over the staged slots (use_staged=False: over the live ones, a rollback);
                 a worker with rank None just leaves, holding nothing new.
    Inspect      the live slots' bytes (for checks).
    Stop         leave and exit.
A command that fails answers ok=False with the error, leaves its group (a failed collective
leaves it unusable) and keeps its live weights, so the controller can rebuild around it.

The layers of a generation: L FusedMoE(parallel=expert-parallel over the generation) whose
expert tensors are replaced by this rank's S slots, with an EplbState over the placement
and a dispatcher over the R physical slots: the wiring moekit.eplb.enable_eplb does, here
from slot tensors and a given placement instead of full logical weights (a worker never
holds all E experts). In-generation rebalancing is off: placements change at transitions.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import traceback
from dataclasses import dataclass, replace
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn

from ..eplb.maps import physical_to_logical_load
from ..eplb.rearrange import exchange_layer
from ..eplb.state import EplbConfig, EplbState
from ..parallel.config import ParallelConfig
from ..parallel.registry import build_dispatcher
from .groups import Heartbeat, alive_key, connect_store, join_generation, leave_generation
from .model import ModelSpec, build_layers, read_experts, read_gate, stack_forward
from .plan import Holdings, WorkerPlan

__all__ = ["WorkerArgs", "Run", "Report", "Redistribute", "Switch", "Inspect", "Stop", "Reply", "Worker",
           "worker_main"]

_NEVER = 2 ** 62  # EPLB step interval: no rebalancing inside a generation


@dataclass(frozen=True)
class WorkerArgs:
    """What a worker process needs: its id, the store, the model, the checkpoint, the timeouts."""

    worker: str
    host: str
    port: int
    spec: ModelSpec
    checkpoint: str
    collective_timeout_s: float
    heartbeat_interval_s: float
    load_window: int
    threads: int = 1
    poll_s: float = 0.5


@dataclass(frozen=True)
class Run:
    """Forward x through every layer in generation `generation` (batch `batch`'s slice for this rank)."""

    seq: int
    generation: int
    batch: int
    x: np.ndarray  # [T_slice, H] float32


@dataclass(frozen=True)
class Report:
    """Answer the load recorded in the serving window: [L, E] tokens per logical expert."""

    seq: int


@dataclass(frozen=True)
class Redistribute:
    """Join transition generation `generation` (rank plan.rank of world_size) and stage plan's slots."""

    seq: int
    generation: int
    world_size: int
    plan: WorkerPlan


@dataclass(frozen=True)
class Switch:
    """Serve as `rank` of world_size in generation `generation` with placement phy2log [L][R],
    over the staged slots (use_staged) or the live ones; rank None: leave and serve nothing."""

    seq: int
    generation: int
    rank: Optional[int]
    world_size: int
    phy2log: Tuple[Tuple[int, ...], ...]
    use_staged: bool


@dataclass(frozen=True)
class Inspect:
    """Answer the live holdings and slot bytes."""

    seq: int


@dataclass(frozen=True)
class Stop:
    """Leave the group and exit."""

    seq: int


@dataclass(frozen=True)
class Reply:
    """A worker's answer to command `seq`; holdings are its live slots' experts after the command."""

    worker: str
    seq: int
    ok: bool
    value: Any
    error: str
    holdings: Holdings


@dataclass
class _Serving:
    generation: int
    layers: nn.ModuleList
    eplb: EplbState


def _serve_over(spec: ModelSpec, tensors: List[Dict[str, torch.Tensor]], gates: List[torch.Tensor],
                phy2log, world_size: int, timeout_s: float, window: int) -> Tuple[nn.ModuleList, EplbState]:
    """Build the layers of one generation over this rank's slot tensors (see the module docstring)."""
    parallel = ParallelConfig.expert_parallel(timeout_s=timeout_s) if world_size > 1 else None
    layers = build_layers(spec, parallel)
    E, R = spec.num_experts, len(phy2log[0])
    for m, slots, gate in zip(layers, tensors, gates):
        for name, t in slots.items():
            setattr(m.experts, name, nn.Parameter(t, requires_grad=False))
        m.gate.weight = nn.Parameter(gate, requires_grad=False)
    config = EplbConfig(num_redundant=R - E, window_size=window, step_interval=_NEVER)
    state = EplbState([m.experts.expert_weights for m in layers], E, config,
                      group=dist.group.WORLD if parallel is not None else None,
                      phy2log=torch.tensor(phy2log, dtype=torch.int64))
    for i, m in enumerate(layers):
        if parallel is not None:
            m.runner.dispatcher = build_dispatcher(replace(parallel, placement="linear"), R, spec.top_k)
            m.expert_map = state.expert_map()
        m.runner.eplb = state.hook(i)
    return layers, state


class Worker:
    """The command handlers of one worker process (see the module docstring)."""

    def __init__(self, args: WorkerArgs, store: dist.Store) -> None:
        self.args, self.spec, self.store = args, args.spec, store
        L = self.spec.num_layers
        self.gates = [read_gate(args.checkpoint, self.spec, i) for i in range(L)]
        self.shapes = self.spec.expert_shapes()  # name -> one row's shape, in per_expert_tensors order
        self.live: Tuple[List[Dict[str, torch.Tensor]], Holdings] = ([], tuple(() for _ in range(L)))
        self.staged: Optional[Tuple[List[Dict[str, torch.Tensor]], Holdings]] = None
        self.serving: Optional[_Serving] = None

    # -- commands ------------------------------------------------------------------------
    def handle(self, cmd) -> Reply:
        """Run one command; a failure becomes ok=False (and the group is left)."""
        handlers = {Run: self._run, Report: self._report, Redistribute: self._redistribute, Switch: self._switch,
                    Inspect: self._inspect, Stop: self._stop}
        try:
            value = handlers[type(cmd)](cmd)
            return Reply(self.args.worker, cmd.seq, True, value, "", self.live[1])
        except Exception as err:  # noqa: BLE001 (answered to the controller, which decides)
            error = "".join(traceback.format_exception_only(type(err), err)).strip()
            if not isinstance(cmd, (Report, Inspect)):
                try:
                    self._leave()
                except Exception as again:  # noqa: BLE001
                    error += f"; leaving the group failed too: {again}"
            return Reply(self.args.worker, cmd.seq, False, None, error, self.live[1])

    def _leave(self) -> None:
        self.serving = None
        leave_generation()

    def _run(self, cmd: Run) -> np.ndarray:
        s = self.serving
        if s is None or s.generation != cmd.generation:
            raise RuntimeError(f"batch {cmd.batch} is for generation {cmd.generation}, this worker serves "
                               f"{None if s is None else s.generation}")
        x = torch.from_numpy(cmd.x).to(self.spec.dtype)  # [T, H]
        with torch.no_grad():
            out = stack_forward(s.layers, x)
        s.eplb.step()
        return out.float().numpy()

    def _report(self, cmd: Report) -> np.ndarray:
        """Tokens per logical expert in the serving window: [L, E] int64 (zeros when not serving)."""
        s = self.serving
        if s is None:
            return np.zeros((self.spec.num_layers, self.spec.num_experts), dtype=np.int64)
        return physical_to_logical_load(s.eplb.recorder.window_load(), s.eplb.phy2log, self.spec.num_experts).numpy()

    def _sources(self, layer: int) -> List[torch.Tensor]:
        """This worker's live tensors of a layer, or one zero row each (a joiner only receives)."""
        tensors, _ = self.live
        if tensors:
            return [tensors[layer][name] for name in self.shapes]
        return [torch.zeros((1,) + shape, dtype=self.spec.dtype) for shape in self.shapes.values()]

    def _redistribute(self, cmd: Redistribute) -> Dict[str, int]:
        self._leave()
        plan = cmd.plan
        join_generation(self.store, cmd.generation, plan.rank, cmd.world_size, self.args.collective_timeout_s)
        S, staged, received, loaded = plan.num_slots, [], 0, 0
        for layer, (rank_plan, loads) in enumerate(zip(plan.layers, plan.loads)):
            rows = exchange_layer(self._sources(layer), rank_plan, group=dist.group.WORLD)
            new = {name: torch.empty((S,) + shape, dtype=self.spec.dtype) for name, shape in self.shapes.items()}
            written = torch.zeros(S, dtype=torch.bool)
            for t, r in zip(new.values(), rows.rows):
                t.index_copy_(0, rows.slots, r)
            written[rows.slots] = True
            if loads:
                read = read_experts(self.args.checkpoint, self.spec, layer, [e for e, _ in loads])
                for i, (_, dst) in enumerate(loads):
                    for name, t in new.items():
                        t[list(dst)] = read[name][i]
                    written[list(dst)] = True
                    loaded += len(dst)
            if not bool(written.all()):
                raise RuntimeError(f"layer {layer}: the plan left slots {(~written).nonzero().flatten().tolist()} "
                                   "unwritten")
            received += sum(len(d) for _, _, d in rank_plan.recvs)
            staged.append(new)
        self.staged = (staged, plan.holdings) if S else None
        return {"received": received, "loaded": loaded, "sent": sum(len(p.sends) for p in plan.layers)}

    def _switch(self, cmd: Switch) -> None:
        self._leave()
        if cmd.rank is None:
            self.staged = None
            return None
        if cmd.use_staged:
            if self.staged is None:
                raise RuntimeError("switch: this worker has nothing staged (no redistribute reached it)")
            tensors, holdings = self.staged
        else:
            tensors, holdings = self.live
        S = len(cmd.phy2log[0]) // cmd.world_size
        expected = tuple(tuple(row[cmd.rank * S:(cmd.rank + 1) * S]) for row in cmd.phy2log)
        if holdings != expected:
            raise RuntimeError(f"switch: this worker's slots {holdings} are not rank {cmd.rank}'s part of the "
                               f"placement ({expected})")
        join_generation(self.store, cmd.generation, cmd.rank, cmd.world_size, self.args.collective_timeout_s)
        layers, state = _serve_over(self.spec, tensors, self.gates, cmd.phy2log, cmd.world_size,
                                    self.args.collective_timeout_s, self.args.load_window)
        self.live, self.staged = (tensors, holdings), None
        self.serving = _Serving(cmd.generation, layers, state)
        return None

    def _inspect(self, cmd: Inspect) -> Dict[str, Any]:
        """Holdings and, per layer, each per-expert tensor's bytes per slot: uint8 [S, n]."""
        tensors, holdings = self.live
        return {"holdings": holdings, "pid": os.getpid(),
                "tensors": [{name: t.contiguous().view(torch.uint8).reshape(t.shape[0], -1).numpy().copy()
                             for name, t in layer.items()} for layer in tensors]}

    def _stop(self, cmd: Stop) -> None:
        self._leave()
        return None

    # -- the loop --------------------------------------------------------------------------
    def serve(self, conn) -> None:
        """Answer commands from `conn` until Stop, the pipe closes, or the controller process dies."""
        parent = multiprocessing.parent_process()
        while True:
            if not conn.poll(self.args.poll_s):
                if parent is not None and not parent.is_alive():
                    return
                continue
            try:
                cmd = conn.recv()
            except EOFError:
                return
            conn.send(self.handle(cmd))
            if isinstance(cmd, Stop):
                return


def worker_main(args: WorkerArgs, conn) -> None:
    """Entry point of a worker process (a multiprocessing target); `conn` is its end of the pipe."""
    code, heartbeat = 0, None
    try:
        torch.set_num_threads(args.threads)
        store = connect_store(args.host, args.port)
        worker = Worker(args, store)
        heartbeat = Heartbeat(args.host, args.port, args.worker, args.heartbeat_interval_s)
        heartbeat.start()
        store.set(alive_key(args.worker), str(os.getpid()))
        worker.serve(conn)
    except BaseException:  # noqa: BLE001 (the process ends; the controller sees it exit)
        traceback.print_exc(file=sys.stderr)
        code = 1
    finally:
        if heartbeat is not None:
            heartbeat.stop()
        conn.close()
        # Leave without waiting on collectives a failed generation may have left pending.
        os._exit(code)

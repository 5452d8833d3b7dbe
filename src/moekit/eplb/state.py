"""EplbState: the maps, the load window, the step counter and the rearrangement trigger.

Letters: L layers, E logical experts, R = E + redundant physical slots, P ranks, S = R / P
slots per rank, M = R - E + 1 the width of log2phy.

Each step the caller runs the layers (whose runners call `EplbLayerHook.map_ids`) and
then `step()`. Every `step_interval` steps, the first after a quarter interval, all ranks
all-reduce the window of per-slot loads, convert it to per-expert loads, run the policy and
move the weights (at once in "sync" mode; layer by layer from a background worker in
"async" mode). Every rank must call `step()` the same number of times, dummy steps
included, or the collectives hang.

The maps (phy2log, log2phy, replica_count) live on the experts' device and are updated in
place, so graphs captured with them stay valid.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence

import torch
import torch.distributed as dist

from ..experts.base import ExpertWeights
from .maps import initial_placement, local_slots, map_to_physical, maps_from_phy2log, physical_expert_map
from .maps import physical_to_logical_load
from .policy import check_policy_args, check_sizes, improves, preserve_slots, rebalance_experts
from .rearrange import StagedLayer, commit_layer, exchange_layer, plan_layer
from .recorder import LoadRecorder

__all__ = ["EplbConfig", "EplbState", "EplbLayerHook", "MODES"]

MODES = ("sync", "async")


@dataclass(frozen=True)
class EplbConfig:
    """How expert-parallel load balancing runs.

    Fields:
        num_redundant: extra physical slots beyond the E logical experts (R = E + this).
        window_size: steps of load kept in the sliding window.
        step_interval: steps between rearrangements (the first comes after a quarter).
        num_groups: G expert groups for the hierarchical policy (1: no groups).
        num_nodes: N nodes the P ranks span (P % N == 0).
        preserve_slots: keep experts that stay on a rank in their slot (fewer copies).
        mode: "sync" (plan and move everything inside step()) or "async" (a background
            worker plans and stages one layer at a time; step() commits staged layers).
        min_improvement: a layer moves to its new placement only when, under the window's
            load, the plan lowers the load of its busiest rank by more than this fraction of
            the current placement's (0.0: any strict improvement). DeepSeek's greedy policy
            can plan a placement less balanced than the one in place, and moving weights
            costs transfers; None applies every plan as the policy makes it.
    """

    num_redundant: int = 0
    window_size: int = 1000
    step_interval: int = 3000
    num_groups: int = 1
    num_nodes: int = 1
    preserve_slots: bool = True
    mode: str = "sync"
    min_improvement: Optional[float] = 0.0

    def __post_init__(self) -> None:
        if isinstance(self.num_redundant, bool) or not isinstance(self.num_redundant, int) or self.num_redundant < 0:
            raise ValueError(f"num_redundant must be an int >= 0, got {self.num_redundant!r}")
        for name in ("window_size", "step_interval", "num_groups", "num_nodes"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {list(MODES)}, got {self.mode!r}")
        m = self.min_improvement
        if m is not None and (isinstance(m, bool) or not isinstance(m, (int, float)) or not 0.0 <= m < 1.0):
            raise ValueError(f"min_improvement must be None or a number in [0, 1), got {m!r}")

    def check_fits(self, num_logical: int, num_ranks: int) -> None:
        """Raise ValueError, naming the field, unless this config fits E experts over P ranks
        (then the policy's own preconditions, so nothing later refuses the config)."""
        E, P, R = num_logical, num_ranks, num_logical + self.num_redundant
        check_sizes(E, R, self.num_groups, self.num_nodes, P, {
            "E": f"the number of experts E={E}", "G": f"num_groups={self.num_groups}",
            "N": f"num_nodes={self.num_nodes}", "P": f"the {P} expert-parallel ranks",
            "R": f"the R = E + num_redundant = {E} + {self.num_redundant} = {R} slots (choose num_redundant so "
                 f"{P} divides R)"})
        check_policy_args(torch.zeros(1, E), R, self.num_groups, self.num_nodes, P)


class EplbLayerHook:
    """The object a MoERunner calls after routing (runner.eplb): logical -> physical ids, load recorded."""

    def __init__(self, state: "EplbState", layer: int) -> None:
        self.state = state
        self.layer = layer

    def map_ids(self, topk_ids: torch.Tensor) -> torch.Tensor:
        """[T, k] logical ids -> [T, k] int32 physical slot ids; counts the real rows per slot."""
        s = self.state
        physical = map_to_physical(topk_ids, s.log2phy[self.layer], s.replica_count[self.layer])
        s.recorder.record(self.layer, physical)
        return physical

    def physical_rows(self, logical: torch.Tensor) -> torch.Tensor:
        """This rank's slots' rows of a logical per-expert tensor [E, ...] -> [S, ...]."""
        s = self.state
        if not isinstance(logical, torch.Tensor):
            raise TypeError(f"expected a torch.Tensor [E={s.num_logical}, ...], got {type(logical).__name__}")
        if logical.dim() < 1 or logical.shape[0] != s.num_logical:
            raise ValueError(f"expected a per-expert tensor [E={s.num_logical}, ...], got shape {tuple(logical.shape)}")
        return logical[s.phy2log_host[self.layer, s.slots.start:s.slots.stop].to(logical.device)]

    def select(self, w13, w2, b13=None, b2=None):
        """Logical checkpoint tensors [E, ...] -> this rank's slots [S, ...] under the current placement."""
        return tuple(None if t is None else self.physical_rows(t) for t in (w13, w2, b13, b2))


class EplbState:
    """Placement, load window and trigger of L MoE layers on one rank.

    Args:
        weights: per layer, a callable returning this rank's ExpertWeights with S = R / P
            slots (their tensors are moved in place by rearrangements).
        num_logical: E.
        config: EplbConfig.
        group: process group of the P expert-parallel ranks, or None for a single process
            (pass torch.distributed.group.WORLD to use the default group).
        phy2log: [L, R] the placement the weights are in; default: slot i holds expert i mod E.
        worker_group: a second process group over the same ranks for the async worker's
            transfers; None creates one with torch.distributed.new_group (collective).
    """

    def __init__(self, weights: Sequence[Callable[[], ExpertWeights]], num_logical: int, config: EplbConfig, *,
                 group=None, phy2log: Optional[torch.Tensor] = None, worker_group=None) -> None:
        if not isinstance(config, EplbConfig):
            raise TypeError(f"config must be an EplbConfig, got {type(config).__name__}")
        if len(weights) < 1:
            raise ValueError("weights must list at least one layer, got none")
        if not all(callable(w) for w in weights):
            raise TypeError("weights must list, per layer, a callable returning this rank's ExpertWeights, "
                            f"got {[type(w).__name__ for w in weights if not callable(w)][0]}")
        if isinstance(num_logical, bool) or not isinstance(num_logical, int) or num_logical < 1:
            raise ValueError(f"num_logical must be an int >= 1 (E, the logical experts), got {num_logical!r}")
        self.config = config
        # The default group is looked up at each use, never held: a reference kept past
        # destroy_process_group() keeps the gloo backend (and its worker threads) alive into
        # interpreter shutdown, where a worker dropping a finished collective's tensors aborts
        # the process ("terminate called without an active exception").
        self._world = group is not None and group is dist.group.WORLD
        self._group = None if self._world else group
        self.num_ranks = 1 if group is None else dist.get_world_size(group)
        self.rank = 0 if group is None else dist.get_rank(group)
        self.num_layers = len(weights)
        self.num_logical = num_logical
        self.num_physical = num_logical + config.num_redundant
        L, E, R, P = self.num_layers, num_logical, self.num_physical, self.num_ranks
        config.check_fits(E, P)
        self.slots = local_slots(R, P, self.rank)
        self._weights = list(weights)
        for i in range(L):
            tensors = self.layer_tensors(i)
            for name, t in zip(self._names(i), tensors):
                if t.shape[0] != len(self.slots):
                    raise ValueError(f"layer {i}: {name} must hold this rank's S={len(self.slots)} slots "
                                     f"(R={R} over {P} ranks), got shape {tuple(t.shape)}")
        device = self.layer_tensors(0)[0].device
        if phy2log is None:
            phy2log = initial_placement(L, E, R)
        elif not isinstance(phy2log, torch.Tensor) or phy2log.is_floating_point() or phy2log.dtype == torch.bool:
            raise TypeError(f"phy2log must be an integer tensor [L={L}, R={R}], got "
                            f"{getattr(phy2log, 'dtype', type(phy2log).__name__)}")
        elif tuple(phy2log.shape) != (L, R):
            raise ValueError(f"phy2log must be [L={L}, R={R}], got {tuple(phy2log.shape)}")
        self.phy2log_host = phy2log.to("cpu", torch.int64).clone()  # planning copy (no device reads)
        log2phy, count = maps_from_phy2log(self.phy2log_host, E, R - E + 1)
        self.phy2log = self.phy2log_host.to(device)
        self.log2phy = log2phy.to(device)  # [L, E, M]
        self.replica_count = count.to(device)  # [L, E]
        self.recorder = LoadRecorder(L, R, config.window_size, device=device)
        self.steps = 0
        self.rearrangements = 0
        self._countdown = max(1, config.step_interval // 4)
        self._worker = None
        if config.mode == "async":
            from .async_worker import AsyncRearranger  # noqa: PLC0415 (threads only when asked for)

            self._owns_worker_group = group is not None and worker_group is None
            if self._owns_worker_group:
                worker_group = dist.new_group(ranks=dist.get_process_group_ranks(group))
            self._worker = AsyncRearranger(self, worker_group)

    @property
    def group(self):
        """The process group of the P ranks (None: a single process)."""
        if not self._world:
            return self._group
        world = dist.group.WORLD
        if world is None:
            raise RuntimeError("EplbState: the default process group has been destroyed")
        return world

    # -- per layer ---------------------------------------------------------------------
    def hook(self, layer: int) -> EplbLayerHook:
        """The runner hook of layer `layer` (install it as runner.eplb)."""
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer must be in [0, {self.num_layers}), got {layer}")
        return EplbLayerHook(self, layer)

    def layer_tensors(self, layer: int) -> List[torch.Tensor]:
        """This rank's per-expert tensors of one layer, each [S, ...]."""
        return [t for _, t in self._weights[layer]().per_expert_tensors()]

    def _names(self, layer: int) -> List[str]:
        return [n for n, _ in self._weights[layer]().per_expert_tensors()]

    def expert_map(self) -> torch.Tensor:
        """[R] int32: physical slot -> this rank's local slot, -1 for slots held elsewhere."""
        return physical_expert_map(self.num_physical, self.num_ranks, self.rank, device=self.phy2log.device)

    def set_num_tokens(self, num_tokens) -> None:
        """Rows >= num_tokens of the coming step are padding (an int or a [1] int tensor).

        It holds for that one step: step() resets it, so set it before every padded step."""
        self.recorder.set_num_tokens(num_tokens)

    # -- the step ----------------------------------------------------------------------
    def step(self, dummy: bool = False) -> bool:
        """Close a step; rearrange (or, async, start or commit) when due. Returns whether weights changed."""
        self.recorder.end_step(dummy)
        self.steps += 1
        changed = False
        if self._worker is not None and self._worker.active:
            changed = self._worker.poll()
        self._countdown -= 1
        if self._countdown == 0:
            self._countdown = self.config.step_interval
            if not self.rearranging:  # a rearrangement still running absorbs this trigger
                changed = self.rearrange() or changed
        return changed

    def logical_load(self) -> torch.Tensor:
        """The window's tokens per logical expert summed over all ranks: [L, E] int64 CPU."""
        load = self.recorder.window_load()  # [L, R]
        if self.group is not None:
            dist.all_reduce(load, group=self.group)
        return physical_to_logical_load(load, self.phy2log, self.num_logical).cpu()

    def plan(self, logical_load: torch.Tensor) -> torch.Tensor:
        """The new placement [L, R] int64 CPU for a load [L, E] (policy, then preserve slots).

        A layer whose plan does not beat its current placement by more than
        config.min_improvement keeps its current row (see EplbConfig)."""
        self._check_load(logical_load)
        c = self.config
        new, _, _ = rebalance_experts(logical_load, self.num_physical, c.num_groups, c.num_nodes, self.num_ranks)
        if c.preserve_slots:
            new = preserve_slots(self.phy2log_host, new, self.num_ranks)
        if c.min_improvement is not None:
            keep = ~improves(logical_load, self.phy2log_host, new, self.num_ranks, c.min_improvement)  # [L]
            new[keep] = self.phy2log_host[keep]
        return new

    def rearrange(self, logical_load: Optional[torch.Tensor] = None) -> bool:
        """Rearrange now, on every rank together. Returns whether any slot changed (here and now).

        In "sync" mode the plan is made and every layer moved before this returns. In
        "async" mode this starts the background worker and returns False; the following
        step() calls commit the layers as all ranks have them staged.

        Args:
            logical_load: [L, E] to plan for (identical on every rank); default: the
                all-reduced window.
        """
        if self.rearranging:
            raise RuntimeError("an asynchronous rearrangement is in progress; let step() finish it first")
        if logical_load is not None:
            self._check_load(logical_load)
        load = self.logical_load() if logical_load is None else logical_load
        if self._worker is not None:
            self._worker.start(load)
            return False
        new = self.plan(load)
        changed = False
        for layer in range(self.num_layers):
            if torch.equal(new[layer], self.phy2log_host[layer]):
                continue
            staged = self.exchange(layer, new[layer])
            self.commit(layer, new[layer], staged)
            changed = True
        self.rearrangements += 1
        return changed

    def _check_load(self, logical_load) -> None:
        """Raise unless logical_load is a real [L, E] tensor of finite non-negative counts."""
        L, E = self.num_layers, self.num_logical
        if not isinstance(logical_load, torch.Tensor):
            raise TypeError(f"logical_load must be a torch.Tensor [L={L}, E={E}], got {type(logical_load).__name__}")
        if tuple(logical_load.shape) != (L, E):
            raise ValueError(f"logical_load must be [L={L}, E={E}] (layers, logical experts), "
                             f"got {tuple(logical_load.shape)}")
        check_policy_args(logical_load, self.num_physical, self.config.num_groups, self.config.num_nodes,
                          self.num_ranks)

    def exchange(self, layer: int, new_row: torch.Tensor, group=None) -> StagedLayer:
        """Fetch the rows this rank needs for layer `layer` under placement new_row [R] (no writes)."""
        plan = plan_layer(self.phy2log_host[layer].tolist(), new_row.tolist(), self.num_ranks)[self.rank]
        return exchange_layer(self.layer_tensors(layer), plan, group=self.group if group is None else group)

    def commit(self, layer: int, new_row: torch.Tensor, staged: StagedLayer) -> None:
        """Write staged rows and switch layer `layer`'s maps to new_row [R]; forget its window.

        The maps are built first, so a placement they refuse leaves weights and maps as they were."""
        log2phy, count = maps_from_phy2log(new_row.view(1, -1), self.num_logical, self.log2phy.shape[-1])
        commit_layer(self.layer_tensors(layer), staged)
        self.phy2log_host[layer].copy_(new_row)
        self.phy2log[layer].copy_(new_row)
        self.log2phy[layer].copy_(log2phy[0])
        self.replica_count[layer].copy_(count[0])
        self.recorder.clear(layer)

    def close(self) -> None:
        """Finish an asynchronous rearrangement in progress and stop its worker (collective).

        Call it on every rank, at the same step, before the process group is destroyed: a
        worker left inside a transfer would abort the process at shutdown. The layers still to
        move are committed as in step(); no-op in "sync" mode or when nothing is running.

        The worker's process group is released (destroyed when enable_eplb/EplbState created
        it), so no gloo worker threads outlive destroy_process_group(); asynchronous
        rearrangements cannot start after close()."""
        if self._worker is None:
            return
        self._worker.finish()
        worker_group, self._worker.group = self._worker.group, None
        self._worker.closed = True  # in one process too: a worker started later would outlive the caller's shutdown
        if worker_group is not None and self._owns_worker_group:
            dist.destroy_process_group(worker_group)

    @property
    def rearranging(self) -> bool:
        """Whether an asynchronous rearrangement is in progress."""
        return self._worker is not None and self._worker.active

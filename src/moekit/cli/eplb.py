"""`moekit eplb`: plan an expert placement from recorded loads, or size redundant experts on
synthetic skewed loads.

    moekit eplb plan --load FILE --gpus P --nodes N --redundant R [--groups G] [--out placement.json] [--plot out.png]
                     [--current placement.json [--min-improvement 0.0]]
    moekit eplb simulate [--experts E --layers L --gpus P --nodes N --groups G]
                         [--redundant 0,16,32] [--dist lognormal --sigma 1.0 | --dist zipf --alpha 1.0]

FILE holds token counts [L, E] (layers x logical experts) as .npy, .pt or .json (a nested
list, or an object with a "load" entry). "before" is the placement without EPLB: experts in
contiguous blocks over the GPUs, no replicas; with --current, the placement in that file (an
earlier plan's JSON), re-planned as a running EplbState would: slots preserved, and a layer
kept as it is unless the plan lowers its busiest GPU's load by more than --min-improvement.
Balancedness = mean / max load per GPU.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import sys
from typing import Dict, List

import torch

from moekit.eplb.maps import maps_from_phy2log
from moekit.eplb.policy import (balancedness, check_sizes, gpu_loads, improves, preserve_slots, rebalance_experts,
                                static_gpu_loads)

__all__ = ["add_parser", "read_load", "plan_report", "synthetic_load"]

DISTRIBUTIONS = ("lognormal", "zipf")


def add_parser(sub) -> None:
    p = sub.add_parser("eplb", help="expert-parallel load balancing: plan a placement, simulate skewed loads")
    actions = p.add_subparsers(dest="eplb_action", metavar="ACTION")
    plan = actions.add_parser("plan", help="placement JSON and balancedness before/after from a load file")
    plan.add_argument("--load", required=True, help="token counts [L, E] as .npy, .pt or .json")
    _placement_args(plan, redundant_help="redundant experts (physical slots = E + this)", redundant_type=int)
    plan.add_argument("--out", default=None, help="write the placement as JSON here")
    plan.add_argument("--plot", default=None, help="draw per-GPU load before/after into this image (matplotlib)")
    plan.add_argument("--current", default=None,
                      help="the placement in use (an earlier plan's JSON): plan from it instead of the static one")
    plan.add_argument("--min-improvement", type=float, default=0.0,
                      help="with --current: keep a layer unless the plan lowers its busiest GPU's load by more "
                           "than this fraction (default 0.0: any gain; EplbConfig.min_improvement)")
    plan.set_defaults(func=run_plan)
    sim = actions.add_parser("simulate", help="balancedness on synthetic skewed loads, per redundant count")
    sim.add_argument("--experts", type=int, default=256, help="E logical experts (default 256)")
    sim.add_argument("--layers", type=int, default=61, help="L layers (default 61)")
    sim.add_argument("--gpus", type=int, default=32, help="P GPUs (default 32)")
    sim.add_argument("--nodes", type=int, default=4, help="N nodes (default 4)")
    sim.add_argument("--groups", type=int, default=1, help="G expert groups (default 1: no groups)")
    sim.add_argument("--redundant", default="0,32", help="comma-separated redundant counts (default 0,32)")
    sim.add_argument("--dist", default="lognormal", choices=DISTRIBUTIONS)
    sim.add_argument("--sigma", type=float, default=1.0, help="log-normal sigma (default 1.0)")
    sim.add_argument("--alpha", type=float, default=1.0, help="Zipf exponent (default 1.0)")
    sim.add_argument("--tokens", type=int, default=1_000_000, help="token assignments per layer (default 1e6)")
    sim.add_argument("--seed", type=int, default=0)
    sim.add_argument("--out", default=None, help="write the summary as JSON here")
    sim.add_argument("--plot", default=None, help="draw balancedness against redundant experts (matplotlib)")
    sim.set_defaults(func=run_simulate)
    p.set_defaults(func=lambda args: p.print_help() or 2)


def _placement_args(p, redundant_help: str, redundant_type) -> None:
    p.add_argument("--gpus", type=int, required=True, help="P GPUs (expert-parallel ranks)")
    p.add_argument("--nodes", type=int, required=True, help="N nodes the GPUs span")
    p.add_argument("--redundant", type=redundant_type, required=True, help=redundant_help)
    p.add_argument("--groups", type=int, default=1, help="G expert groups (default 1: no groups)")


def _read_file(path: str, ext: str):
    """The raw content of a load file: a tensor (.npy, .pt) or parsed JSON."""
    if ext == ".npy":
        import numpy as np  # noqa: PLC0415

        return torch.from_numpy(np.load(path, allow_pickle=False))
    if ext == ".pt":
        return torch.load(path, map_location="cpu", weights_only=True)
    with open(path) as f:
        return json.load(f)


def _holds_bool(value) -> bool:
    return isinstance(value, bool) or (isinstance(value, list) and any(_holds_bool(v) for v in value))


def read_load(path: str) -> torch.Tensor:
    """Token counts [L, E] from a .npy, .pt or .json file, as float64."""
    if not os.path.exists(path):
        raise ValueError(f"--load: no such file {path!r}")
    ext = os.path.splitext(path)[1].lower()
    if ext not in (".npy", ".pt", ".json"):
        raise ValueError(f"--load must end in .npy, .pt or .json, got {path!r}")
    try:
        data = _read_file(path, ext)
    except (OSError, ValueError, TypeError, RuntimeError, EOFError, pickle.UnpicklingError) as err:
        raise ValueError(f"--load: cannot read {path} as {ext[1:]}: {err}") from None
    if ext == ".pt" and not isinstance(data, torch.Tensor):
        raise ValueError(f"--load: {path} must hold one tensor [L, E], got {type(data).__name__}")
    if ext == ".json":
        if isinstance(data, dict):
            if "load" not in data:
                raise ValueError(f"--load: the JSON object in {path} needs a 'load' entry [L, E]")
            data = data["load"]
        if _holds_bool(data):  # torch.tensor would take true / false as 1 / 0
            raise ValueError(f"--load: {path} must hold token counts [L, E], got true/false entries")
        try:
            data = torch.tensor(data, dtype=torch.float64)
        except (TypeError, ValueError) as err:
            raise ValueError(f"--load: {path} must hold a rectangular list of numbers [L, E]: {err}") from None
    if data.dim() != 2 or data.shape[0] < 1 or data.shape[1] < 1:
        raise ValueError(f"--load: expected token counts [L, E] with L, E >= 1, got shape {tuple(data.shape)}")
    if data.dtype == torch.bool or data.is_complex():
        raise ValueError(f"--load: expected real token counts, got {data.dtype}")
    return data.to(torch.float64)


def read_placement(path: str, num_layers: int, num_slots: int) -> torch.Tensor:
    """phy2log [L, R] int64 from a JSON file: an earlier plan's report (its "phy2log") or a bare list."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as err:
        raise ValueError(f"--current: cannot read {path} as JSON: {err}") from None
    if isinstance(data, dict):
        if "phy2log" not in data:
            raise ValueError(f"--current: the JSON object in {path} needs a 'phy2log' entry [L, R]")
        data = data["phy2log"]
    try:
        phy2log = torch.tensor(data)
    except (TypeError, ValueError) as err:
        raise ValueError(f"--current: {path} must hold a rectangular list of expert ids [L, R]: {err}") from None
    if phy2log.is_floating_point() or phy2log.dtype == torch.bool or tuple(phy2log.shape) != (num_layers, num_slots):
        raise ValueError(f"--current: expected integer expert ids [L={num_layers}, R={num_slots}] (the load's layers, "
                         f"E + --redundant slots), got {phy2log.dtype} {tuple(phy2log.shape)}")
    return phy2log.to(torch.int64)


def plan_report(load: torch.Tensor, gpus: int, nodes: int, redundant: int, groups: int,
                current: torch.Tensor = None, min_improvement: float = 0.0) -> Dict:
    """Plan a placement for load [L, E] and measure it; returns the JSON-ready dict.

    With current ([L, R] phy2log in use), "before" is that placement, slots are preserved and a
    layer whose plan does not beat it by more than min_improvement keeps it (EplbState.plan)."""
    L, E = load.shape
    if isinstance(redundant, bool) or not isinstance(redundant, int) or redundant < 0:
        raise ValueError(f"--redundant must be an int >= 0, got {redundant!r}")
    for flag, v in (("--gpus", gpus), ("--nodes", nodes), ("--groups", groups)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{flag} must be an int >= 1, got {v!r}")
    R = E + redundant
    check_sizes(E, R, groups, nodes, gpus, {  # the policy's preconditions, in the command's terms
        "E": f"the E={E} experts", "R": f"the {R} physical slots (E={E} experts + --redundant {redundant})",
        "G": f"--groups {groups}", "N": f"--nodes {nodes}", "P": f"--gpus {gpus}"})
    phy2log, log2phy, count = rebalance_experts(load, R, groups, nodes, gpus)
    kept: List[int] = []
    if current is None:
        before, overall_before = balancedness(static_gpu_loads(load, gpus))
    else:
        if isinstance(min_improvement, bool) or not 0.0 <= min_improvement < 1.0:
            raise ValueError(f"--min-improvement must be in [0, 1), got {min_improvement!r}")
        before, overall_before = balancedness(gpu_loads(load, current, gpus))  # checks the ids
        phy2log = preserve_slots(current, phy2log, gpus)
        keep = ~improves(load, current, phy2log, gpus, min_improvement)  # [L]
        phy2log[keep] = current[keep]
        kept = keep.nonzero().flatten().tolist()
        log2phy, count = maps_from_phy2log(phy2log, E, R - E + 1)
    after_loads = gpu_loads(load, phy2log, gpus)
    after, overall_after = balancedness(after_loads)
    return {
        "num_layers": L,
        "num_logical_experts": E,
        "num_redundant_experts": redundant,
        "num_physical_experts": R,
        "num_gpus": gpus,
        "num_nodes": nodes,
        "num_groups": groups,
        "policy": "hierarchical" if groups % nodes == 0 else "global",
        "slots_per_gpu": R // gpus,
        "before": "the static placement (contiguous blocks, no replicas)" if current is None else
                  "the current placement (--current)",
        "kept_layers": kept,
        "layout": "slot i lives on GPU i // slots_per_gpu; log2phy rows are padded with -1",
        "phy2log": phy2log.tolist(),
        "log2phy": log2phy.tolist(),
        "replica_count": count.tolist(),
        "balancedness": {
            "before": [round(v, 6) for v in before.tolist()],
            "after": [round(v, 6) for v in after.tolist()],
            "overall_before": round(overall_before, 6),
            "overall_after": round(overall_after, 6),
        },
    }


def run_plan(args) -> int:
    try:
        if args.plot:
            _pyplot()  # a missing matplotlib is said before the work, not after it
        load = read_load(args.load)
        current = None
        if args.current is not None:
            current = read_placement(args.current, load.shape[0], load.shape[1] + args.redundant)
        report = plan_report(load, args.gpus, args.nodes, args.redundant, args.groups, current, args.min_improvement)
    except ValueError as err:
        print(f"moekit eplb plan: error: {err}", file=sys.stderr)
        return 2
    b = report["balancedness"]
    print(f"{report['num_layers']} layers, E={report['num_logical_experts']} -> R={report['num_physical_experts']} "
          f"slots on {args.gpus} GPUs in {args.nodes} nodes, G={args.groups} ({report['policy']} policy)")
    print(f"layer  balancedness before -> after (before: {report['before']})")
    for i, (x, y) in enumerate(zip(b["before"], b["after"])):
        print(f"{i:5d}  {x:.4f} -> {y:.4f}" + ("  kept: the plan is no better" if i in report["kept_layers"] else ""))
    print(f"overall (sum of means / sum of maxima): {b['overall_before']:.4f} -> {b['overall_after']:.4f}")
    try:
        if args.out:
            with open(args.out, "w") as f:
                json.dump(report, f)
            print(f"placement written to {args.out}")
        if args.plot:
            _plot_plan(load, report, args.plot, current)
            print(f"plot written to {args.plot}")
    except (OSError, ValueError) as err:
        print(f"moekit eplb plan: error: {err}", file=sys.stderr)
        return 2
    return 0


def synthetic_load(dist: str, layers: int, experts: int, tokens: int, *, sigma: float = 1.0, alpha: float = 1.0,
                   seed: int = 0) -> torch.Tensor:
    """Skewed token counts [L, E] summing to about `tokens` per layer.

    "lognormal": weights exp(sigma * N(0, 1)).  "zipf": weight 1 / rank^alpha, ranks shuffled per layer.
    """
    if dist not in DISTRIBUTIONS:
        raise ValueError(f"dist must be one of {list(DISTRIBUTIONS)}, got {dist!r}")
    for name, v in (("layers", layers), ("experts", experts), ("tokens", tokens)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    g = torch.Generator().manual_seed(seed)
    if dist == "lognormal":
        if not (sigma > 0 and math.isfinite(sigma)):
            raise ValueError(f"sigma must be finite and > 0, got {sigma}")
        # softmax = exp normalised per layer, without exp's overflow at large sigma
        w = (sigma * torch.randn(layers, experts, generator=g, dtype=torch.float64)).softmax(-1)
    else:
        if not alpha > 0:
            raise ValueError(f"alpha must be > 0, got {alpha}")
        ranks = torch.stack([torch.randperm(experts, generator=g) for _ in range(layers)]) + 1
        w = ranks.to(torch.float64).pow(-alpha)
    return (w / w.sum(-1, keepdim=True) * tokens).round()


def _redundant_list(text: str) -> List[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"--redundant must be comma-separated ints, got {text!r}") from None
    if not values or any(v < 0 for v in values):
        raise ValueError(f"--redundant must list ints >= 0, got {text!r}")
    return values


def run_simulate(args) -> int:
    try:
        if args.plot:
            _pyplot()
        load = synthetic_load(args.dist, args.layers, args.experts, args.tokens, sigma=args.sigma,
                              alpha=args.alpha, seed=args.seed)
        rows = []
        for red in _redundant_list(args.redundant):
            try:
                rep = plan_report(load, args.gpus, args.nodes, red, args.groups)
            except ValueError as err:
                raise ValueError(f"--redundant {red}: {err}") from None
            b = rep["balancedness"]
            rows.append({"redundant": red, "slots": rep["num_physical_experts"], "policy": rep["policy"],
                         "overall_before": b["overall_before"], "overall_after": b["overall_after"],
                         "worst_layer_after": min(b["after"])})
    except ValueError as err:
        print(f"moekit eplb simulate: error: {err}", file=sys.stderr)
        return 2
    shape = f"sigma={args.sigma}" if args.dist == "lognormal" else f"alpha={args.alpha}"
    print(f"{args.dist} ({shape}) loads, {args.layers} layers x {args.experts} experts on {args.gpus} GPUs "
          f"in {args.nodes} nodes, G={args.groups}, seed {args.seed}")
    print("redundant  slots  policy        before   after   worst layer after")
    for r in rows:
        print(f"{r['redundant']:9d}  {r['slots']:5d}  {r['policy']:12s}  {r['overall_before']:.4f}   "
              f"{r['overall_after']:.4f}  {r['worst_layer_after']:.4f}")
    try:
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"dist": args.dist, "sigma": args.sigma, "alpha": args.alpha, "layers": args.layers,
                           "experts": args.experts, "gpus": args.gpus, "nodes": args.nodes, "groups": args.groups,
                           "tokens": args.tokens, "seed": args.seed, "results": rows}, f, indent=1)
            print(f"summary written to {args.out}")
        if args.plot:
            _plot_simulate(rows, args.plot)
            print(f"plot written to {args.plot}")
    except (OSError, ValueError) as err:
        print(f"moekit eplb simulate: error: {err}", file=sys.stderr)
        return 2
    return 0


def _pyplot():
    try:
        import matplotlib  # noqa: PLC0415

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install moekit[cli]") from None
    return plt


def _plot_plan(load: torch.Tensor, report: Dict, path: str, current: torch.Tensor = None) -> None:
    """Per-GPU load of the most imbalanced layer before/after, and per-layer balancedness."""
    plt = _pyplot()
    b = report["balancedness"]
    worst = min(range(len(b["before"])), key=lambda i: b["before"][i])
    w = slice(worst, worst + 1)
    before = (static_gpu_loads(load[w], report["num_gpus"]) if current is None else
              gpu_loads(load[w], current[w], report["num_gpus"]))[0]
    after = gpu_loads(load[w], torch.tensor(report["phy2log"][w]), report["num_gpus"])[0]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4))
    gpus = torch.arange(report["num_gpus"]).tolist()
    ax1.bar([g - 0.2 for g in gpus], before.tolist(), width=0.4, label="before")
    ax1.bar([g + 0.2 for g in gpus], after.tolist(), width=0.4, label="after")
    ax1.set(title=f"layer {worst} (most imbalanced before): tokens per GPU", xlabel="GPU", ylabel="tokens")
    ax1.legend()
    ax2.plot(b["before"], label=f"before (overall {b['overall_before']:.3f})")
    ax2.plot(b["after"], label=f"after (overall {b['overall_after']:.3f})")
    ax2.set(title="balancedness (mean / max load per GPU)", xlabel="layer", ylim=(0, 1.02))
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _plot_simulate(rows: List[Dict], path: str) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    red = [r["redundant"] for r in rows]
    ax.plot(red, [r["overall_after"] for r in rows], marker="o", label="overall after")
    ax.plot(red, [r["worst_layer_after"] for r in rows], marker="x", label="worst layer after")
    ax.axhline(rows[0]["overall_before"], linestyle="--", color="grey", label="without EPLB")
    ax.set(xlabel="redundant experts", ylabel="balancedness", ylim=(0, 1.02))
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)

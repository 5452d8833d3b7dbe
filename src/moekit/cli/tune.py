"""`moekit tune`: search the Triton experts' tile configs for one MoE shape on this GPU and
write them as `E={E},N={I},device_name={gpu}.json` (the format of kernels/tuning.py).

Search, per batch size M: compile every candidate of kernels.tuning.search_space in
parallel processes; time each GEMM1 candidate with the default GEMM2 tiles of its row
block, and the complete configs on the prefill kernels (kernels.tuning.prefill_space: every
knob over a few tile pairs); then, unless a prefill config won, time the GEMM2 candidates
with the winning GEMM1; last, the winner's late variants (kernels.tuning.late_variants:
GEMM2 launched with PDL and both GEMMs fused into one launch, on the direct path). Each timing is a CUDA graph
of calls with fresh routing (benchmarks/gpu.py), so it includes the alignment and the
sum over k at that row block. Last, the CONFIRM_TOP fastest configs are timed again in
CONFIRM_ROUNDS interleaved rounds and the lowest median wins: the top candidates often differ
by 1-3 %, less than one timing's spread, so a single timing would pick by chance.

`--quant SCHEME` tunes the quantized kernels instead (cli/tune_quant.py) and writes the
scheme's table (`...,dtype=fp8_w8a8[,block_shape=[128,128]].json`); `--static-scales` with
fp8_w8a8 tunes static per-tensor activation scales, the prefill kernels among the candidates.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import time
from dataclasses import replace
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from moekit.cli.main import UsageError, installed

__all__ = ["add_parser", "run", "plan_shape", "search_shape", "write_configs", "confirm_fastest", "BudgetedTimings"]

DEFAULT_BATCH_SIZES = (1, 16, 64, 256, 1024, 4096, 16384)
# The search's fastest configs timed again, and in how many interleaved rounds.
CONFIRM_TOP, CONFIRM_ROUNDS = 3, 3


def add_parser(sub) -> None:
    from moekit.benchmarks.gpu import GPU_SHAPES  # noqa: PLC0415
    from moekit.quant import SCHEMES  # noqa: PLC0415

    p = sub.add_parser("tune", help="tune the Triton experts kernels for one shape on this GPU")
    p.add_argument("--shape", choices=[s[0] for s in GPU_SHAPES], help="a PERF.md shape (sets E, k, H, I)")
    p.add_argument("--experts", type=int, help="E, local experts")
    p.add_argument("--top-k", type=int, help="k, experts per token")
    p.add_argument("--hidden", type=int, help="H, hidden size")
    p.add_argument("--intermediate", type=int, help="I, expert intermediate size")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--batch-sizes", default=",".join(map(str, DEFAULT_BATCH_SIZES)),
                   help="comma-separated token counts M to tune (calls use the nearest M)")
    p.add_argument("--out-dir", default=None,
                   help="folder for the JSON file (default: MOEKIT_TUNED_CONFIG_DIR, else the current folder)")
    p.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 2),
                   help="processes compiling candidates in parallel")
    p.add_argument("--budget", type=float, default=None, help="seconds of timing per batch size (default: no limit)")
    p.add_argument("--quant", choices=list(SCHEMES), default=None,
                   help="tune the quantized kernels of this scheme instead (writes its ...,dtype=... table)")
    p.add_argument("--static-scales", action="store_true",
                   help="with --quant fp8_w8a8: static per-tensor activation scales (adds the prefill kernels)")
    p.set_defaults(func=run)


def _shape(args) -> Tuple[int, int, int, int]:
    if args.shape:
        from moekit.benchmarks.gpu import shape_by_name  # noqa: PLC0415

        _, E, k, H, I = shape_by_name(args.shape)
        return E, k, H, I
    given = (args.experts, args.top_k, args.hidden, args.intermediate)
    if any(v is None for v in given):
        raise UsageError("give --shape or all of --experts, --top-k, --hidden, --intermediate")
    for flag, v in zip(("--experts", "--top-k", "--hidden", "--intermediate"), given):
        if v < 1:
            raise UsageError(f"{flag} must be >= 1, got {v}")
    if args.top_k > args.experts:
        raise UsageError(f"--top-k must be <= --experts, got {args.top_k} > {args.experts}")
    return given


def _batch_sizes(text: str) -> List[int]:
    try:
        Ms = sorted({int(m) for m in text.split(",") if m.strip()})
    except ValueError:
        raise UsageError(f"--batch-sizes must be comma-separated integers, got {text!r}") from None
    if not Ms or Ms[0] < 1:
        raise UsageError(f"--batch-sizes must hold token counts >= 1, got {text!r}")
    return Ms


def plan_shape(E: int, k: int, H: int, I: int, dtype: torch.dtype, Ms: Sequence[int],
               device: Optional[str] = None) -> Tuple[Dict, list]:
    """The candidates of each M and the compile jobs they need (see benchmarks.gpu.precompile).

    device: the GPU's device_name(): each M's baseline is then the tiles its calls take now (a
    table's entry or an untuned rule, tuning.get_config; timed too, so it stays if nothing beats
    it); None: the heuristic.
    Returns ({M: (baseline MoEConfig, stage-1 candidates, {BLOCK_SIZE_M: gemm2 tiles})}, jobs).
    """
    from moekit.kernels.tuning import (  # noqa: PLC0415
        MoEConfig, compile_variant, default_config, get_config, late_variants, prefill_space, search_space,
        use_direct,
    )

    def compiled(cfgs, M):
        """cfgs and their late variants, one config per set of kernels."""
        out = list(cfgs) + [v for c in cfgs for v in late_variants(c, M, E, k)]
        return list({json.dumps(c.to_json(), sort_keys=True): c for c in map(compile_variant, out)}.values())

    elem = torch.finfo(dtype).bits // 8
    dname = str(dtype).replace("torch.", "")
    plans, jobs = {}, []
    for M in Ms:
        default = default_config(M, E, k, H, I, elem)
        g1s, g2s = search_space(M, E, k, elem)
        stage1 = [default] + [MoEConfig(g1, replace(default.gemm2, BLOCK_SIZE_M=g1.BLOCK_SIZE_M)) for g1 in g1s]
        stage1 += prefill_space(M, E, k, elem)  # complete configs on the prefill kernels
        current = get_config(M, E, k, H, I, dtype, device) if device else default
        plans[M] = (current, stage1, g2s)
        if current != default:
            jobs.append((H, I, dname, "silu", use_direct(M, k, E), current.to_json()))
        direct = use_direct(M, k, E)
        jobs += [(H, I, dname, "silu", direct, c.to_json()) for c in compiled(stage1, M)]
        for bm, cands in g2s.items():
            g1 = replace(default.gemm1, BLOCK_SIZE_M=bm)  # any gemm1 of these rows compiles the gemm2s
            pairs = [MoEConfig(g1, g2) for g2 in cands]
            jobs += [(H, I, dname, "silu", direct, c.to_json()) for c in compiled(pairs, M)]
    return plans, jobs


def confirm_fastest(first: Dict[str, float], measure: Callable[[str], float], top: int = CONFIRM_TOP,
                    rounds: int = CONFIRM_ROUNDS) -> Tuple[str, Dict[str, list]]:
    """The key with the lowest median over its first timing and `rounds` more, among the `top`
    fastest of `first` ({key: us}, inf for failed ones). Rounds time every key once, each round
    starting one key later, so no key always runs right after the same one.

    Returns (winner, {key: [first timing, then one per round]}).
    """
    finite = sorted((us, key) for key, us in first.items() if us != float("inf"))
    if not finite:
        raise ValueError("no candidate ran: every first timing is inf")
    keys = [key for _, key in finite[:top]]
    times = {key: [first[key]] for key in keys}
    if len(keys) > 1:
        for r in range(rounds):
            for key in keys[r % len(keys):] + keys[:r % len(keys)]:
                times[key].append(measure(key))
    return min(keys, key=lambda key: (statistics.median(times[key]), keys.index(key))), times


class BudgetedTimings:
    """First timings of one batch size's candidates, by key: each candidate is measured once;
    after `budget_s` seconds from the first timing (which also compiles the alignment) the rest
    count as inf. `items` maps each key to its candidate; `step` hears each timing as a line."""

    def __init__(self, M: int, measure: Callable, key: Callable, label: Callable, budget_s: Optional[float] = None,
                 step: Optional[Callable[[str], None]] = None):
        self.M, self.measure, self.key, self.label, self.budget_s, self.step = M, measure, key, label, budget_s, step
        self.seen: Dict[str, float] = {}
        self.items: Dict[str, object] = {}
        self.start: Optional[float] = None

    def __call__(self, item) -> float:
        key = self.key(item)
        self.items[key] = item
        if key not in self.seen:
            if self.budget_s is not None and self.start is not None and \
                    time.perf_counter() - self.start > self.budget_s:
                self.seen[key] = float("inf")
            else:
                self.seen[key] = self.measure(item)
                self.start = self.start if self.start is not None else time.perf_counter()
            if self.step:
                self.step(f"M={self.M} {self.label(item)}: {self.seen[key]:.1f} us")
        return self.seen[key]


def search_shape(
    E: int, k: int, H: int, I: int, dtype: torch.dtype, plans: Dict, *, budget_s: Optional[float] = None,
    step: Optional[Callable[[str], None]] = None, device: str = "cuda",
) -> Tuple[Dict[int, "MoEConfig"], Dict[int, Dict]]:  # noqa: F821
    """Time the planned candidates (compiled beforehand) and keep the fastest of each M.

    Args:
        E, k, H, I: the MoE shape.  dtype: bf16 or fp16.  plans: from plan_shape.
        budget_s: timing seconds per M (None: every candidate).  step: told each timing as a line.
        device: where to time ("cuda"; "cpu" only as a dry run under the Triton interpreter).
    Returns:
        ({M: best MoEConfig}, {M: {"us": best (its median), "default_us": the current tiles' time, "tried": n,
        "timings": {config JSON: us (inf: failed or out of budget)}, "confirm": {config JSON:
        [us, ...]} (confirm_fastest's timings)}}).
    """
    from moekit.benchmarks.gpu import graph_time_us, routing_sets  # noqa: PLC0415
    from moekit.kernels.launch import fused_moe  # noqa: PLC0415
    from moekit.kernels.tuning import MoEConfig, late_variants  # noqa: PLC0415

    w13 = torch.randn(E, 2 * I, H, device=device, dtype=dtype) * H ** -0.5
    w2 = torch.randn(E, H, I, device=device, dtype=dtype) * I ** -0.5
    best: Dict[int, MoEConfig] = {}
    info: Dict[int, Dict] = {}
    for M, (default, stage1, g2s) in plans.items():
        sets = routing_sets(M, E, k, H, 4 if M <= 1024 else 2, dtype, device)

        def measure(cfg: MoEConfig) -> float:
            try:
                return graph_time_us(
                    lambda x, w, ids: fused_moe(x, w13, w2, None, None, w, ids, None, "silu", config=cfg),
                    sets, replays=3)
            except Exception:  # noqa: BLE001 - a config that cannot run is skipped
                return float("inf")

        timed = BudgetedTimings(M, measure, lambda c: json.dumps(c.to_json(), sort_keys=True), MoEConfig.to_json,
                                budget_s, step)
        seen, configs = timed.seen, timed.items

        winner = min(stage1, key=timed)
        if winner.prefill is None:  # prefill candidates come as tuned pairs of GEMM1 and GEMM2 tiles
            winner = min([winner] + [MoEConfig(winner.gemm1, g2) for g2 in g2s.get(winner.block_m, [])], key=timed)
        winner = min([winner] + late_variants(winner, M, E, k), key=timed)
        default_us = timed(default)
        confirm: Dict[str, list] = {}
        us = float("inf")  # nothing ran (a dry run off the GPU): the search's pick stays
        if any(t != float("inf") for t in seen.values()):
            key, confirm = confirm_fastest(seen, lambda key: measure(configs[key]))
            winner, us = configs[key], statistics.median(confirm[key])
        if step:
            step(f"M={M} confirmed {winner.to_json()}: {us:.1f} us")
        best[M] = winner
        info[M] = {"us": us, "default_us": default_us,
                   "tried": sum(1 for v in seen.values() if v != float("inf")), "timings": dict(seen),
                   "confirm": confirm}
        del sets
    return best, info


def write_configs(table: Dict[int, "MoEConfig"], E: int, I: int, device: str, dtype: torch.dtype,  # noqa: F821
                  folder: str) -> str:
    """Write {M: config} as the JSON file kernels/tuning.py reads; returns its path."""
    from moekit.kernels.tuning import config_dtype, config_file_name  # noqa: PLC0415

    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, config_file_name(E, I, device, config_dtype(dtype)))
    with open(path, "w", encoding="utf-8") as fh:
        json.dump({str(M): table[M].to_json() for M in sorted(table)}, fh, indent=1)
        fh.write("\n")
    return path


@contextlib.contextmanager
def _progress(total: int, E: int, I: int):
    """A rich progress bar over `total` timings; yields step(line), which advances it by one."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn  # noqa: PLC0415

    with Progress(TextColumn("[bold]tune[/] E={task.fields[E]} I={task.fields[I]}"), BarColumn(),
                  TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn(),
                  TextColumn("{task.description}")) as bar:
        task = bar.add_task("", total=total, E=E, I=I)
        yield lambda line: bar.update(task, advance=1, description=line[-70:])


def run(args) -> int:
    E, k, H, I = _shape(args)
    if args.static_scales and args.quant != "fp8_w8a8":
        raise UsageError("--static-scales goes with --quant fp8_w8a8 (static per-tensor fp8 scales)")
    Ms = _batch_sizes(args.batch_sizes)
    if args.workers < 1:
        raise UsageError(f"--workers must be >= 1, got {args.workers}")
    if args.budget is not None and not args.budget > 0:
        raise UsageError(f"--budget must be > 0 seconds, got {args.budget}")
    if args.out_dir is not None and os.path.exists(args.out_dir) and not os.path.isdir(args.out_dir):
        raise UsageError(f"--out-dir must be a folder (made if missing), got the file {args.out_dir!r}")
    if not torch.cuda.is_available():
        raise SystemExit("moekit tune needs a CUDA GPU (torch.cuda.is_available() is False)")
    if not installed("triton"):
        raise SystemExit("moekit tune times the Triton kernels, so it needs Triton: `pip install moekit[gpu]`")
    if not installed("rich.progress"):
        raise SystemExit("moekit tune's progress bar needs rich: `pip install moekit[cli]`")
    from moekit.benchmarks.gpu import precompile  # noqa: PLC0415
    from moekit.config import settings  # noqa: PLC0415
    from moekit.kernels.tuning import device_name  # noqa: PLC0415

    dtype = getattr(torch, args.dtype)
    folder = args.out_dir or settings.tuned_config_dir or "."
    if args.quant is not None:
        from moekit.cli.tune_quant import run_quant  # noqa: PLC0415

        return run_quant(args, E, k, H, I, Ms, dtype, folder, _progress)
    plans, jobs = plan_shape(E, k, H, I, dtype, Ms, device_name())
    print(f"compiling {len(jobs)} candidate configs in {args.workers} processes ...")
    failures = precompile(jobs, args.workers)
    if failures:
        print(f"{len(failures)} candidates failed to compile or run and are skipped, e.g. {failures[0]}")
    total = sum(len(p[1]) + max((len(c) for c in p[2].values()), default=0) + 1 for p in plans.values())
    with _progress(total, E, I) as advance:
        table, info = search_shape(E, k, H, I, dtype, plans, budget_s=args.budget, step=advance)
    path = write_configs(table, E, I, device_name(), dtype, folder)
    for M in sorted(info):
        i = info[M]
        print(f"M={M:6d}: {i['us']:9.1f} us (current {i['default_us']:9.1f} us, {i['tried']} tried)  {table[M].to_json()}")
    print(f"wrote {path}")
    return 0

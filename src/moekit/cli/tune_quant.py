"""`moekit tune --quant SCHEME`: search the quantized Triton experts' tiles and knobs for one
MoE shape on this GPU and write them as the quantized table kernels/quant_tuning.py reads
(`E={E},N={I},device_name={gpu},dtype={fp8_w8a8|...}[,block_shape=[128,128]].json`).

Search, per batch size M, in the unquantized search's order (cli/tune.py): the call's current
choice (tuned entry, else fitted unquantized tiles) and the GEMM1 candidates of
kernels.quant_tuning.quant_search_space, each beside the current choice's GEMM2 (or the first
GEMM2 candidate of its row block: gemm1_candidate); then the GEMM2 candidates with the winning
GEMM1; then the winner with one knob flipped (PDL; x quantized in its own launch for fp8
activations; the other int4 conversions). With static fp8
scales (--static-scales, fp8_w8a8) the prefill kernels' candidates (fp8_prefill_space) are
timed too; the fastest is kept as the entry's `static_prefill` when it beats the sorted kernels.
The fastest few are timed again in interleaved rounds (tune.confirm_fastest). Every timing is
a CUDA graph of calls with fresh routing, alignment, quantization and the sum over k included.
"""

from __future__ import annotations

import json
import os
import statistics
from dataclasses import replace
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from moekit.cli.main import UsageError

__all__ = ["plan_quant", "gemm1_candidate", "search_quant", "write_quant_configs", "run_quant", "GEMM1_KNOBS",
           "GEMM2_KNOBS"]

# GEMM1 knobs a GEMM2 candidate keeps from the GEMM1 winner; GEMM2 knobs a GEMM1 candidate takes
# from the current choice's GEMM2.
GEMM1_KNOBS = ("gate_up", "prefetch1", "swap1", "w_convert", "fold_w")  # fold_w: chosen with GEMM1, kept by both
GEMM2_KNOBS = ("prefetch2", "split_k", "swap2")


def _key(entry: Dict) -> str:
    return json.dumps(entry, sort_keys=True)


def gemm1_candidate(t, kn: Dict, g2s: Dict, default: Tuple) -> Tuple:
    """(MoEConfig, QuantKnobs) that times GEMM1 tiles t with knob fields kn: beside the current
    choice's GEMM2 (its tiles and GEMM2 knobs) when its rows per tile are t's, so GEMM1 candidates
    and the current choice differ in GEMM1 alone; else beside the first GEMM2 candidate of t's rows.
    (A GEMM1 knob can pay only beside a GEMM2 knob: 32-column swapped gate_up tiles at Qwen3 fp8
    M = 256 gained 2.3 % beside a swapped GEMM2 and lost beside an unswapped one.)"""
    from moekit.kernels.quant_tuning import QuantKnobs  # noqa: PLC0415
    from moekit.kernels.tuning import MoEConfig  # noqa: PLC0415

    cfg, knobs = default
    if cfg.prefill is None and cfg.block_m == t.BLOCK_SIZE_M:
        kn2 = {f: v for f, v in knobs.to_json().items() if f in GEMM2_KNOBS}
        return MoEConfig(t, cfg.gemm2), QuantKnobs(**dict(kn, **kn2))
    return MoEConfig(t, g2s[t.BLOCK_SIZE_M][0][0]), QuantKnobs(**kn)


def plan_quant(E: int, k: int, H: int, I: int, Ms: Sequence[int], scheme_name: str, static: bool,
               dtype: torch.dtype = torch.bfloat16, device: Optional[str] = None) -> Tuple[Dict, list]:
    """The candidates of each M and their compile jobs (benchmarks.gpu._compile_quant_job's).

    Args:
        scheme_name: a moekit.quant scheme.  static: static per-tensor fp8 activation scales.
        device: device_name() of the tables the current choice is read from (None: fitted tiles).
    Returns:
        ({M: {"default": (MoEConfig, QuantKnobs), "g1": [(MoEConfig, QuantKnobs)] (GEMM1
        candidates with a GEMM2), "g2": {BLOCK_SIZE_M: [(TileConfig, knob fields)]},
        "prefill": [MoEConfig]}}, jobs).
    """
    from moekit.benchmarks.gpu import quant_entry  # noqa: PLC0415
    from moekit.kernels.launch_quant import quant_tiles  # noqa: PLC0415
    from moekit.kernels.quant_rows import modes_of  # noqa: PLC0415
    from moekit.kernels.quant_tuning import QuantKnobs, fp8_prefill_space, quant_search_space  # noqa: PLC0415
    from moekit.kernels.tuning import MoEConfig  # noqa: PLC0415
    from moekit.quant import get_scheme  # noqa: PLC0415

    scheme = get_scheme(scheme_name)
    modes = modes_of(scheme)
    if static and not (scheme.activation_dtype == "fp8_e4m3" and scheme.activation_granularity == "tensor"):
        raise ValueError(f"static activation scales take a per-tensor fp8 scheme (fp8_w8a8), got {scheme_name!r}")
    plans, jobs = {}, []
    for M in Ms:
        g1s, g2s = quant_search_space(M, E, k, modes.kgroup, modes.act_dtype is None, modes.w_int4,
                                      modes.a_kscale or modes.w_kscale)
        default = quant_tiles(M, E, k, H, I, dtype, device, scheme, modes)
        stage1 = [gemm1_candidate(t, kn, g2s, default) for t, kn in g1s if g2s.get(t.BLOCK_SIZE_M)]
        prefill = fp8_prefill_space(M, E, k) if static else []
        plans[M] = {"default": default, "g1": stage1, "g2": g2s, "prefill": prefill}
        firsts = {}
        for cfg, kn in stage1:
            firsts.setdefault(cfg.block_m, (cfg, kn))
        pairs = [as_called(*default)] + stage1 + [(MoEConfig(firsts[bm][0].gemm1, t2), QuantKnobs(**kn2))
                                      for bm, cands in g2s.items() if bm in firsts for t2, kn2 in cands]
        pairs += [(cfg, QuantKnobs()) for cfg in prefill]
        entries = {_key(quant_entry(c, kn)): quant_entry(c, kn) for c, kn in pairs}
        jobs += [[scheme_name, static, H, I, min(M, 64), k, e] for e in entries.values()]
    return plans, jobs


def as_called(cfg, knobs) -> Tuple:
    """(config, knobs) that run a table entry as a call without a config does: an explicit config
    takes no static_prefill knob, so an entry that carries one runs its prefill config."""
    return (knobs.static_prefill, knobs) if knobs.static_prefill is not None else (cfg, knobs)


def _flips(scheme_name: str, knobs) -> List[Dict]:
    """One knob flipped each: PDL; x quantized in its own launch (fp8); the other int4 conversions
    (the paired products without the knobs they exclude)."""
    flips = [dict(pdl=not knobs.pdl)]
    if scheme_name.startswith("fp8"):
        flips.append(dict(fuse_x_quant=not knobs.fuse_x_quant))
    if scheme_name.startswith("int4"):
        flips += [dict(w_convert=c) for c in ("cast", "bits", "ptx") if c != knobs.w_convert]
        if knobs.w_convert != "pairs" and not knobs.fold_w:
            flips.append(dict(w_convert="pairs", prefetch1=False, prefetch2=False))
    return flips


def search_quant(
    E: int, k: int, H: int, I: int, plans: Dict, scheme_name: str, static: bool, *,
    budget_s: Optional[float] = None, step: Optional[Callable[[str], None]] = None, device: str = "cuda",
    dtype: torch.dtype = torch.bfloat16,
) -> Tuple[Dict[int, Tuple], Dict[int, Dict]]:
    """Time the planned candidates and keep the fastest of each M.

    Returns ({M: (MoEConfig, QuantKnobs)}, {M: {"us", "default_us", "tried", "timings", "confirm"}}):
    as cli.tune.search_shape, timings keyed by the table entry's JSON.
    """
    from moekit.benchmarks.gpu import _quant_call, graph_time_us, quant_entry, quantized_weights, routing_sets  # noqa: PLC0415
    from moekit.cli.tune import BudgetedTimings, confirm_fastest  # noqa: PLC0415
    from moekit.kernels.quant_tuning import QuantKnobs  # noqa: PLC0415
    from moekit.kernels.tuning import MoEConfig  # noqa: PLC0415

    wts = quantized_weights(scheme_name, E, H, I, static, device)
    table, info = {}, {}
    for M, plan in plans.items():
        sets = routing_sets(M, E, k, H, 4 if M <= 1024 else 2, dtype, device)

        def measure(pair) -> float:
            try:
                cfg, kn = as_called(*pair)
                return graph_time_us(lambda x, w, i: _quant_call(wts, x, w, i, cfg, kn), sets, replays=3)
            except Exception:  # noqa: BLE001 - a candidate that cannot run is skipped
                return float("inf")

        timed = BudgetedTimings(M, measure, lambda pair: _key(quant_entry(*pair)), lambda pair: quant_entry(*pair),
                                budget_s, step)
        seen, pairs = timed.seen, timed.items

        default_us = timed(plan["default"])
        win = min([plan["default"]] + plan["g1"], key=timed)
        kn1 = {f: v for f, v in win[1].to_json().items() if f in GEMM1_KNOBS}
        win = min([win] + [(MoEConfig(win[0].gemm1, t2), QuantKnobs(**dict(kn1, **kn2)))
                           for t2, kn2 in plan["g2"].get(win[0].block_m, [])], key=timed)
        win = min([win] + [(win[0], QuantKnobs.from_json(dict(win[1].to_json(), **f)))
                           for f in _flips(scheme_name, win[1])], key=timed)
        sorted_keys = set(seen)
        for cfg in plan["prefill"]:
            timed((cfg, QuantKnobs()))
        us = float("inf")  # nothing ran (a dry run off the GPU): the search's pick stays
        confirm: Dict[str, list] = {}
        if any(t != float("inf") for t in seen.values()):
            first = {key: us for key, us in seen.items() if key in sorted_keys}
            key, confirm = confirm_fastest(first, lambda key: measure(pairs[key]))
            win, us = pairs[key], statistics.median(confirm[key])
            fast = {key: t for key, t in seen.items() if key not in sorted_keys}
            if fast and min(fast.values()) < us:  # the prefill kernels against the sorted winner
                first = dict(fast, **{_key(quant_entry(*win)): us})
                key, more = confirm_fastest(first, lambda key: measure(pairs[key]))
                confirm.update(more)
                if key in fast:
                    win = (win[0], replace(win[1], static_prefill=pairs[key][0]))
                us = statistics.median(more[key])
        if step:
            step(f"M={M} confirmed {quant_entry(*win)}: {us:.1f} us")
        table[M] = win
        info[M] = {"us": us, "default_us": default_us, "tried": sum(1 for v in seen.values() if v != float("inf")),
                   "timings": dict(seen), "confirm": confirm}
        del sets
    return table, info


def write_quant_configs(table: Dict[int, Tuple], E: int, I: int, device: str, scheme_name: str, folder: str) -> str:
    """Write {M: (MoEConfig, QuantKnobs)} as the quantized JSON file kernels/quant_tuning.py reads."""
    from moekit.benchmarks.gpu import quant_entry  # noqa: PLC0415
    from moekit.kernels.quant_tuning import quant_file_name  # noqa: PLC0415
    from moekit.quant import get_scheme  # noqa: PLC0415

    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, quant_file_name(E, I, device, get_scheme(scheme_name)))
    with open(path, "w", encoding="utf-8") as fh:
        json.dump({str(M): quant_entry(*table[M]) for M in sorted(table)}, fh, indent=1)
        fh.write("\n")
    return path


def run_quant(args, E: int, k: int, H: int, I: int, Ms: Sequence[int], dtype: torch.dtype, folder: str,
              progress) -> int:
    """`moekit tune --quant`: plan, compile in parallel processes, search, write the table."""
    import multiprocessing  # noqa: PLC0415

    from moekit.benchmarks.gpu import _compile_quant_job  # noqa: PLC0415
    from moekit.kernels.tuning import device_name  # noqa: PLC0415

    try:
        plans, jobs = plan_quant(E, k, H, I, Ms, args.quant, args.static_scales, dtype, device_name())
    except ValueError as err:
        raise UsageError(str(err)) from None
    print(f"compiling {len(jobs)} candidate configs in {args.workers} processes ...")
    with multiprocessing.get_context("spawn").Pool(max(1, args.workers)) as pool:
        failures = [r for r in pool.imap_unordered(_compile_quant_job, jobs) if r]
    if failures:
        print(f"{len(failures)} candidates failed to compile or run and are skipped, e.g. {failures[0]}")
    total = sum(1 + len(p["g1"]) + max((len(c) for c in p["g2"].values()), default=0) + len(p["prefill"]) + 3
                for p in plans.values())
    with progress(total, E, I) as advance:
        table, info = search_quant(E, k, H, I, plans, args.quant, args.static_scales, budget_s=args.budget,
                                   step=advance, dtype=dtype)
    path = write_quant_configs(table, E, I, device_name(), args.quant, folder)
    from moekit.benchmarks.gpu import quant_entry  # noqa: PLC0415

    for M in sorted(info):
        i = info[M]
        print(f"M={M:6d}: {i['us']:9.1f} us (current {i['default_us']:9.1f} us, {i['tried']} tried)  "
              f"{quant_entry(*table[M])}")
    print(f"wrote {path}")
    return 0

"""Where a call's time goes: device time per kernel of the Triton experts at a few points.

    PYTHONPATH=src python bench/profile_h200.py --points qwen3-30b-a3b:fp8_w8a8:16:static,olmoe-1b-7b:bf16:256
        [--out FILE]

A point is shape:scheme:M[:static] ("bf16" for unquantized weights; static: per-expert
activation scales). Each point is timed in a CUDA graph (as the benchmark does) and profiled
over eager calls with fresh routing (torch.profiler): the JSON and the printout give each
kernel's device time per call next to the graph time, so launch gaps show as the difference.
--graph profiles the replays of the graph too (kernels in the graph can run at other clocks than
eager ones) and samples the SM clock and power while it replays.
"""

import argparse
import json
import os
import time

import torch

from moekit.benchmarks.gpu import PERF_TABLE_CEILINGS, capture_graph, graph_time_us, point_call, quant_floor_terms
from moekit.benchmarks.floors import floor_seconds


def _device_us(event) -> float:
    for name in ("device_time_total", "cuda_time_total"):
        if hasattr(event, name):
            return float(getattr(event, name))
    return 0.0


def profile_point(spec: str, calls: int = 8, replayed: bool = False) -> dict:
    fn, sets, (E, k, H, I), scheme = point_call(spec, calls)
    M = sets[0][0].shape[0]
    bpw, fscale = (2.0, 1.0) if scheme == "bf16" else quant_floor_terms(scheme)
    with torch.inference_mode():
        graph_us = graph_time_us(fn, sets, replays=5)
        prof = profile_calls(fn, sets)
    kernels = _kernel_rows(prof, calls)
    floor = floor_seconds(M, E, k, H, I, bpw, PERF_TABLE_CEILINGS, fscale) * 1e6
    row = {"point": spec, "graph_us": graph_us, "floor_us": floor, "pct_of_floor": 100 * floor / graph_us,
           "kernel_us_sum": sum(r["us_per_call"] for r in kernels), "kernels": kernels}
    print(f"== {spec}: graph {graph_us:.1f} us ({row['pct_of_floor']:.1f}% of floor {floor:.1f}); "
          f"kernels {row['kernel_us_sum']:.1f} us per call", flush=True)
    _print_kernels(kernels)
    if replayed:
        with torch.inference_mode():
            row["in_graph"] = _in_graph(fn, sets)
        g = row["in_graph"]
        print(f"   in the graph: {g['us_per_call']:.1f} us per call, kernels {g['kernel_us_sum']:.1f}; "
              f"SM clock {g['sm_mhz']} MHz, {g['power_w']} W while replaying", flush=True)
        _print_kernels(g["kernels"])
        print(f"   idle between kernels: {sum(r['us_per_call'] for r in g['gaps']):.1f} us per call", flush=True)
        for r in g["gaps"][:6]:
            print(f"   {r['us_per_call']:8.2f} us  {r['between']}", flush=True)
    return row


def profile_calls(fn, sets):
    """torch.profiler's CUDA trace of one eager call of fn on each of sets (after one untimed pass)."""
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

    for args in sets:
        fn(*args)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for args in sets:
            fn(*args)
        torch.cuda.synchronize()
    return prof


def _print_kernels(rows: list) -> None:
    for r in rows:
        print(f"   {r['us_per_call']:8.2f} us  x{r['launches_per_call']:.0f}  {r['kernel']}", flush=True)


def _kernel_rows(prof, calls: int) -> list:
    rows = []
    for ev in prof.key_averages():
        us = _device_us(ev)
        if us > 0:
            rows.append({"kernel": ev.key[:120], "us_per_call": us / calls, "launches_per_call": ev.count / calls})
    return sorted(rows, key=lambda r: -r["us_per_call"])


def _gaps(prof, calls: int) -> list:
    """Idle device time between consecutive kernels of the trace, per call, by (kernel before,
    kernel after), largest first."""
    spans = []
    for ev in prof.events():
        if str(getattr(ev, "device_type", "")).endswith("CUDA") and ev.time_range.end > ev.time_range.start:
            spans.append((ev.time_range.start, ev.time_range.end, ev.name[:40]))
    spans.sort()
    pairs = {}
    for (s0, e0, n0), (s1, e1, n1) in zip(spans, spans[1:]):
        gap = max(0.0, s1 - e0)
        key = f"{n0} -> {n1}"
        pairs[key] = pairs.get(key, 0.0) + gap
    rows = [{"between": k, "us_per_call": v / calls} for k, v in pairs.items()]
    return sorted(rows, key=lambda r: -r["us_per_call"])


def _in_graph(fn, sets, replays: int = 3, busy_replays: int = 40) -> dict:
    """The kernels of one CUDA graph of the calls, profiled over replays (as the benchmark runs
    them), and the SM clock and power sampled while the graph replays back to back."""
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

    graph = capture_graph(fn, sets)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    calls = replays * len(sets)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(busy_replays):
        graph.replay()
    end.record()
    time.sleep(0.5 * busy_replays * 1e-3)  # replays take at least a millisecond or so each: sample mid-way
    clocks, power = [], []
    for _ in range(5):
        if end.query():
            break
        clocks.append(torch.cuda.clock_rate())
        power.append(round(torch.cuda.power_draw() / 1000.0))
        time.sleep(0.002)
    end.synchronize()
    kernels = _kernel_rows(prof, calls)
    gaps = _gaps(prof, calls)
    return {"gaps": gaps, "us_per_call": start.elapsed_time(end) * 1e3 / (busy_replays * len(sets)), "kernels": kernels,
            "kernel_us_sum": sum(r["us_per_call"] for r in kernels), "sm_mhz": clocks, "power_w": power}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--points", required=True)
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "profile.json"))
    p.add_argument("--graph", action="store_true",
                   help="also profile the kernels inside CUDA-graph replays, with the SM clock and power meanwhile")
    args = p.parse_args()
    rows = []
    for spec in args.points.split(","):
        try:
            rows.append(profile_point(spec, replayed=args.graph))
        except Exception as err:  # noqa: BLE001 - a point that fails is reported, not fatal
            print(f"== {spec}: failed: {type(err).__name__}: {err}", flush=True)
            rows.append({"point": spec, "error": f"{type(err).__name__}: {err}"})
        torch.cuda.empty_cache()
        with open(args.out, "w", encoding="utf-8") as fh:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()

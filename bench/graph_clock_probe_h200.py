"""Why moekit's CUDA kernels lose more in CUDA graphs than the Triton kernels (probe).

For each point and variant: graph time per call as a burst (graph_time_us), after 500 ms of
sustained replays, and with a sleep kernel between calls (the call's time only); eager time per
call (host launches, events), burst and sustained; and the SM clock and board power that
nvidia-smi samples during the sustained windows.

    PYTHONPATH=src python bench/graph_clock_probe_h200.py [--out FILE]
"""

import statistics
import subprocess
import time

import torch

from moekit.benchmarks.gpu import (_quant_call, ab_arg_parser, capture_graph, eager_time_us, graph_time_us,
                                   quantized_weights, routing_sets, shape_by_name, write_ab_result)
from moekit.experts.api import fused_experts
from moekit.kernels import hopper_block
from moekit.kernels.quant_tuning import QuantKnobs


class Sampler:
    """nvidia-smi's SM clock (MHz) and power (W) every 20 ms while open."""

    def __enter__(self):
        self.proc = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits",
                                      "-lms", "20"], stdout=subprocess.PIPE, text=True)
        time.sleep(0.1)
        return self

    def __exit__(self, *exc):
        self.proc.terminate()
        out = self.proc.communicate()[0]
        vals = [tuple(float(v) for v in line.split(",")) for line in out.splitlines() if "," in line]
        vals = vals[len(vals) // 4:] or vals  # the settled part
        self.clock = statistics.median(v[0] for v in vals) if vals else None
        self.power = statistics.median(v[1] for v in vals) if vals else None


def spaced_us(fn, sets, sleep_cycles: int, replays: int = 5) -> float:
    """Per call, with a sleep kernel of sleep_cycles after each call in the graph, minus the sleeps."""
    def with_sleep(*s):
        out = fn(*s)
        torch.cuda._sleep(sleep_cycles)
        return out
    def sleep_only(*s):
        torch.cuda._sleep(sleep_cycles)
    return graph_time_us(with_sleep, sets, replays) - graph_time_us(sleep_only, sets, replays)


def sustained(timer, fn, sets) -> dict:
    with Sampler() as s:
        us = timer(fn, sets, replays=5, warm_ms=500)
    return {"us": us, "sm_clock_mhz": s.clock, "power_w": s.power}


def main() -> None:
    p = ab_arg_parser(__doc__, "graph_clock_probe.json")
    args = p.parse_args()
    rows = []
    for point in ("qwen3-30b-a3b:4096", "mixtral-8x7b:4096", "deepseek-v3:4096:block"):
        parts = point.split(":")
        name, M = parts[0], int(parts[1])
        _, E, k, H, I = shape_by_name(name)
        sets = routing_sets(M, E, k, H, 4, torch.bfloat16, "cuda")
        if len(parts) > 2:
            wts = quantized_weights("fp8_w8a8_block128", E, H, I, False, "cuda")
            calls = {v: (lambda kn: lambda x, w, i: _quant_call(wts, x, w, i, knobs=kn))(
                QuantKnobs(gluon=128, cublas1="off", cuda=c)) for v, c in (("gluon", "off"), ("cuda", "on"))}
        else:
            w13 = torch.randn(E, 2 * I, H, device="cuda", dtype=torch.bfloat16) * H ** -0.5
            w2 = torch.randn(E, H, I, device="cuda", dtype=torch.bfloat16) * I ** -0.5
            calls = {"triton": lambda x, w, i: fused_experts(x, w13, w2, w, i, backend="triton"),
                     "cuda": lambda x, w, i: hopper_block.dense_experts(x, w13, w2, w, i)}
        row = {"point": point, "variants": {}}
        for label, fn in calls.items():
            v = {"graph_burst_us": graph_time_us(fn, sets, 5), "eager_burst_us": eager_time_us(fn, sets, 5)}
            v["graph_sustained"] = sustained(graph_time_us, fn, sets)
            v["eager_sustained"] = sustained(eager_time_us, fn, sets)
            cycles = int(v["graph_burst_us"] * 1.7e3)  # about one call's time at 1.7 GHz
            v["graph_spaced_us"] = spaced_us(fn, sets, cycles)
            with Sampler() as s:
                graph = capture_graph(fn, sets)
                t_end = time.monotonic() + 0.5
                while time.monotonic() < t_end:
                    graph.replay()
                    torch.cuda.synchronize()
                del graph
            v["graph_loop_clock_mhz"], v["graph_loop_power_w"] = s.clock, s.power
            row["variants"][label] = v
            print(point, label, {kk: (round(x, 1) if isinstance(x, float) else x) for kk, x in v.items()}, flush=True)
        rows.append(row)
        del calls, sets
        torch.cuda.empty_cache()
    write_ab_result(args.out, "graph-clock-probe", True, "see the docstring", rows=rows)


if __name__ == "__main__":
    main()

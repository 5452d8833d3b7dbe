"""CPU benchmark: moekit's backends against transformers' experts and a plain torch grouped
GEMM layer, same bf16 weights, same inputs, same process; fresh routing per repetition."""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import statistics
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

import moekit
from moekit import RoutingConfig, fused_experts, route

from .floors import CPU_CEILINGS, Ceilings, floor_seconds
from .peers import make_peers

__all__ = ["CPU_SHAPES", "run_cpu_bench", "time_fn", "time_interleaved"]

# (name, E, k, H, I): the two CPU shapes of the core issue.
CPU_SHAPES = [("E64-k8-H1024-I512", 64, 8, 1024, 512), ("E8-k2-H1024-I3584", 8, 2, 1024, 3584)]


def time_fn(fn: Callable, make_args: Callable, reps: int, budget_s: float) -> List[float]:
    """Median-ready wall times (s): one warm-up, then up to `reps` runs within `budget_s`,
    each with fresh arguments from make_args() (fresh routing, so weights are not cache-hot)."""
    fn(*make_args())
    times: List[float] = []
    start = time.perf_counter()
    while len(times) < reps and (not times or time.perf_counter() - start < budget_s):
        args = make_args()
        t0 = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - t0)
    return times


def time_interleaved(fns: Dict[str, Callable], make_args: Callable, reps: int, budget_s: float) -> Dict[str, List[float]]:
    """Wall times (s) per implementation, measured round-robin on the same fresh arguments.

    Interleaving gives every implementation the same machine state (caches, oneDNN's
    primitive cache, other load). The first call after fresh arguments meets the routed
    experts' weights colder than the ones after it (0.3-0.6 ms of a 3 ms call at M = 1 on a
    2-core host), so the order rotates by one each repetition and every implementation goes
    first equally often. An implementation drops out once it has used `budget_s`.
    """
    args = make_args()
    for fn in fns.values():  # warm-up
        fn(*args)
    names = list(fns)
    times: Dict[str, List[float]] = {n: [] for n in fns}
    spent = {n: 0.0 for n in fns}
    for r in range(reps):
        args = make_args()
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            if times[name] and spent[name] >= budget_s:
                continue
            t0 = time.perf_counter()
            fns[name](*args)
            dt = time.perf_counter() - t0
            times[name].append(dt)
            spent[name] += dt
    return times


def gemm_rate(dtype: torch.dtype) -> float:
    """torch.mm's FLOP/s here on a [1024, 2048] x [2048, 2048] product in `dtype`."""
    a = torch.randn(1024, 2048).to(dtype)
    b = torch.randn(2048, 2048).to(dtype)
    mm = statistics.median(time_fn(torch.mm, lambda: (a, b), 7, 30.0))
    return 2 * 1024 * 2048 * 2048 / mm


def measure_cpu_ceilings() -> Tuple[Ceilings, Dict[str, float]]:
    """Measure this machine: streaming read bandwidth (a 512 MiB sum) and the GEMM rate.

    The compute ceiling is the faster of torch's bf16 and fp32 GEMMs: where bf16 products are
    emulated (AVX2 hosts: a few GFLOP/s), moekit computes in fp32 from bf16 weights, so the
    bf16 rate alone would put the floor far above what the backends reach.
    Returns (ceilings, {"bf16": FLOP/s, "fp32": FLOP/s})."""
    big = torch.ones(256 * 1024 * 1024, dtype=torch.bfloat16)
    read = statistics.median(time_fn(lambda t: t.sum(), lambda: (big,), 5, 30.0))
    rates = {"bf16": gemm_rate(torch.bfloat16), "fp32": gemm_rate(torch.float32)}
    return Ceilings("measured (the faster of bf16 and fp32 GEMMs)", max(rates.values()), big.numel() * 2 / read), rates


def cpu_model() -> str:
    """The CPU's model name, family and model from /proc/cpuinfo, else what platform knows."""
    info: Dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                info.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    if "model name" not in info:
        return f"cpu {platform.processor() or platform.machine()}"
    return f"{info['model name']} (family {info.get('cpu family', '?')}, model {info.get('model', '?')})"


def _version(package: str) -> Optional[str]:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def run_cpu_bench(
    shapes: Sequence = CPU_SHAPES,
    Ms: Sequence[int] = (1, 32, 512),
    reps: int = 7,
    budget_s: float = 20.0,
    impls: Optional[Sequence[str]] = None,
    progress: Optional[Callable[[str], None]] = None,
) -> Dict:
    """Time every implementation at every (shape, M); returns a JSON-ready dict."""
    records = []
    measured, gemm_rates = measure_cpu_ceilings()
    for name, E, k, H, I in shapes:
        gen = torch.Generator().manual_seed(0)
        w13 = (torch.randn(E, 2 * I, H, generator=gen) * H ** -0.5).bfloat16()
        w2 = (torch.randn(E, H, I, generator=gen) * I ** -0.5).bfloat16()
        runners: Dict[str, Callable] = {
            "moekit_auto": lambda x, w, i: fused_experts(x, w13, w2, w, i),
            "moekit_grouped_mm": lambda x, w, i: fused_experts(x, w13, w2, w, i, backend="grouped_mm"),
        }
        runners.update(make_peers(w13, w2))
        cfg = RoutingConfig(top_k=k)
        for M in Ms:
            def make_args(M=M):
                x = torch.randn(M, H).bfloat16()
                w, ids = route(torch.randn(M, E), cfg)
                return x, w, ids

            floor = floor_seconds(M, E, k, H, I, 2, CPU_CEILINGS)
            floor_m = floor_seconds(M, E, k, H, I, 2, measured)
            row = {"shape": name, "E": E, "k": k, "H": H, "I": I, "M": M, "floor_ms": floor * 1e3,
                   "floor_ms_measured": floor_m * 1e3, "impls": {}}
            chosen = {n: f for n, f in runners.items() if impls is None or n in impls}
            with torch.inference_mode():
                times = time_interleaved(chosen, make_args, reps, budget_s)
            for impl, ts in times.items():
                med = statistics.median(ts)
                row["impls"][impl] = {"ms": med * 1e3, "runs": len(ts), "pct_of_floor": 100.0 * floor / med,
                                      "pct_of_measured_floor": 100.0 * floor_m / med}
                if progress:
                    progress(f"{name} M={M} {impl}: {med * 1e3:.2f} ms ({100 * floor / med:.0f}% of floor)")
            base = row["impls"].get("moekit_auto")
            if base:
                for peer in ("hf_eager", "hf_grouped_mm", "torch_grouped_gemm"):
                    if peer in row["impls"]:
                        row[f"speedup_vs_{peer}"] = row["impls"][peer]["ms"] / base["ms"]
            records.append(row)
    return {
        "benchmark": "experts-cpu",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": f"{cpu_model()}, {torch.get_num_threads()} threads",
        "torch": torch.__version__,
        "transformers": _version("transformers"),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "isa_caps": {v: os.environ[v] for v in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA") if v in os.environ},
        "moekit": moekit.__version__,
        "ceilings_perf_md": {"flops": CPU_CEILINGS.flops, "bandwidth": CPU_CEILINGS.bandwidth},
        "ceilings_measured": {"gemm_flops": measured.flops, "read_bandwidth": measured.bandwidth,
                              "gemm_flops_by_dtype": gemm_rates},
        "weights": "bf16, uniform random routing drawn fresh per repetition, implementations interleaved, "
                   "the order rotated by one each repetition",
        "records": records,
    }

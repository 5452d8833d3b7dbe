"""GPU benchmark: moekit's Triton experts against torch grouped-GEMM layers and transformers'
grouped_mm experts, same bf16 weights, same inputs, same process.

Timing (PERF.md): every implementation is captured in a CUDA graph of several calls, each
with its own fresh routing (so weights are not L2-resident), and the graph is replayed;
an implementation that synchronises with the host (found with torch's sync debug mode)
is timed eagerly and marked so. Medians of the replays, in microseconds per call.
"""

from __future__ import annotations

import datetime
import json
import multiprocessing
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

import moekit
from moekit import RoutingConfig, fused_experts, route

from .floors import Ceilings, floor_seconds, layer_flops, weight_bytes
from .peers import plain_grouped_gemm, transformers_experts

__all__ = [
    "GPU_SHAPES", "GPU_MS", "PERF_TABLE_CEILINGS", "shape_by_name", "routing_sets", "graph_time_us",
    "eager_time_us", "host_time_us", "host_sync_reason", "precompile", "run_gpu_bench", "prefill_kernel_key", "prefill_label",
    "QUANT_CASES", "quantized_weights", "quant_entry", "parse_quant_entry", "quant_jobs", "precompile_quant",
    "quant_floor_terms", "capture_graph", "run_quant_bench", "quant_main", "ab_time_us", "ab_arg_parser", "ab_device", "write_ab_result",
    "AB_TIMING", "entry_ab_args", "point_call",
]

# (name, E, k, H, I): the five shapes of PERF.md.
GPU_SHAPES: Tuple[Tuple[str, int, int, int, int], ...] = (
    ("mixtral-8x7b", 8, 2, 4096, 14336),
    ("qwen3-30b-a3b", 128, 8, 2048, 768),
    ("deepseek-v3", 256, 8, 7168, 2048),
    ("olmoe-1b-7b", 64, 8, 2048, 1024),
    ("gpt-oss-20b", 32, 4, 2880, 2880),
)
GPU_MS = (1, 16, 64, 256, 1024, 4096, 16384)
# The ceilings PERF.md's floor table was computed with (790 TFLOP/s bf16, 4.3 TB/s).
PERF_TABLE_CEILINGS = Ceilings("NVIDIA H200 (PERF.md floor table)", 790e12, 4.3e12)


def shape_by_name(name: str) -> Tuple[str, int, int, int, int]:
    for shape in GPU_SHAPES:
        if shape[0] == name:
            return shape
    raise ValueError(f"shape must be one of {[s[0] for s in GPU_SHAPES]}, got {name!r}")


def routing_sets(M: int, E: int, k: int, H: int, n: int, dtype: torch.dtype, device) -> List[tuple]:
    """n independent (x [M, H], weights [M, k] fp32, ids [M, k] int32) with softmax top-k routing."""
    cfg = RoutingConfig(top_k=k)
    sets = []
    for _ in range(n):
        x = torch.randn(M, H, device=device, dtype=dtype)
        w, ids = route(torch.randn(M, E, device=device), cfg)
        sets.append((x, w, ids))
    return sets


def ab_time_us(fn: Callable, arg_sets: Sequence[tuple], cuda: bool, replays: int = 5) -> float:
    """graph_time_us on CUDA; elsewhere (a dry run under TRITON_INTERPRET=1) wall-clock
    microseconds per call of one eager pass over arg_sets."""
    if cuda:
        return graph_time_us(fn, arg_sets, replays=replays)
    start = time.perf_counter()
    for args in arg_sets:
        fn(*args)
    return (time.perf_counter() - start) * 1e6 / len(arg_sets)


def ab_arg_parser(doc: str, out_name: str):
    """An A/B script's argument parser with the options they share: --out (in $OUT, else here),
    --rounds of interleaved timings, --device (cpu: a dry run under TRITON_INTERPRET=1)."""
    import argparse  # noqa: PLC0415
    import os  # noqa: PLC0415

    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), out_name))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    return p


def ab_device(args) -> Tuple[bool, torch.device]:
    """(whether it runs on CUDA, the device) of ab_arg_parser's --device; a CPU dry run needs the interpreter."""
    import os  # noqa: PLC0415

    cuda = args.device == "cuda"
    if not cuda and os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("--device cpu needs TRITON_INTERPRET=1")
    return cuda, torch.device(args.device)


def entry_ab_args(doc: str, out_name: str, point_help: str, flags: Sequence[str] = ()):
    """The arguments of an A/B between table entries (--point and --entry, repeatable, with
    ab_arg_parser's, and the script's own on/off `flags`): (args, on CUDA, device, {shape name:
    (name, E, k, H, I)})."""
    p = ab_arg_parser(doc, out_name)
    p.add_argument("--point", action="append", required=True, help=point_help + " (repeatable)")
    for flag in flags:
        p.add_argument(flag, action="store_true")
    p.add_argument("--entry", action="append", required=True, help="a table entry as JSON (repeatable)")
    args = p.parse_args()
    cuda, dev = ab_device(args)
    return args, cuda, dev, {s[0]: s for s in GPU_SHAPES}


# How the A/B scripts time their variants (ab_time_us through graphs of 8 routing sets, replays=10).
AB_TIMING = ("CUDA graph of 8 calls with distinct softmax top-k routing, 10 replays, median us per call; "
             "variants interleaved, median of the rounds")


def write_ab_result(path: str, benchmark: str, cuda: bool, timing: str, **fields) -> None:
    """Write an A/B script's results as JSON: what ran, on what (device, torch, triton, the command
    line), how it was timed, then the script's own fields; and say where."""
    import triton  # noqa: PLC0415

    doc = {"benchmark": benchmark, "device": torch.cuda.get_device_name() if cuda else "cpu (TRITON_INTERPRET=1)",
           "torch": torch.__version__, "triton": triton.__version__, "command": " ".join(sys.argv),
           "timing": timing, **fields}
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"wrote {path}", flush=True)


def capture_graph(fn: Callable, arg_sets: Sequence[tuple]) -> "torch.cuda.CUDAGraph":
    """One CUDA graph of fn over arg_sets (compiled and allocated by a run on a side stream first),
    replayed once."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (compiles, allocates) off the capture stream
        for args in arg_sets:
            fn(*args)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for args in arg_sets:
            fn(*args)
    graph.replay()
    torch.cuda.synchronize()
    return graph


def graph_time_us(fn: Callable, arg_sets: Sequence[tuple], replays: int = 5, warm_ms: float = 0.0) -> float:
    """Median microseconds per call of fn over arg_sets, captured in one CUDA graph.

    warm_ms: replay the graph back to back for this long before timing, so the clocks settle
    where sustained work puts them (compute-bound calls draw the GPU to its power limit within
    tens of milliseconds, and the SM clock drops; a short burst runs at the boost clock)."""
    graph = capture_graph(fn, arg_sets)
    t_warm = time.monotonic() + warm_ms * 1e-3
    while time.monotonic() < t_warm:
        graph.replay()
        torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(arg_sets))
    del graph
    return statistics.median(times)


def host_time_us(fn: Callable, arg_sets: Sequence[tuple], reps: int = 3, warm: int = 3, device="cuda") -> float:
    """Microseconds per call of fn over arg_sets launched back to back from the host, the best
    of `reps` passes (each ended by a device sync), after fn on the first `warm` sets: what a
    caller waits per call, host overheads included (the bench scripts' eager timings)."""
    cuda = torch.device(device).type == "cuda"
    for args in arg_sets[:warm]:
        fn(*args)
    if cuda:
        torch.cuda.synchronize()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        for args in arg_sets:
            fn(*args)
        if cuda:
            torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t0) / len(arg_sets) * 1e6)
    return best


def eager_time_us(fn: Callable, arg_sets: Sequence[tuple], replays: int = 5, warm_ms: float = 0.0) -> float:
    """Median microseconds per call of fn over arg_sets launched eagerly (host syncs included);
    warm_ms as graph_time_us's."""
    t_warm = time.monotonic() + warm_ms * 1e-3
    while True:
        for args in arg_sets:
            fn(*args)
        torch.cuda.synchronize()
        if time.monotonic() >= t_warm:
            break
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(replays):
        start.record()
        for args in arg_sets:
            fn(*args)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(arg_sets))
    return statistics.median(times)


def host_sync_reason(fn: Callable, args: tuple) -> Optional[str]:
    """Why fn cannot be captured in a CUDA graph (it synchronises with the host), or None."""
    fn(*args)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn(*args)
    except RuntimeError as err:
        return str(err).splitlines()[0]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return None


def prefill_kernel_key(cfg) -> str:
    """A prefill MoEConfig as JSON without its grid size: configs with one key compile the same kernels."""
    entry = cfg.to_json()
    entry.get("prefill", {}).pop("programs_per_sm", None)
    return json.dumps(entry, sort_keys=True)


def prefill_label(cfg) -> str:
    """A short name of a prefill MoEConfig for sweep tables: its knobs, then the tiles."""
    g1, g2 = cfg.gemm1, cfg.gemm2
    return (f"prefill:{json.dumps(cfg.prefill.to_json(), sort_keys=True)}|{g1.BLOCK_SIZE_M}x{g1.BLOCK_SIZE_N}"
            f"w{g1.num_warps}s{g1.num_stages}/{g2.BLOCK_SIZE_N}w{g2.num_warps}s{g2.num_stages}")


def _compile_job(job: Sequence) -> Optional[str]:
    """Run one config once on a two-expert problem of the real H, I (fills Triton's disk cache)."""
    from moekit.kernels.launch import fused_moe  # noqa: PLC0415 (in a spawned worker)
    from moekit.kernels.tuning import MoEConfig  # noqa: PLC0415

    H, I, dtype_name, activation, direct, entry = job[:6]
    device = job[6] if len(job) > 6 else "cuda"
    dtype = getattr(torch, dtype_name)
    try:
        w13 = torch.randn(2, 2 * I, H, device=device, dtype=dtype) * 0.02
        w2 = torch.randn(2, H, I, device=device, dtype=dtype) * 0.02
        T = 1 if direct else 64
        x = torch.randn(T, H, device=device, dtype=dtype)
        ids = torch.randint(0, 2, (T, 2), device=device, dtype=torch.int32)
        w = torch.rand(T, 2, device=device)
        fused_moe(x, w13, w2, None, None, w, ids, None, activation, config=MoEConfig.from_json(entry), direct=direct)
        if device == "cuda":
            torch.cuda.synchronize()
    except Exception as err:  # noqa: BLE001 - a config that fails is reported, not fatal
        return f"{entry}: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    return None


def precompile(jobs: Sequence[tuple], workers: int) -> List[str]:
    """Compile many kernel configs in parallel processes; returns the failures.

    jobs: (H, I, dtype name, activation, direct, config JSON entry[, device]). Triton's disk
    cache then serves the compiled kernels to this process.
    """
    # Triton specialises integer arguments only on divisibility by 16 (and on == 1), so every
    # H (or I) that is a multiple of 16 compiles the same kernels: compile those once, small.
    canon = [[64 if j[0] % 16 == 0 else j[0], 64 if j[1] % 16 == 0 else j[1], *j[2:]] for j in jobs]
    unique = [json.loads(j) for j in dict.fromkeys(json.dumps(j, sort_keys=True) for j in canon)]
    if workers <= 1 or len(unique) < 4:
        return [r for r in map(_compile_job, unique) if r]
    with multiprocessing.get_context("spawn").Pool(workers) as pool:
        return [r for r in pool.imap_unordered(_compile_job, unique) if r]


def _sets_for(M: int) -> int:
    return 8 if M <= 256 else (4 if M <= 4096 else 2)


def run_gpu_bench(
    shapes: Optional[Sequence] = None,
    Ms: Optional[Sequence[int]] = None,
    out_json: Optional[str] = None,
    impls: Optional[Sequence[str]] = None,
    progress: Optional[Callable[[str], None]] = None,
    check_Ms: Sequence[int] = (1, 16, 64),
    replays: int = 5,
    dtype: torch.dtype = torch.bfloat16,
    device: str = "cuda",
    warm_ms: float = 0.0,
) -> Dict:
    """Time moekit triton and the peers at every (shape, M) on the current CUDA GPU.

    Args:
        shapes: (name, E, k, H, I) tuples or names of GPU_SHAPES (None: all five).
        Ms: token counts (None: GPU_MS).
        out_json: write the result there too (JSON).
        impls: a subset of the implementation names to run (None: all).
        check_Ms: token counts at which triton is also checked against `reference`.
        dtype: of weights and activations.  device: "cuda" ("cpu" only as a dry run).
        warm_ms: each timing replays its calls this long first (graph_time_us); 0: short bursts.
    Returns:
        a JSON-ready dict (date, device, versions, records with us, TFLOP/s, % of floor).
    """
    say = progress or (lambda msg: print(msg, file=sys.stderr, flush=True))
    shapes = [shape_by_name(s) if isinstance(s, str) else tuple(s) for s in (shapes or GPU_SHAPES)]
    Ms = list(Ms or GPU_MS)
    dev = torch.device(device)
    records = []
    for name, E, k, H, I in shapes:
        w13 = torch.randn(E, 2 * I, H, device=dev, dtype=dtype) * H ** -0.5
        w2 = torch.randn(E, H, I, device=dev, dtype=dtype) * I ** -0.5
        runners: Dict[str, Callable] = {
            "moekit_triton": lambda x, w, i: fused_experts(x, w13, w2, w, i, backend="triton"),
            "moekit_grouped_mm": lambda x, w, i: fused_experts(x, w13, w2, w, i, backend="grouped_mm"),
            "torch_grouped_gemm": plain_grouped_gemm(w13, w2),
        }
        try:
            runners["hf_grouped_mm"] = transformers_experts(w13, w2, "grouped_mm")
        except ImportError as err:
            say(f"transformers grouped_mm peer unavailable: {err}")
        if impls is not None:
            runners = {n: f for n, f in runners.items() if n in impls}
        for M in Ms:
            sets = routing_sets(M, E, k, H, _sets_for(M), dtype, dev)
            floor = floor_seconds(M, E, k, H, I, 2, PERF_TABLE_CEILINGS)
            row = {"shape": name, "E": E, "k": k, "H": H, "I": I, "M": M, "floor_us": floor * 1e6,
                   "weight_bytes": weight_bytes(M, E, k, H, I, 2), "flops": layer_flops(M, k, H, I), "impls": {}}
            if M in check_Ms and "moekit_triton" in runners:
                x, w, ids = sets[0]
                ref = fused_experts(x, w13, w2, w, ids, backend="reference").float()
                out = runners["moekit_triton"](x, w, ids).float()
                row["rel_err_vs_reference"] = ((out - ref).norm() / ref.norm()).item()
            for impl, fn in runners.items():
                try:
                    with torch.inference_mode():
                        # moekit skips its host-side id checks while capturing; peers are probed.
                        sync = host_sync_reason(fn, sets[0]) if not impl.startswith("moekit_") else None
                        if sync is None:
                            try:
                                us = graph_time_us(fn, sets, replays, warm_ms=warm_ms)
                            except RuntimeError as err:
                                sync = f"CUDA-graph capture failed: {str(err).splitlines()[0][:200]}"
                        if sync is not None:
                            us = eager_time_us(fn, sets, replays, warm_ms=warm_ms)
                except Exception as err:  # noqa: BLE001 - a peer that fails is recorded, not fatal
                    row["impls"][impl] = {"error": f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"}
                    say(f"{name} M={M} {impl}: failed: {row['impls'][impl]['error']}")
                    continue
                rec = {"us": us, "tflops": layer_flops(M, k, H, I) / us * 1e-6, "pct_of_floor": 100.0 * floor * 1e6 / us,
                       "cuda_graph": sync is None}
                if sync:
                    rec["host_sync"] = sync
                row["impls"][impl] = rec
                say(f"{name:14s} M={M:6d} {impl:18s} {us:10.1f} us {rec['tflops']:7.1f} TFLOP/s "
                    f"{rec['pct_of_floor']:5.1f}% of floor{'' if sync is None else ' (eager: syncs)'}")
            base = row["impls"].get("moekit_triton", {}).get("us")
            if base:
                for peer in ("moekit_grouped_mm", "torch_grouped_gemm", "hf_grouped_mm"):
                    peer_us = row["impls"].get(peer, {}).get("us")
                    if peer_us:
                        row[f"speedup_vs_{peer}"] = peer_us / base
            records.append(row)
            del sets
        del w13, w2, runners
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    import triton  # noqa: PLC0415

    result = {
        "benchmark": "experts-gpu",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "moekit": moekit.__version__,
        "command": " ".join(sys.argv),
        "ceilings": {"flops": PERF_TABLE_CEILINGS.flops, "bandwidth": PERF_TABLE_CEILINGS.bandwidth,
                     "note": "floors as in PERF.md's table: max(FLOPs / 790e12, weight bytes / 4.3e12)"},
        "weights": f"{str(dtype).replace('torch.', '')}, silu, no bias; softmax top-k routing drawn fresh for every call in a graph",
        "timing": "CUDA graph of several calls with distinct routing, replayed; median us per call"
                  + (f"; each timing after {warm_ms:g} ms of back-to-back replays" if warm_ms else ""),
        "records": records,
    }
    _write_json(out_json, result)
    return result


# The quantized benchmark (issue 5): (shape, scheme, static per-expert fp8 activation scales, Ms).
QUANT_CASES: Tuple[Tuple[str, str, bool, Tuple[int, ...]], ...] = (
    ("deepseek-v3", "fp8_w8a8_block128", False, (1, 16, 64, 256, 4096, 16384)),
    ("mixtral-8x7b", "int4_w4a16", False, (1, 16, 64)),
    ("mixtral-8x7b", "int8_w8a16", False, (1, 16, 64)),
    ("mixtral-8x7b", "fp8_w8a8", True, (1, 16, 64, 256, 4096, 16384)),
    ("qwen3-30b-a3b", "int4_w4a16", False, (1, 16, 64)),
    ("qwen3-30b-a3b", "int8_w8a16", False, (1, 16, 64)),
    ("qwen3-30b-a3b", "fp8_w8a8", True, (1, 16, 64, 256, 4096, 16384)),
    ("qwen3-30b-a3b", "fp8_w8a8", False, (16, 16384)),
)
# Static per-tensor scales: about amax / 448 of N(0, 1) inputs and of their SwiGLU activations.
_STATIC_A13, _STATIC_A2 = 5.0 / 448, 8.0 / 448


def quantized_weights(scheme: str, E: int, H: int, I: int, static: bool, device, chunk: int = 16):
    """Random experts (std H^-1/2, I^-1/2) quantized `chunk` experts at a time (bounded fp32 memory)."""
    from moekit.experts.base import ExpertWeights  # noqa: PLC0415
    from moekit.quant import quantize_experts  # noqa: PLC0415

    parts = []
    for e0 in range(0, E, chunk):
        n = min(chunk, E - e0)
        w13 = torch.randn(n, 2 * I, H, device=device) * H ** -0.5
        w2 = torch.randn(n, H, I, device=device) * I ** -0.5
        extra = {}
        if static:
            extra = dict(a13_scale=torch.full((n,), _STATIC_A13, device=device),
                         a2_scale=torch.full((n,), _STATIC_A2, device=device))
        parts.append(quantize_experts(w13, w2, scheme, **extra))
        del w13, w2
    cat = lambda ts: torch.cat(ts) if len(ts) > 1 else ts[0]  # noqa: E731
    return ExpertWeights(cat([p.w13 for p in parts]), cat([p.w2 for p in parts]),
                         scales={k: cat([p.scales[k] for p in parts]) for k in parts[0].scales}, quant=scheme)


def _quant_call(wts, x, w, ids, config=None, knobs=None):
    from moekit.kernels.launch_quant import fused_moe_quant  # noqa: PLC0415
    from moekit.quant import scheme_of  # noqa: PLC0415

    s = wts.scales
    return fused_moe_quant(x, wts.w13, wts.w2, None, None, s["w13_scale"], s["w2_scale"], s.get("w13_zero"),
                           s.get("w2_zero"), s.get("a13_scale"), s.get("a2_scale"), w, ids, None, scheme_of(wts),
                           "silu", config=config, knobs=knobs, out_dtype=x.dtype)


def point_call(spec: str, calls: int):
    """A call of the Triton experts through the shipped tables at a point "shape:scheme:M[:static]"
    ("bf16" for unquantized weights; static: per-expert activation scales), on CUDA:
    (fn(x, topk_weights, topk_ids), `calls` routing sets of M tokens, (E, k, H, I), scheme)."""
    from moekit.experts.api import fused_experts  # noqa: PLC0415

    parts = spec.split(":")
    name, scheme, M = parts[0], parts[1], int(parts[2])
    static = len(parts) > 3 and parts[3] == "static"
    _, E, k, H, I = shape_by_name(name)
    if scheme == "bf16":
        w13 = torch.randn(E, 2 * I, H, device="cuda", dtype=torch.bfloat16) * H ** -0.5
        w2 = torch.randn(E, H, I, device="cuda", dtype=torch.bfloat16) * I ** -0.5
        fn = lambda x, w, i: fused_experts(x, w13, w2, w, i, backend="triton")  # noqa: E731
    else:
        wts = quantized_weights(scheme, E, H, I, static, "cuda")
        fn = lambda x, w, i: _quant_call(wts, x, w, i)  # noqa: E731
    return fn, routing_sets(M, E, k, H, calls, torch.bfloat16, "cuda"), (E, k, H, I), scheme


def quant_entry(config, knobs) -> Dict:
    """A tuned quantized table's M entry: the tiles' JSON plus "quant" (knobs off their defaults)."""
    entry = config.to_json()
    if knobs.to_json():
        entry["quant"] = knobs.to_json()
    return entry


def parse_quant_entry(entry: Dict):
    """(MoEConfig, QuantKnobs) of a quant_entry."""
    from moekit.kernels.quant_tuning import QuantKnobs  # noqa: PLC0415
    from moekit.kernels.tuning import MoEConfig  # noqa: PLC0415

    return MoEConfig.from_json(entry), QuantKnobs.from_json(entry.get("quant", {}))


_JOB_WEIGHTS: Dict[tuple, object] = {}


def _compile_quant_job(job: Sequence) -> Optional[str]:
    """Run one quantized entry (exact tiles and knobs) once on two experts of the real H, I, with
    M tokens and k slots (fills Triton's disk cache); weights are kept per worker process."""
    scheme, static, H, I, M, k, entry = job
    try:
        key = (scheme, static, H, I)
        if key not in _JOB_WEIGHTS:
            _JOB_WEIGHTS.clear()
            _JOB_WEIGHTS[key] = quantized_weights(scheme, 2, H, I, static, "cuda")
        x = torch.randn(M, H, device="cuda", dtype=torch.bfloat16)
        ids = torch.randint(0, 2, (M, k), device="cuda", dtype=torch.int32)
        _quant_call(_JOB_WEIGHTS[key], x, torch.rand(M, k, device="cuda"), ids, *parse_quant_entry(entry))
        torch.cuda.synchronize()
    except Exception as err:  # noqa: BLE001 - a config that fails is reported, not fatal
        return f"{scheme} M={M} {entry}: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    return None


def quant_jobs(cases=QUANT_CASES) -> Tuple[list, list]:
    """(quantized jobs for _compile_quant_job, bf16 jobs for precompile) of the benchmark's points,
    with the tiles and knobs each call looks up (tuned quantized tables, else the fitted bf16 table)."""
    from moekit.kernels.launch_quant import quant_tiles  # noqa: PLC0415
    from moekit.kernels.quant_rows import modes_of  # noqa: PLC0415
    from moekit.kernels.tuning import device_name, get_config, use_direct  # noqa: PLC0415
    from moekit.quant import get_scheme  # noqa: PLC0415

    qjobs, bjobs = [], []
    for name, scheme, static, Ms in cases:
        _, E, k, H, I = shape_by_name(name)
        sch = get_scheme(scheme)
        for M in Ms:
            config, knobs = quant_tiles(M, E, k, H, I, torch.bfloat16, device_name(), sch, modes_of(sch))
            qjobs.append([scheme, static, H, I, min(M, 64), k, quant_entry(config, knobs)])
            entry = get_config(M, E, k, H, I, torch.bfloat16, device_name()).to_json()
            bjobs.append([H, I, "bfloat16", "silu", use_direct(M, k, E), entry])
    return qjobs, bjobs


def precompile_quant(workers: int, cases=QUANT_CASES) -> List[str]:
    """Compile every kernel of the quantized benchmark in parallel processes; returns the failures."""
    qjobs, bjobs = quant_jobs(cases)
    with multiprocessing.get_context("spawn").Pool(workers) as pool:
        failures = [r for r in pool.imap_unordered(_compile_quant_job, qjobs) if r]
    return failures + precompile(bjobs, workers)


def quant_floor_terms(scheme: str) -> Tuple[float, float]:
    """(bytes per weight with group-128 scales, compute ceiling over bf16's) of a scheme's floor."""
    if scheme.startswith("fp8"):
        return 1.0, 2.0
    if scheme == "int8_w8a8":
        return 1.0, 2.0
    return (1.0 if scheme.startswith("int8") else 0.5) + 4 / 128, 1.0


def run_quant_bench(out_json: Optional[str], cases=QUANT_CASES, deadline_s: float = 1e9, replays: int = 5,
                    command: str = "", progress: Optional[Callable[[str], None]] = None,
                    dtype: torch.dtype = torch.bfloat16, device: str = "cuda", rounds: int = 3,
                    sustain_ms: float = 0.0, sustain_from_m: int = 4096, eager_from_m: int = 16384) -> Dict:
    """Time the quantized Triton experts (and the unquantized Triton kernel where a target compares them).

    Floors: weight bytes at 1 byte (fp8), 1 + 4/128 (int8 weight-only) or 0.5 + 4/128 (int4,
    group 128 scales) per weight, 8-bit compute at twice PERF.md's bf16 ceiling. The JSON (at
    out_json, unless None) is rewritten after every point.
    Points left when deadline_s has passed are recorded as skipped. dtype: of the activations
    and the unquantized weights; device: "cuda" ("cpu" only as a dry run under the interpreter);
    rounds: each point times the quantized and the unquantized kernel this many times, alternately
    (medians recorded, and each round's times when rounds > 1). sustain_ms > 0: points from
    sustain_from_m tokens are also timed after sustain_ms of back-to-back replays of each kernel
    (record "sustained": the clocks of sustained work, which the power limit sets for
    compute-bound calls), next to the standard short-burst timing. Points from eager_from_m
    tokens are also timed eagerly, both kernels (record "eager"): prefill runs outside CUDA
    graphs in serving engines, and there moekit's block-scaled fp8 GEMM1 runs on cuBLAS, which
    reads the experts' row counts back to the host and so steps aside in a graph
    (kernels/cublas_block.py).
    """
    import triton  # noqa: PLC0415

    from moekit.kernels.launch_quant import quant_tiles  # noqa: PLC0415
    from moekit.kernels.quant_rows import modes_of  # noqa: PLC0415
    from moekit.kernels.tuning import device_name  # noqa: PLC0415
    from moekit.quant import emulated_experts, get_scheme  # noqa: PLC0415
    from moekit.quant.quantize import check_fits  # noqa: PLC0415

    say = progress or (lambda msg: print(msg, file=sys.stderr, flush=True))
    t_end = time.monotonic() + deadline_s
    result = {
        "benchmark": "experts-gpu-quant",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name() if device == "cuda" else device, "torch": torch.__version__, "triton": triton.__version__,
        "moekit": moekit.__version__, "command": command or " ".join(sys.argv),
        "floors": "max(FLOPs / (790e12 bf16, 1580e12 fp8), weight bytes / 4.3e12) as PERF.md's table",
        "weights": "random, silu, no bias; tiles and knobs: the tuned quantized tables (kernels/quant_tuning.py), "
                   "else the bf16 tuned table with BLOCK_SIZE_K fitted to the scale groups",
        "timing": (f"CUDA graph of several calls with distinct softmax top-k routing, replayed; median us per call; "
                   f"{rounds} round(s) per point, the quantized and the bf16 kernel alternately, medians; "
                   f"from {eager_from_m} tokens also eagerly (record 'eager')"),
        "records": [],
    }
    dev = torch.device(device)
    for name, scheme, static, Ms in cases:
        _, E, k, H, I = shape_by_name(name)
        sch = get_scheme(scheme)
        bf16 = None
        try:
            check_fits(sch, H, I)
        except ValueError as err:  # a shape the scheme's groups do not divide: said and recorded, not fatal
            say(f"{name} {scheme}: skipped: {err}")
            result["records"] += [{"shape": name, "E": E, "k": k, "H": H, "I": I, "scheme": scheme,
                                   "static_act_scales": static, "M": M, "skipped": str(err)} for M in Ms]
            continue
        wts = quantized_weights(scheme, E, H, I, static, dev)
        bpw, fscale = quant_floor_terms(scheme)
        for M in Ms:
            row = {"shape": name, "E": E, "k": k, "H": H, "I": I, "scheme": scheme, "static_act_scales": static,
                   "M": M, "floor_us": floor_seconds(M, E, k, H, I, bpw, PERF_TABLE_CEILINGS, fscale) * 1e6}
            if dev.type == "cuda":
                row["config"] = quant_entry(*quant_tiles(M, E, k, H, I, dtype, device_name(), sch, modes_of(sch)))
            if time.monotonic() > t_end:
                row["skipped"] = "out of time"
                result["records"].append(row)
                continue
            sets = routing_sets(M, E, k, H, _sets_for(M), dtype, dev)
            try:
                with torch.inference_mode():
                    if M == 16:
                        x, w, ids = sets[0]
                        ref = emulated_experts(x, wts, w, ids)
                        out = _quant_call(wts, x, w, ids).float()
                        row["rel_err_vs_reference"] = rel = float((out - ref).norm() / ref.norm())
                    if bf16 is None:
                        bf16 = (torch.randn(E, 2 * I, H, device=dev, dtype=dtype) * H ** -0.5,
                                torch.randn(E, H, I, device=dev, dtype=dtype) * I ** -0.5)
                    # Rounds alternate the two kernels, so a change of clocks (power) between
                    # rounds reaches both sides of the ratio.
                    quant_fn = lambda x, w, i: _quant_call(wts, x, w, i)  # noqa: E731
                    bf16_fn = lambda x, w, i: fused_experts(x, bf16[0], bf16[1], w, i, backend="triton")  # noqa: E731
                    q_us, b_us = _alternate(quant_fn, bf16_fn, sets, rounds, replays)
                    row["us"] = statistics.median(q_us)
                    row["pct_of_floor"] = 100.0 * row["floor_us"] / row["us"]
                    row["bf16_triton_us"] = statistics.median(b_us)
                    row["speedup_vs_bf16_triton"] = row["bf16_triton_us"] / row["us"]
                    if rounds > 1:
                        row["rounds_us"] = q_us
                        row["rounds_bf16_triton_us"] = b_us
                    if M >= eager_from_m:
                        q_us, b_us = _alternate(quant_fn, bf16_fn, sets, rounds, replays, eager=True)
                        row["eager"] = {"us": statistics.median(q_us), "bf16_triton_us": statistics.median(b_us),
                                        "speedup_vs_bf16_triton": statistics.median(b_us) / statistics.median(q_us),
                                        "rounds_us": q_us, "rounds_bf16_triton_us": b_us}
                    if sustain_ms > 0 and M >= sustain_from_m:
                        q_us, b_us = _alternate(quant_fn, bf16_fn, sets, rounds, replays, sustain_ms)
                        row["sustained"] = {"warm_ms": sustain_ms, "us": statistics.median(q_us),
                                            "bf16_triton_us": statistics.median(b_us),
                                            "speedup_vs_bf16_triton": statistics.median(b_us) / statistics.median(q_us),
                                            "rounds_us": q_us, "rounds_bf16_triton_us": b_us}
            except Exception as err:  # noqa: BLE001 - a point that fails is recorded, not fatal
                row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:300] if str(err) else ''}"
                say(f"{name} {scheme} M={M}: failed: {row['error']}")
                result["records"].append(row)
                continue
            say(f"{name:14s} {scheme:18s}{' static' if static else '       '} M={M:6d} {row['us']:9.1f} us "
                f"{row['pct_of_floor']:5.1f}% of floor  x{row.get('speedup_vs_bf16_triton', float('nan')):.2f} vs bf16"
                + (f"  rel_err {rel:.1e}" if M == 16 else "")
                + (f"  sustained: {row['sustained']['us']:.1f} us x{row['sustained']['speedup_vs_bf16_triton']:.2f}"
                   if "sustained" in row else "")
                + (f"  eager: {row['eager']['us']:.1f} us x{row['eager']['speedup_vs_bf16_triton']:.2f}"
                   if "eager" in row else ""))
            result["records"].append(row)
            _write_json(out_json, result)
            del sets
        del wts, bf16
        torch.cuda.empty_cache()
    _write_json(out_json, result)
    return result


def _alternate(fn_a: Callable, fn_b: Callable, sets, rounds: int, replays: int,
               warm_ms: float = 0.0, eager: bool = False) -> Tuple[List[float], List[float]]:
    """(fn_a's, fn_b's) graph times (eager: eager_time_us) over `rounds` rounds that time them alternately."""
    timer = eager_time_us if eager else graph_time_us
    a_us, b_us = [], []
    for _ in range(rounds):
        a_us.append(timer(fn_a, sets, replays, warm_ms=warm_ms))
        b_us.append(timer(fn_b, sets, replays, warm_ms=warm_ms))
    return a_us, b_us


def _write_json(path: Optional[str], result: Dict) -> None:
    if path:
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(result, fh, indent=1)


def quant_main(argv: Optional[Sequence[str]] = None) -> None:
    """`python -m moekit.benchmarks.gpu quant-compile --workers N` | `quant --out FILE [--deadline S] [--command C]`."""
    import argparse  # noqa: PLC0415

    p = argparse.ArgumentParser(description="the quantized Triton experts benchmark")
    p.add_argument("what", choices=["quant-compile", "quant"])
    p.add_argument("--out", default="h200-triton-quant.json")
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--deadline", type=float, default=1e9)
    p.add_argument("--command", default="")
    args = p.parse_args(argv)
    if args.what == "quant-compile":
        failures = precompile_quant(args.workers)
        print(f"{len(failures)} compile failures", *failures[:10], sep="\n", flush=True)
    else:
        run_quant_bench(args.out, deadline_s=args.deadline, command=args.command,
                        progress=lambda line: print(line, flush=True))


if __name__ == "__main__":
    from moekit.benchmarks.gpu import quant_main as _main  # the importable module, so spawned workers unpickle its jobs

    _main()

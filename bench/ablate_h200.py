"""What the launches around the GEMMs cost a whole call, on one H200 (an ablation, not a fix).

For each decode / medium point, the call through the shipped tables is timed four ways in one
process, interleaved, in CUDA graphs of calls with distinct routing (as the decode bench):
    full        as shipped;
    no_align    the alignment (and the quantization of x fused into it) replaced by its result
                for that routing set, computed once before the graph: GEMM1 starts the call;
    no_sum      the sum over k skipped (the output left unwritten);
    gemms_only  both.
The outputs of the ablated calls are wrong by design (no_sum) or stale (no_align's x rows);
only their times are read: full - no_align bounds what removing the alignment launch can save,
full - no_sum what folding the sum over k into GEMM2 can.

    PYTHONPATH=src python bench/ablate_h200.py [--out FILE] [--rounds 3]

`--device cpu` is a dry run under TRITON_INTERPRET=1 on tiny shapes (wall-clock times).
"""

import contextlib
import statistics

import torch

from moekit.benchmarks.floors import floor_seconds
from moekit.benchmarks.gpu import (GPU_SHAPES, PERF_TABLE_CEILINGS, _quant_call, ab_arg_parser, ab_device, ab_time_us,
                                  quantized_weights, routing_sets, write_ab_result)
from moekit.kernels import launch, launch_quant, triton_moe, triton_prefill
from moekit.kernels import triton_quant_rows as qr
from moekit.kernels.launch import fused_moe

BF16_POINTS = (("qwen3-30b-a3b", 16), ("qwen3-30b-a3b", 64), ("qwen3-30b-a3b", 256), ("olmoe-1b-7b", 16),
               ("olmoe-1b-7b", 256), ("mixtral-8x7b", 256))
FP8_POINTS = (("qwen3-30b-a3b", 16), ("qwen3-30b-a3b", 64), ("qwen3-30b-a3b", 256), ("mixtral-8x7b", 256))
VARIANTS = ("full", "no_align", "no_sum", "gemms_only")


class _Skipped:
    """Stands in for a Triton kernel: launching it does nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def _cached(fn):
    """fn's result per topk_ids tensor (its address and the other arguments' identities)."""
    memo = {}

    def wrapper(topk_ids, *args, **kwargs):
        key = (topk_ids.data_ptr(), tuple(a if isinstance(a, (int, bool, type(None))) else id(a) for a in args[:3]))
        if key not in memo:
            memo[key] = fn(topk_ids, *args, **kwargs)
        return memo[key]
    return wrapper


class _KeptBuffers:
    """launch_quant's `torch` while the alignment is ablated: empty() hands back, per routing set,
    the buffers the alignment's launch wrote the first time (x's quantized rows [*, H] fp8 and the
    static scales' source rows [T*k] int32), so later calls read them instead of garbage; every
    other allocation is fresh."""

    def __init__(self):
        self.kept, self.key = {}, None

    def __getattr__(self, name):
        return getattr(torch, name)

    def empty(self, *shape, dtype=None, device=None):
        kind = None
        if dtype == torch.int32 and len(shape) == 1:
            kind = "src"
        elif dtype == torch.float8_e4m3fn and len(shape) == 2 and shape[1] == self.hidden:
            kind = "x_rows"
        if kind is None:
            return torch.empty(*shape, dtype=dtype, device=device)
        return self.kept.setdefault((self.key, kind), torch.empty(*shape, dtype=dtype, device=device))


def _no_sum(y, topk_ids, emap, has_map, out_dtype):
    return torch.empty(topk_ids.shape[0], y.shape[-1], dtype=out_dtype, device=y.device)


@contextlib.contextmanager
def ablated(variant, caches):
    """Patch the launchers for a variant (caches: the alignment memos, kept across calls)."""
    saved = (launch.moe_align, launch_quant.moe_align, launch_quant.align_and_quantize, triton_moe.sum_over_k,
             triton_prefill.sum_over_k, qr.sum_slots_kernel, launch_quant.torch)
    if variant in ("no_align", "gemms_only"):
        launch_quant.torch = caches["buffers"]
        launch.moe_align = caches["moe_align"]
        launch_quant.moe_align = caches["moe_align"]
        launch_quant.align_and_quantize = caches["align_and_quantize"]
    if variant in ("no_sum", "gemms_only"):
        triton_moe.sum_over_k = triton_prefill.sum_over_k = _no_sum
        qr.sum_slots_kernel = _Skipped()
    try:
        yield
    finally:
        (launch.moe_align, launch_quant.moe_align, launch_quant.align_and_quantize, triton_moe.sum_over_k,
         triton_prefill.sum_over_k, qr.sum_slots_kernel, launch_quant.torch) = saved


def _point(label, run, sets, rounds, cuda, floor):
    caches = {"moe_align": _cached(launch.moe_align), "align_and_quantize": _cached(launch_quant.align_and_quantize),
              "buffers": _KeptBuffers()}
    caches["buffers"].hidden = sets[0][0].shape[1]
    fns = {}
    for v in VARIANTS:
        def fn(*s, v=v):
            caches["buffers"].key = s[2].data_ptr()
            with ablated(v, caches):
                return run(*s)
        fns[v] = fn
    ref = [run(*s) for s in sets]
    for s in sets:  # fills the alignment caches and the kept buffers
        fns["no_align"](*s)
    same = all(torch.equal(fns["no_align"](*s), r) for s, r in zip(sets, ref))  # from the caches: the same bits
    times = {v: [] for v in VARIANTS}
    for _ in range(rounds):
        for v in VARIANTS:
            times[v].append(ab_time_us(fns[v], sets, cuda))
    med = {v: statistics.median(t) for v, t in times.items()}
    row = {"point": label, "floor_us": floor, "us": med, "rounds_us": times,
           "no_align_same_bits": same,
           "align_cost_us": med["full"] - med["no_align"], "sum_cost_us": med["full"] - med["no_sum"],
           "pct_of_floor": {v: 100 * floor / t for v, t in med.items()} if floor else None}
    print(f"{label:32s} " + " ".join(f"{v} {med[v]:8.1f}" for v in VARIANTS)
          + f"  align {row['align_cost_us']:5.1f} sum {row['sum_cost_us']:5.1f}"
          + (f"  floor% full {row['pct_of_floor']['full']:.1f} gemms {row['pct_of_floor']['gemms_only']:.1f}"
             if floor else ""), flush=True)
    return row


def main() -> None:
    p = ab_arg_parser(__doc__, "h200-ablate.json")
    args = p.parse_args()
    cuda, dev = ab_device(args)
    dtype = torch.bfloat16 if cuda else torch.float32
    shapes = {s[0]: s for s in GPU_SHAPES} if cuda else {"tiny": ("tiny", 8, 2, 64, 32)}
    bf16_points = BF16_POINTS if cuda else (("tiny", 5), ("tiny", 300))
    rows = []
    gen = torch.Generator(device=dev).manual_seed(0)
    for shape in dict.fromkeys(s for s, _ in bf16_points):
        _, E, k, H, I = shapes[shape]
        w13 = (torch.randn(E, 2 * I, H, device=dev, generator=gen) * H ** -0.5).to(dtype)
        w2 = (torch.randn(E, H, I, device=dev, generator=gen) * I ** -0.5).to(dtype)
        for _, M in (pt for pt in bf16_points if pt[0] == shape):
            sets = routing_sets(M, E, k, H, 8 if cuda else 2, dtype, dev)
            run = lambda x, w, ids: fused_moe(x, w13, w2, None, None, w, ids, None, "silu", direct=False,  # noqa: E731
                                              out_dtype=x.dtype)
            floor = floor_seconds(M, E, k, H, I, 2, PERF_TABLE_CEILINGS) * 1e6 if cuda else None
            rows.append(_point(f"{shape} bf16 M={M}", run, sets, args.rounds, cuda, floor))
        del w13, w2
    fp8_points = FP8_POINTS if cuda else (("tiny", 5), ("tiny", 300))
    for shape, M in fp8_points:
        _, E, k, H, I = shapes[shape]
        wts = quantized_weights("fp8_w8a8", E, H, I, True, dev)
        sets = routing_sets(M, E, k, H, 8 if cuda else 2, torch.bfloat16 if cuda else torch.float16, dev)
        floor = floor_seconds(M, E, k, H, I, 1, PERF_TABLE_CEILINGS, 2.0) * 1e6 if cuda else None
        rows.append(_point(f"{shape} fp8 static M={M}", lambda x, w, ids: _quant_call(wts, x, w, ids), sets,
                           args.rounds, cuda, floor))
        del wts
    write_ab_result(args.out, "ablation: the alignment and the sum over k removed from whole calls", cuda,
                    "CUDA graph of 8 calls with distinct softmax top-k routing, replayed 10 times; median of "
                    f"{args.rounds} interleaved rounds, us per call", points=rows)


if __name__ == "__main__":
    main()

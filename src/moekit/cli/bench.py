"""`moekit bench`: moekit's experts against peers in the same process; writes JSON."""

from __future__ import annotations

import json
import os
import shlex
import sys

from moekit.cli.main import UsageError, installed


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="benchmark the experts against transformers and torch peers")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--M", type=int, nargs="+", default=None, help="token counts (default: the issue's list)")
    p.add_argument("--shapes", nargs="+", default=None, help="shape names to run (default: all)")
    p.add_argument("--reps", type=int, default=None, help="cpu: repetitions per point (default 7)")
    p.add_argument("--budget", type=float, default=None,
                   help="cpu: seconds per (shape, M, implementation) at most (default 20)")
    p.add_argument("--impls", nargs="+", default=None, help="only these implementations")
    p.add_argument("--quant", default=None, metavar="SCHEME",
                   help="cuda: time the quantized Triton experts of SCHEME (fp8_w8a8, int4_w4a16, ...) against "
                        "the bf16 Triton kernel instead of the peers")
    p.add_argument("--static-scales", action="store_true",
                   help="with --quant fp8_w8a8: static per-tensor activation scales (as fp8 checkpoints carry)")
    p.add_argument("--rounds", type=int, default=None,
                   help="with --quant: rounds per point, the quantized and the bf16 kernel alternately (default 3)")
    p.add_argument("--warm-ms", type=float, default=0.0,
                   help="cuda: replay each call this long before timing it, so the clocks settle where "
                        "sustained work holds them (the power limit, at large M); default 0: short bursts. "
                        "With --quant both are recorded (the warmed times under \"sustained\")")
    p.add_argument("--out", default=None, help="write the results JSON here")
    p.set_defaults(func=run)


# The implementations each device's benchmark times (moekit's, then the peers).
_IMPLS = {
    "cpu": ("moekit_auto", "moekit_grouped_mm", "torch_grouped_gemm", "hf_eager", "hf_grouped_mm"),
    "cuda": ("moekit_triton", "moekit_grouped_mm", "torch_grouped_gemm", "hf_grouped_mm"),
}


def _check_args(args) -> None:
    """Refuse what cannot run or would be ignored; fill in the defaults of the options left out."""
    if args.device == "cuda":
        for flag, value in (("--reps", args.reps), ("--budget", args.budget)):
            if value is not None:
                raise UsageError(f"{flag} sets the CPU benchmark's timing; --device cuda times CUDA graphs")
    if args.rounds is not None and args.quant is None:
        raise UsageError("--rounds goes with --quant (the quantized and the bf16 kernel alternately)")
    args.reps = 7 if args.reps is None else args.reps
    args.budget = 20.0 if args.budget is None else args.budget
    args.rounds = 3 if args.rounds is None else args.rounds
    if args.device != "cuda":
        for flag, value in (("--quant", args.quant), ("--static-scales", args.static_scales),
                            ("--warm-ms", args.warm_ms)):
            if value:
                raise UsageError(f"{flag} times the Triton kernels, so it needs --device cuda")
    if args.static_scales and args.quant != "fp8_w8a8":
        raise UsageError(f"--static-scales goes with --quant fp8_w8a8, got --quant {args.quant}")
    if args.quant is not None:
        from moekit.quant import get_scheme  # noqa: PLC0415

        try:
            get_scheme(args.quant)
        except ValueError as err:
            raise UsageError(f"--quant: {err}") from None
        if args.impls:
            raise UsageError("--quant times the quantized and the bf16 Triton kernels; "
                             "--impls chooses among the peers of the unquantized benchmark")
    if args.shapes:
        if args.device == "cuda":
            from moekit.benchmarks.gpu import GPU_SHAPES as known  # noqa: PLC0415
        else:
            from moekit.benchmarks.cpu import CPU_SHAPES as known  # noqa: PLC0415
        names = [s[0] for s in known]
        unknown = [n for n in args.shapes if n not in names]
        if unknown:
            raise UsageError(f"--shapes on {args.device} must be among {names}, got {unknown}")
    if args.reps < 1 or args.budget <= 0:
        raise UsageError(f"--reps must be >= 1 and --budget > 0, got {args.reps} and {args.budget}")
    if args.M is not None and min(args.M) < 1:
        raise UsageError(f"--M takes token counts >= 1, got {args.M}")
    if args.impls:
        known = _IMPLS[args.device]
        unknown = [n for n in args.impls if n not in known]
        if unknown:
            raise UsageError(f"--impls on {args.device} must be among {list(known)}, got {unknown}")
        hf = [n for n in args.impls if n.startswith("hf_")]
        if hf and not installed("transformers"):
            raise UsageError(f"--impls {' '.join(hf)}: transformers' experts need transformers: "
                             "pip install 'moekit[hf]'")
    if args.rounds < 1 or args.warm_ms < 0:
        raise UsageError(f"--rounds must be >= 1 and --warm-ms >= 0, got {args.rounds} and {args.warm_ms}")
    if args.out and not os.path.isdir(os.path.dirname(args.out) or "."):
        raise UsageError(f"--out: no folder {os.path.dirname(args.out)!r} to write {args.out!r} in")
    if args.device == "cuda":
        import torch  # noqa: PLC0415

        if not torch.cuda.is_available():
            raise UsageError("--device cuda needs a CUDA GPU (torch.cuda.is_available() is False)")
        if args.quant is not None and not installed("triton"):
            raise UsageError("--quant times the Triton kernels, so it needs Triton: pip install 'moekit[gpu]'")


def _quant_cases(args):
    """(shape, scheme, static scales, Ms) of each shape named (default: the five of PERF.md)."""
    from moekit.benchmarks.gpu import GPU_MS, GPU_SHAPES  # noqa: PLC0415

    names = args.shapes or [s[0] for s in GPU_SHAPES]
    return tuple((name, args.quant, args.static_scales, tuple(args.M or GPU_MS)) for name in names)


def _table(result) -> None:
    for r in result["records"]:
        cells = "  ".join(f"{n}={v['ms']:.2f}ms" for n, v in r["impls"].items())
        ratios = "  ".join(f"x{r[k]:.2f} vs {k[11:]}" for k in r if k.startswith("speedup_vs_"))
        auto = r["impls"].get("moekit_auto")
        pct = f"{auto['pct_of_floor']:.0f}% of floor" if auto else ""
        print(f"{r['shape']:22s} M={r['M']:<6d} {cells}\n{'':29s}{ratios}  {pct}")


def run(args) -> int:
    command = "moekit " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    _check_args(args)
    say = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    if args.quant is not None:
        from moekit.benchmarks.gpu import run_quant_bench  # noqa: PLC0415

        result = run_quant_bench(None, cases=_quant_cases(args), rounds=args.rounds,
                                 sustain_ms=args.warm_ms, sustain_from_m=0, command=command, progress=say)
    elif args.device == "cuda":
        from moekit.benchmarks.gpu import run_gpu_bench  # noqa: PLC0415

        result = run_gpu_bench(shapes=args.shapes, Ms=args.M, out_json=None, impls=args.impls, progress=say,
                               warm_ms=args.warm_ms)
    else:
        from moekit.benchmarks.cpu import CPU_SHAPES, run_cpu_bench  # noqa: PLC0415

        shapes = [s for s in CPU_SHAPES if args.shapes is None or s[0] in args.shapes]
        if args.impls is None and not installed("transformers"):
            say("transformers is not installed: its eager and grouped_mm experts (hf_eager, hf_grouped_mm) "
                "are left out; pip install 'moekit[hf]' to time them")
        result = run_cpu_bench(shapes, Ms=args.M or (1, 32, 512), reps=args.reps, budget_s=args.budget,
                               impls=args.impls, progress=say)
        _table(result)
    result["command"] = command
    if args.out:
        try:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=2)
        except OSError as err:
            raise UsageError(f"--out: cannot write {args.out!r}: {err}") from None
        print(f"wrote {args.out}")
    return 0

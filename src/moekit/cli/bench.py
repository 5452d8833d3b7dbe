"""`moekit bench`: moekit's experts against peers in the same process; writes JSON."""

from __future__ import annotations

import json
import shlex
import sys


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="benchmark the experts against transformers and torch peers")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--M", type=int, nargs="+", default=None, help="token counts (default: the issue's list)")
    p.add_argument("--shapes", nargs="+", default=None, help="shape names to run (default: all)")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--budget", type=float, default=20.0, help="seconds per (shape, M, implementation) at most")
    p.add_argument("--impls", nargs="+", default=None, help="only these implementations")
    p.add_argument("--out", default=None, help="write the results JSON here")
    p.set_defaults(func=run)


def _table(result) -> None:
    for r in result["records"]:
        cells = "  ".join(f"{n}={v['ms']:.2f}ms" for n, v in r["impls"].items())
        ratios = "  ".join(f"x{r[k]:.2f} vs {k[11:]}" for k in r if k.startswith("speedup_vs_"))
        auto = r["impls"].get("moekit_auto")
        pct = f"{auto['pct_of_floor']:.0f}% of floor" if auto else ""
        print(f"{r['shape']:22s} M={r['M']:<6d} {cells}\n{'':29s}{ratios}  {pct}")


def run(args) -> int:
    command = "moekit " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    if args.device == "cuda":
        from moekit.benchmarks.gpu import run_gpu_bench  # noqa: PLC0415

        result = run_gpu_bench(shapes=args.shapes, Ms=args.M, out_json=None)
    else:
        from moekit.benchmarks.cpu import CPU_SHAPES, run_cpu_bench  # noqa: PLC0415

        shapes = [s for s in CPU_SHAPES if args.shapes is None or s[0] in args.shapes]
        result = run_cpu_bench(shapes, Ms=args.M or (1, 32, 512), reps=args.reps, budget_s=args.budget,
                               impls=args.impls, progress=lambda line: print(line, file=sys.stderr, flush=True))
        _table(result)
    result["command"] = command
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {args.out}")
    return 0

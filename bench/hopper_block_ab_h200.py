"""The block scheme's CUDA kernels (kernels/hopper_block.py) against its Gluon kernels, in one process.

For each point "shape:M" (fp8_w8a8_block128, dynamic activation groups), the same call with
128-row Gluon tiles and GEMM1 off cuBLAS (knobs gluon=128, cublas1="off", cuda="off") and on the
CUDA kernels (cuda="on": CTA pairs sharing the A tiles and K steps in pairs; "cuda c1" single CTAs,
"cuda serial" each K step promoted before the next is issued); with --bf16 also the bf16 Triton kernel of the shipped tables on bf16
weights of the same shape (for the ratio the block scheme's target is set against). Outputs of the
CUDA kernels against the Gluon kernels' (relative error, and whether the bits agree), then
CUDA-graph times interleaved over --rounds, then one profiled eager pass of each variant (kernel
times per call).

    PYTHONPATH=src python bench/hopper_block_ab_h200.py --point deepseek-v3:16384 [--point ...]
        [--bf16] [--rounds 3] [--out FILE]
"""

import statistics
import time

import torch

from moekit.benchmarks.gpu import (AB_TIMING, _quant_call, ab_arg_parser, ab_time_us, eager_time_us, point_call,
                                   quantized_weights, routing_sets, shape_by_name, write_ab_result)
from moekit.benchmarks.floors import layer_flops
from moekit.kernels import hopper_block
from profile_h200 import _kernel_rows, profile_calls
from moekit.kernels.quant_tuning import QuantKnobs

SCHEME = "fp8_w8a8_block128"
_GLUON = QuantKnobs(gluon=128, cublas1="off", cuda="off")
_CUDA = QuantKnobs(gluon=128, cublas1="off", cuda="on")
# label: (knobs, hopper_block.CLUSTER, hopper_block.PIPELINED); "cuda" is the shipped setting
VARIANTS = {"gluon": (_GLUON, 2, True), "cuda": (_CUDA, 2, True), "cuda c1": (_CUDA, 1, True),
            "cuda serial": (_CUDA, 2, False),
            "cuda gemm1": (QuantKnobs(gluon=128, cublas1="off", cuda="gemm1"), 1, True)}


def _variant(wts, kn, cluster, pipelined):
    def call(*s):
        hopper_block.CLUSTER, hopper_block.PIPELINED = cluster, pipelined
        return _quant_call(wts, *s, knobs=kn)
    return call


def _kernels(fn, sets) -> list:
    """[(kernel name, us per call)] of one profiled eager pass, largest first."""
    return [(r["kernel"][:100], r["us_per_call"]) for r in _kernel_rows(profile_calls(fn, sets), len(sets))]


def main() -> None:
    p = ab_arg_parser(__doc__, "hopper_block_ab.json")
    p.add_argument("--point", action="append", required=True, help="shape:M (repeatable)")
    p.add_argument("--bf16", action="store_true", help="also time the bf16 kernel of the shipped tables")
    p.add_argument("--variants", default=None, help="comma-separated variants to time (default: all; gluon always)")
    p.add_argument("--eager", action="store_true",
                   help="also time every variant eagerly, and the shipped rule's GEMM1 on cuBLAS (cublas1 auto)")
    args = p.parse_args()
    t0 = time.perf_counter()
    print("hopper_block:", hopper_block.status(), f"({time.perf_counter() - t0:.1f} s)", flush=True)
    rows = []
    for point in args.point:
        name, M = point.split(":")[0], int(point.split(":")[1])
        _, E, k, H, I = shape_by_name(name)
        flop = layer_flops(M, k, H, I)
        wts = quantized_weights(SCHEME, E, H, I, False, "cuda")
        sets = routing_sets(M, E, k, H, 4 if M >= 4096 else 8, torch.bfloat16, "cuda")
        chosen = {"gluon", *(args.variants.split(",") if args.variants else VARIANTS)}
        calls = {label: _variant(wts, *v) for label, v in VARIANTS.items() if label in chosen}
        row = {"point": point, "variants": {label: {"rounds_us": []} for label in calls}}
        ref = [calls["gluon"](*s) for s in sets]
        main_v = next((v for v in ("cuda", "cuda c1", "cuda serial", "cuda gemm1") if v in calls), None)
        try:
            outs = [calls[main_v](*s) for s in sets] if main_v else []
            row["cuda_grids"] = [hopper_block.load().moekit_block_last_grid(m) for m in (1, 2)]
            same = [v for v in ("cuda c1", "cuda serial") if v in calls and v != main_v and main_v != "cuda gemm1"]
            row["cuda_variants_bits_equal_cuda"] = all(torch.equal(o, calls[v](*s)) for o, s in zip(outs, sets)
                                                       for v in same)
            torch.cuda.synchronize()
            for v in [v for v in calls if v != "gluon"]:
                o_v = outs if v == main_v else [calls[v](*s) for s in sets]
                row.setdefault("rel_err_vs_gluon", {})[v] = max(((o.float() - r.float()).norm() / r.norm()).item()
                                                                for o, r in zip(o_v, ref))
            row["cuda_bits_equal_gluon"] = all(torch.equal(o, r) for o, r in zip(outs, ref))
            row["cuda_run_to_run_bits"] = all(torch.equal(o, calls[main_v](*s)) for o, s in zip(outs, sets))
            print(f"{point}: grids {row['cuda_grids']}, rel err vs gluon {row.get('rel_err_vs_gluon')}, run to run "
                  f"{row['cuda_run_to_run_bits']}", flush=True)
        except Exception as exc:  # noqa: BLE001 (a variant that cannot run is a result)
            row["variants"][main_v] = {"failed": f"{type(exc).__name__}: {exc}"[:800]}
            print(f"{point}: {main_v} failed: {row['variants'][main_v]['failed']}", flush=True)
        if args.eager:
            calls["gluon cublas1"] = _variant(wts, QuantKnobs(gluon=128, cublas1="auto", cuda="off"), 2, True)
            row["variants"]["gluon cublas1"] = {"rounds_us": []}
        if args.bf16:
            bf16_fn, bf16_sets, _, _ = point_call(f"{name}:bf16:{M}", len(sets))
            calls["bf16"] = bf16_fn
            row["variants"]["bf16"] = {"rounds_us": []}
        set_of = {label: (bf16_sets if label == "bf16" else sets) for label in calls}
        for _ in range(args.rounds):
            for label, fn in calls.items():
                v = row["variants"][label]
                if "failed" not in v:
                    v["rounds_us"].append(ab_time_us(fn, set_of[label], True, replays=5))
                    if args.eager:
                        v.setdefault("eager_rounds_us", []).append(eager_time_us(fn, set_of[label], replays=3))
        for label, v in row["variants"].items():
            if "failed" in v:
                continue
            v["us"] = statistics.median(v["rounds_us"])
            if args.eager:
                v["eager_us"] = statistics.median(v["eager_rounds_us"])
            v["tflops"] = flop / v["us"] / 1e6
            v["kernels_us"] = _kernels(calls[label], set_of[label][:2])
        base = row["variants"]["gluon"]["us"]
        for label, v in row["variants"].items():
            if "us" in v:
                extra = f"  x{row['variants']['bf16']['us'] / v['us']:.3f} vs bf16" if "bf16" in row["variants"] else ""
                eager = f"  eager {v['eager_us']:10.1f} us" if "eager_us" in v else ""
                print(f"{point:22s} {label:13s} {v['us']:10.1f} us {v['tflops']:7.1f} TFLOP/s  "
                      f"x{base / v['us']:.3f} vs gluon{extra}{eager}", flush=True)
                for kname, us in v["kernels_us"][:6]:
                    print(f"      {us:10.1f} us  {kname}", flush=True)
        rows.append(row)
        del wts, sets, calls
        torch.cuda.empty_cache()
    hopper_block.CLUSTER, hopper_block.PIPELINED = 2, True
    write_ab_result(args.out, "hopper-block-ab", True, AB_TIMING, rows=rows)


if __name__ == "__main__":
    main()

"""The block scheme's Gluon kernels against the Triton tiles of the same calls, in one process.

For each point "shape:M" (fp8_w8a8_block128, dynamic activation groups): the shipped tiles with
knobs.gluon = 0 (Triton), 64 and 128 (moekit's Gluon kernels, kernels/gluon_block.py), and with
--stages / --group-m the 128-row Gluon kernels at other shared-memory ring depths / GROUP_M; outputs against the Triton
variant's (relative error), then CUDA-graph times interleaved over --rounds.

    PYTHONPATH=src python bench/gluon_block_ab_h200.py --point deepseek-v3:16384 [--point ...]
        [--stages 3 5] [--out FILE]
"""

import statistics
from dataclasses import replace

import torch

from moekit.benchmarks.gpu import AB_TIMING, _quant_call, ab_time_us, quantized_weights, routing_sets, shape_by_name, \
    write_ab_result
from moekit.kernels import gluon_block
from moekit.kernels.launch_quant import quant_tiles
from moekit.kernels.quant_rows import modes_of
from moekit.quant import get_scheme

SCHEME = "fp8_w8a8_block128"


def main() -> None:
    from moekit.benchmarks.gpu import ab_arg_parser  # noqa: PLC0415

    p = ab_arg_parser(__doc__, "gluon_block_ab.json")
    p.add_argument("--point", action="append", required=True, help="shape:M (repeatable)")
    p.add_argument("--stages", type=int, nargs="*", default=[], help="ring depths to try besides the default")
    p.add_argument("--group-m", type=int, nargs="*", default=[], help="GROUP_M values to try besides the default")
    args = p.parse_args()
    scheme = get_scheme(SCHEME)
    rows = []
    for point in args.point:
        name, M = point.split(":")[0], int(point.split(":")[1])
        _, E, k, H, I = shape_by_name(name)
        wts = quantized_weights(SCHEME, E, H, I, False, "cuda")
        cfg, knobs = quant_tiles(M, E, k, H, I, torch.bfloat16, "NVIDIA_H200", scheme, modes_of(scheme))
        sets = routing_sets(M, E, k, H, 8, torch.bfloat16, "cuda")
        variants = {"triton": (replace(knobs, gluon=0), None, None),
                    "gluon 64": (replace(knobs, gluon=64), None, None),
                    "gluon 128": (replace(knobs, gluon=128), None, None)}
        variants.update({f"gluon 128 stages {n}": (replace(knobs, gluon=128), n, None) for n in args.stages})
        variants.update({f"gluon 128 GROUP_M {g}": (replace(knobs, gluon=128), None, g) for g in args.group_m})

        def call(kn, stages, group_m, *s):
            gluon_block.NUM_BUF, gluon_block.GROUP_M = stages or 4, group_m or 8
            return _quant_call(wts, *s, config=cfg, knobs=kn)

        ref = [call(*variants["triton"], *s).float() for s in sets]
        row = {"point": point, "shipped_knobs": knobs.to_json(), "variants": {}}
        for label, variant in variants.items():
            try:
                err = max(((call(*variant, *s).float() - r).norm() / r.norm()).item() for s, r in zip(sets, ref))
                row["variants"][label] = {"rel_err_vs_triton": err, "rounds_us": []}
            except Exception as exc:  # noqa: BLE001 (a variant that cannot run is a result)
                row["variants"][label] = {"failed": f"{type(exc).__name__}: {exc}"[:500]}
        for _ in range(args.rounds):
            for label, variant in variants.items():
                v = row["variants"][label]
                if "failed" not in v:
                    v["rounds_us"].append(ab_time_us(lambda *s, var=variant: call(*var, *s), sets, True, replays=10))
        base = statistics.median(row["variants"]["triton"]["rounds_us"])
        for label, v in row["variants"].items():
            if "failed" in v:
                print(f"{point:22s} {label:20s} failed: {v['failed'][:150]}", flush=True)
                continue
            v["us"] = statistics.median(v["rounds_us"])
            print(f"{point:22s} {label:20s} {v['us']:9.1f} us  x{base / v['us']:.3f} vs triton  "
                  f"rel err {v['rel_err_vs_triton']:.1e}", flush=True)
        rows.append(row)
        del wts
        torch.cuda.empty_cache()
    gluon_block.NUM_BUF, gluon_block.GROUP_M = 4, 8
    write_ab_result(args.out, "gluon-block-ab", True, AB_TIMING, rows=rows)


if __name__ == "__main__":
    main()

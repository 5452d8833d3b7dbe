"""The prefill kernels (kernels/triton_prefill.py) on one H200, in one call: correctness against
`reference` on slices of the five PERF.md shapes, then every candidate of
kernels.tuning.prefill_space at M in {1024, 4096, 16384} against the current tuned kernels and
the plain torch grouped-GEMM layer (same process, CUDA graphs, fresh routing per call).

    PYTHONPATH=src python bench/triton_prefill_h200.py [--out DIR] [--workers N] [--shapes a,b] [--ms 1024,4096]
        [--only act_tma=1,x_tma=1] [--only ws=1] [--extra]

Writes DIR/prefill_results.json (every timing, errors, padding waste, the winners) and
DIR/configs/E=..,N=..,device_name=NVIDIA_H200.json: the shipped table with the measured M
entries replaced by the fastest config (a prefill one or the current one), ready for
src/moekit/kernels/configs/. DIR defaults to $OUT, else ./prefill_out. Points left when the
deadline passes are recorded as skipped, and the files are still written.
`--device cpu` is a dry run of the whole script under TRITON_INTERPRET=1 on tiny fp32 shapes.
"""

import argparse
import dataclasses
import json
import multiprocessing
import os
import statistics
import sys
import time

import torch

from moekit.benchmarks.floors import layer_flops
from moekit.benchmarks.gpu import (GPU_SHAPES, eager_time_us, graph_time_us, host_sync_reason, prefill_kernel_key,
                                  prefill_label, routing_sets)
from moekit.benchmarks.peers import plain_grouped_gemm
from moekit.experts.base import ExpertWeights
from moekit.experts.reference import reference_experts
from moekit.kernels.launch import fused_moe
from moekit.kernels.tuning import (
    SHIPPED_DIR, MoEConfig, PrefillConfig, TileConfig, config_file_name, get_config, parse_configs, prefill_space,
)

MS = (1024, 4096, 16384)
PEAK = 790e12  # PERF.md's bf16 ceiling
TOL = {torch.bfloat16: 1e-2, torch.float32: 1e-5}  # PERF.md
DEVICE_NAME = "NVIDIA_H200"


# --extra: tile pairs outside kernels.tuning.prefill_space, timed with both operands of both
# GEMMs by TMA (the first is prefill_space's first pair, for reference in the same process).
EXTRA_TILES = (
    (TileConfig(128, 128, 64, 8, 8, 3), TileConfig(128, 256, 64, 8, 8, 3)),
    (TileConfig(128, 128, 64, 8, 8, 4), TileConfig(128, 256, 64, 8, 8, 4)),    # deeper pipelines
    (TileConfig(128, 64, 128, 8, 8, 3), TileConfig(128, 128, 128, 8, 8, 3)),   # K tiles of 128
    (TileConfig(256, 128, 64, 8, 16, 3), TileConfig(256, 128, 64, 8, 16, 3)),  # 256 rows, 4 warpgroups
    (TileConfig(256, 128, 64, 8, 16, 3), TileConfig(256, 256, 64, 8, 16, 3)),
)


def extra_candidates(T: int, E: int, k: int) -> list:
    if T * k / E < 64:
        return []
    return [MoEConfig(g1, g2, PrefillConfig(2, 1, tail, act_tma=1, x_tma=x_tma))
            for g1, g2 in EXTRA_TILES for tail in (1, 2, 4) for x_tma in (0, 1)]


def _compile(job) -> str:
    """Run one config once on E experts of H = 1024, I = 256 (the real shapes' specialisations:
    every H, I is a multiple of 16 and H >= 1024 gives the same sum-over-k blocks)."""
    entry, E, k = job
    try:
        cfg = MoEConfig.from_json(entry)
        w13 = torch.randn(E, 512, 1024, device="cuda", dtype=torch.bfloat16) * 0.03
        w2 = torch.randn(E, 1024, 256, device="cuda", dtype=torch.bfloat16) * 0.06
        T = max(600, 1200 // k)  # above the one-program alignment
        x = torch.randn(T, 1024, device="cuda", dtype=torch.bfloat16)
        ids = torch.stack([torch.randperm(E, device="cuda")[:k] for _ in range(T)]).int()
        fused_moe(x, w13, w2, None, None, torch.rand(T, k, device="cuda"), ids, None, "silu", config=cfg,
                  direct=False, out_dtype=x.dtype)
        torch.cuda.synchronize()
        return ""
    except Exception as err:  # noqa: BLE001 - reported; the variant then fails its check and is skipped
        return f"{prefill_kernel_key(MoEConfig.from_json(entry))} E={E}: {type(err).__name__}: {str(err)[:300]}"


class Bench:
    """Shapes, device and dtype of one run (cuda/bf16, or the cpu/fp32 dry run)."""

    def __init__(self, shapes, Ms, device: str, limit: int, only: dict, extra: bool = False):
        self.shapes, self.Ms, self.dev, self.limit, self.only = shapes, Ms, torch.device(device), limit, only
        self.extra = extra
        self.dtype = torch.bfloat16 if device == "cuda" else torch.float32
        self.name = DEVICE_NAME if device == "cuda" else None

    def candidates(self, shape, M) -> list:
        if self.extra:
            return extra_candidates(M, shape[1], shape[2])
        cands = prefill_space(M, shape[1], shape[2])  # bf16 tiles (the dry run's interpreter has no smem limit)
        if self.only:  # candidates with any of these knob values
            cands = [c for c in cands if any(getattr(c.prefill, k) == v for k, v in self.only.items())]
        return cands[:self.limit] if self.limit else cands

    def current(self, shape, M) -> MoEConfig:
        name, E, k, H, I = shape
        return get_config(M, E, k, H, I, self.dtype, self.name)

    def precompile(self, workers: int) -> list:
        """Fill Triton's disk cache in parallel processes: one job per distinct GEMM kernel pair
        (8 experts), then one per alignment specialisation (E, row granule) of the shapes."""
        if self.dev.type != "cuda":
            return []
        kernels, aligns = {}, {}
        for shape in self.shapes:
            E, k = shape[1], shape[2]
            for M in self.Ms:
                for cfg in [self.current(shape, M)] + self.candidates(shape, M):
                    kernels.setdefault(prefill_kernel_key(cfg), (cfg.to_json(), 8, 2))
                    aligns.setdefault((E, k, cfg.row_granule), (cfg.to_json(), E, k))
        with multiprocessing.get_context("spawn").Pool(workers) as pool:
            failures = [r for r in pool.imap_unordered(_compile, list(kernels.values())) if r]
            failures += [r for r in pool.imap_unordered(_compile, list(aligns.values())) if r]
        return failures

    def _rand(self, *shape, gen, scale=1.0):
        return (torch.randn(*shape, device=self.dev, generator=gen) * scale).to(self.dtype)

    def check(self, shape, variants, gen) -> dict:
        """Relative error of each variant against `reference` on a slice (<= 16 experts, 512
        tokens), inf when two runs differ; then biases and an expert map on one variant."""
        name, E, k, H, I = shape
        Es = min(E, 16)
        T = 512 if self.dev.type == "cuda" else 96
        w13, w2 = self._rand(Es, 2 * I, H, gen=gen, scale=H ** -0.5), self._rand(Es, H, I, gen=gen, scale=I ** -0.5)
        b13, b2 = self._rand(Es, 2 * I, gen=gen), self._rand(Es, H, gen=gen)
        x = self._rand(T, H, gen=gen)
        ids = torch.rand(T, Es, device=self.dev, generator=gen).topk(k, dim=1).indices.int()
        w = torch.rand(T, k, device=self.dev, generator=gen) + 0.05
        ref = reference_experts(x, ExpertWeights(w13, w2, None, None), w, ids)
        errs = {}
        for key, cfg in variants.items():
            try:
                out = fused_moe(x, w13, w2, None, None, w, ids, None, "silu", config=cfg, direct=False,
                                out_dtype=x.dtype)
                again = fused_moe(x, w13, w2, None, None, w, ids, None, "silu", config=cfg, direct=False,
                                  out_dtype=x.dtype)
                err = float((out.float() - ref).norm() / ref.norm())
                errs[key] = err if torch.equal(out, again) else float("inf")
            except Exception as e:  # noqa: BLE001 - recorded; the variant is left out of the sweep
                errs[key] = f"{type(e).__name__}: {str(e)[:200]}"
        # Biases and an expert map (half the global experts remote), one program per work item
        # (a persistent grid where the knobs need one).
        cfg = max(variants.values(), key=lambda c: c.prefill.tail)
        persistent = int(cfg.prefill.ws or cfg.prefill.flatten)
        cfg = dataclasses.replace(cfg, prefill=dataclasses.replace(cfg.prefill, programs_per_sm=persistent))
        emap = torch.full((2 * Es,), -1, dtype=torch.int32, device=self.dev)
        emap[torch.randperm(2 * Es, device=self.dev, generator=gen)[:Es]] = torch.arange(Es, dtype=torch.int32,
                                                                                        device=self.dev)
        gids = torch.rand(T, 2 * Es, device=self.dev, generator=gen).topk(k, dim=1).indices.int()
        ref = reference_experts(x, ExpertWeights(w13, w2, b13, b2), w, gids, expert_map=emap)
        out = fused_moe(x, w13, w2, b13, b2, w, gids, emap, "silu", config=cfg, direct=False, out_dtype=x.dtype)
        errs["bias+expert_map"] = float((out.float() - ref).norm() / ref.norm())
        return errs

    def time(self, fn, sets, probe: bool) -> tuple:
        """(us per call, how): a CUDA graph unless fn syncs with the host (probed), else eager;
        wall clock in the dry run."""
        if self.dev.type != "cuda":
            t = time.perf_counter()
            for args in sets:
                fn(*args)
            return (time.perf_counter() - t) * 1e6 / len(sets), "wall"
        with torch.inference_mode():
            if not probe or host_sync_reason(fn, sets[0]) is None:
                try:
                    return graph_time_us(fn, sets, replays=3), "graph"
                except RuntimeError:
                    pass
            return eager_time_us(fn, sets, replays=3), "eager"

    def weights(self, shape, gen) -> tuple:
        name, E, k, H, I = shape
        return self._rand(E, 2 * I, H, gen=gen, scale=H ** -0.5), self._rand(E, H, I, gen=gen, scale=I ** -0.5)

    def point(self, shape, M, w13, w2, deadline, wrong) -> dict:
        """Time torch's grouped GEMM, the current config and every prefill candidate at M tokens."""
        name, E, k, H, I = shape
        row = {"shape": name, "E": E, "k": k, "H": H, "I": I, "M": M, "flops": layer_flops(M, k, H, I), "impls": {}}
        if time.monotonic() > deadline:
            row["skipped"] = "out of time"
            return row
        # Two routings per graph: at M >= 1024 the weights (>= 0.8 GB) are far past the L2 anyway.
        sets = routing_sets(M, E, k, H, 2 if self.dev.type == "cuda" else 1, self.dtype, self.dev)
        try:
            us, how = self.time(plain_grouped_gemm(w13, w2), sets, probe=True)
            row["impls"]["torch_grouped_gemm"] = {"us": us, "timing": how}
        except Exception as err:  # noqa: BLE001 - recorded, the sweep goes on
            row["impls"]["torch_grouped_gemm"] = {"error": f"{type(err).__name__}: {str(err)[:200]}"}
        impls = {"current": self.current(shape, M), **{prefill_label(c): c for c in self.candidates(shape, M)}}
        for label, cfg in impls.items():
            if time.monotonic() > deadline:
                row["impls"][label] = {"skipped": "out of time"}
                continue
            if label != "current" and prefill_kernel_key(cfg) in wrong:
                row["impls"][label] = {"skipped": "failed the correctness check"}
                continue
            try:
                us, how = self.time(lambda x, w, i: fused_moe(x, w13, w2, None, None, w, i, None, "silu", config=cfg,
                                                              out_dtype=x.dtype), sets, probe=False)
                row["impls"][label] = {"us": us, "timing": how, "config": cfg.to_json(),
                                       "mma_rows_over_TK": mma_rows(sets[0][2], E, cfg) / (M * k)}
            except Exception as err:  # noqa: BLE001 - recorded, the sweep goes on
                row["impls"][label] = {"error": f"{type(err).__name__}: {str(err)[:200]}"}
        for r in row["impls"].values():
            if "us" in r:
                r["tflops"] = row["flops"] / r["us"] * 1e-6
        timed = {n: r["us"] for n, r in row["impls"].items() if "us" in r}
        row["best_prefill"] = min((n for n in timed if n.startswith("prefill")), key=timed.get, default=None)
        row["winner"] = min((n for n in timed if n != "torch_grouped_gemm"), key=timed.get, default=None)
        return row


def mma_rows(ids: torch.Tensor, E: int, cfg: MoEConfig) -> int:
    """Rows the tensor cores multiply for this routing: whole BM tiles, the tail loops' BM/2, BM/4."""
    counts = torch.bincount(ids.flatten().long(), minlength=E).tolist()
    bm, tail = cfg.block_m, cfg.prefill.tail if cfg.prefill else 1
    g = bm // tail
    total = 0
    for c in counts:
        full, rest = divmod(-(-c // g) * g, bm)
        total += full * bm
        if rest:
            total += bm if tail == 1 or rest > bm // 2 else (bm // 2 if tail == 2 or rest > bm // 4 else bm // 4)
    return total


def line(row) -> str:
    imp, nan = row["impls"], float("nan")
    cur, tg = imp.get("current", {}), imp.get("torch_grouped_gemm", {})
    best = imp.get(row.get("best_prefill") or "", {})
    return (f"{row['shape']:14s} {row['M']:6d} | current {cur.get('us', nan):9.1f} us {cur.get('tflops', nan):4.0f} | "
            f"torch_gmm {tg.get('us', nan):9.1f} us | prefill {best.get('us', nan):9.1f} us "
            f"{best.get('tflops', nan):4.0f} TF/s {100 * best.get('tflops', nan) * 1e12 / PEAK:5.1f}% of 790 "
            f"x{cur.get('us', nan) / best.get('us', nan):.2f} cur x{tg.get('us', nan) / best.get('us', nan):.2f} torch"
            f" rows {best.get('mma_rows_over_TK', nan):.2f} | {(row.get('best_prefill') or '-')[8:]}")


def knob_table(rows) -> list:
    """Best time with each knob at each value over the point's best prefill time (1.00 = the best)."""
    lines = []
    defaults = dataclasses.asdict(PrefillConfig())
    for row in rows:
        pre = [r for n, r in row["impls"].items() if n.startswith("prefill") and "us" in r]
        if not pre:
            continue
        best = min(r["us"] for r in pre)
        parts = []
        for knob, values in (("tma", (1, 2, 0)), ("programs_per_sm", (2, 1, 0)), ("tail", (1, 2, 4)),
                             ("flatten", (1, 0)), ("act_tma", (1, 0)), ("x_tma", (1, 0)), ("ws", (1, 0))):
            for v in values:
                ts = [r["us"] for r in pre if dict(defaults, **r["config"]["prefill"])[knob] == v]
                parts.append(f"{knob[:4]}={v}:{min(ts) / best:.2f}" if ts else f"{knob[:4]}={v}:-")
        bms = sorted({r["config"]["BLOCK_SIZE_M"] for r in pre})
        parts += [f"BM={bm}:{min(r['us'] for r in pre if r['config']['BLOCK_SIZE_M'] == bm) / best:.2f}" for bm in bms]
        lines.append(f"{row['shape']:14s} {row['M']:6d} " + " ".join(parts))
    return lines


def write_configs(rows, shapes, folder) -> list:
    """The shipped table of each shape with its measured M entries set to the winner's config."""
    os.makedirs(folder, exist_ok=True)
    paths = []
    for name, E, k, H, I in shapes:
        fname = config_file_name(E, I, DEVICE_NAME)
        shipped = os.path.join(SHIPPED_DIR, fname)
        table = {}
        if os.path.isfile(shipped):
            with open(shipped, encoding="utf-8") as fh:
                table = {M: c.to_json() for M, c in parse_configs(fh.read(), shipped).items()}
        for row in rows:
            if row["shape"] == name and row.get("winner") and row["winner"] != "current":
                table[row["M"]] = row["impls"][row["winner"]]["config"]
        path = os.path.join(folder, fname)
        with open(path, "w", encoding="utf-8") as fh:
            json.dump({str(M): table[M] for M in sorted(table)}, fh, indent=1)
            fh.write("\n")
        paths.append(path)
    return paths


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.environ.get("OUT") or "prefill_out")
    p.add_argument("--workers", type=int, default=max(1, min(14, (os.cpu_count() or 2) - 2)))
    p.add_argument("--shapes", default="", help="comma-separated names of benchmarks.gpu.GPU_SHAPES (default: all)")
    p.add_argument("--ms", default=",".join(map(str, MS)))
    p.add_argument("--limit", type=int, default=0, help="time only the first N prefill candidates of a point")
    p.add_argument("--only", default="", help="time only candidates with any of these prefill knob values, "
                                              "e.g. act_tma=1,x_tma=1 (the current config is always timed)")
    p.add_argument("--extra", action="store_true", help="time EXTRA_TILES (tiles outside the tuner's space) instead")
    p.add_argument("--deadline", type=float, default=320.0, help="seconds from the start; later points are skipped")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    args = p.parse_args()
    t0 = time.monotonic()
    say = lambda text: print(text, flush=True)  # noqa: E731
    os.makedirs(args.out, exist_ok=True)
    shapes = [s for s in GPU_SHAPES if not args.shapes or s[0] in args.shapes.split(",")]
    if args.device == "cpu":  # tiny stand-ins: the shapes' E and k, H = 64, I = 32
        shapes = [(name, min(E, 16), min(k, 4), 64, 32) for name, E, k, H, I in shapes]
    only = {k: int(v) for k, v in (kv.split("=") for kv in args.only.split(",") if kv)}
    bench = Bench(shapes, [int(m) for m in args.ms.split(",")], args.device, args.limit, only, args.extra)
    import triton  # noqa: PLC0415

    cuda = args.device == "cuda"
    result = {"benchmark": "triton-prefill", "device": torch.cuda.get_device_name() if cuda else "cpu",
              "sms": torch.cuda.get_device_properties(0).multi_processor_count if cuda else None,
              "torch": torch.__version__, "triton": triton.__version__, "command": " ".join(sys.argv),
              "timing": "CUDA graph of 2 calls with fresh softmax top-k routing, 3 replays, median us per call; "
                        "bf16 weights (std H^-1/2, I^-1/2), silu, no bias, output in bf16",
              "shapes": shapes}
    say(f"{result['device']}, {result['sms']} SMs, torch {torch.__version__}, triton {triton.__version__}")
    failures = bench.precompile(args.workers)
    result["compile_s"], result["compile_failures"] = time.monotonic() - t0, failures
    say(f"compiled in {result['compile_s']:.0f} s, {len(failures)} failures"
        + "".join(f"\n  compile failure: {f}" for f in failures[:8]))
    gen = torch.Generator(device=bench.dev).manual_seed(0)
    result["errors"], wrong = {}, set()
    for shape in shapes:
        variants = {}
        for M in bench.Ms:
            for cfg in bench.candidates(shape, M):  # checked on a persistent grid (programs walk many tiles)
                variants.setdefault(prefill_kernel_key(cfg), dataclasses.replace(
                    cfg, prefill=dataclasses.replace(cfg.prefill, programs_per_sm=1)))
        if not variants:
            continue
        errs = bench.check(shape, variants, gen)
        result["errors"][shape[0]] = errs
        bad = sorted(key for key, e in errs.items() if not isinstance(e, float) or e > TOL[bench.dtype])
        wrong |= set(bad) - {"bias+expert_map"}
        floats = [e for e in errs.values() if isinstance(e, float)]
        say(f"check {shape[0]:14s}: {len(errs)} runs, median rel err {statistics.median(floats):.1e}, "
            f"worst {max(floats):.1e}, {len(bad)} failed" + "".join(f"\n  FAILED {key}: {errs[key]}" for key in bad))
    result["check_s"] = time.monotonic() - t0
    # Every shape's weights stay resident (~29 GB in bf16); M = 4096 first, as the deadline
    # would cut the last points.
    gen = torch.Generator(device=bench.dev).manual_seed(1)
    weights = {shape: bench.weights(shape, gen) for shape in shapes}
    rows = []
    for M in sorted(bench.Ms, key=lambda m: (m != 4096, -m)):
        for shape in shapes:
            row = bench.point(shape, M, *weights[shape], t0 + args.deadline, wrong)
            rows.append(row)
            if "skipped" not in row:
                say(line(row))
            result["rows"] = rows
            with open(os.path.join(args.out, "prefill_results.json"), "w", encoding="utf-8") as fh:
                json.dump(result, fh, indent=1)
    del weights
    order = [s[0] for s in shapes]
    rows.sort(key=lambda r: (order.index(r["shape"]), r["M"]))
    say("\nknob effect (best time with the knob at that value / best prefill time of the point; "
        "prog = programs per SM, 0 = one per work item):")
    for text in knob_table(rows):
        say(text)
    say("\nsummary (prefill = the fastest prefill candidate; rows = tensor-core rows / T*k):")
    for row in rows:
        if "skipped" not in row:
            say(line(row))
    result["configs"] = write_configs(rows, shapes, os.path.join(args.out, "configs"))
    result["total_s"] = time.monotonic() - t0
    with open(os.path.join(args.out, "prefill_results.json"), "w", encoding="utf-8") as fh:
        json.dump(result, fh, indent=1)
    say(f"wrote {args.out}/prefill_results.json and {len(result['configs'])} config files in {result['total_s']:.0f} s")


if __name__ == "__main__":
    main()

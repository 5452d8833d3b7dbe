"""The quantized Triton experts on one H200 in one call: GPU tests, a sweep of tiles and
variants (QuantKnobs), tuned tables, then the benchmark on those tables.

    PYTHONPATH=src python bench/triton_quant_h200.py [--out DIR] [--budget S] [--workers N] [--skip-tests]
    python bench/triton_quant_h200.py --unpack DIR/tuned-configs.json   (into src/moekit/kernels/configs/)
    ... --points "qwen3-30b-a3b:fp8_w8a8:s:16,64"   (a partial sweep: those points, shipped entries kept)

DIR ($OUT, else ./quant-h200) receives four files: tests.txt (pytest -m gpu on the quantized
kernel tests, run beside the compilation), tuned-configs.json (the tuned quantized tables,
{file name: table}; --unpack writes them as the shipped files), sweep.json (every timing)
and h200-triton-quant.json (the benchmark through the tuned tables, the format of
bench/results/h200-triton-quant.json). The table at the end gives, per shape, scheme and M:
the untuned time, the tuned time, its % of the floor, x vs the bf16 Triton kernel, and the
winning tiles and knobs.

Search per point (kernels/quant_tuning.quant_search_space): GEMM1 candidates beside the current
entry's GEMM2 (or the first GEMM2 candidate of their BLOCK_SIZE_M: cli.tune_quant.gemm1_candidate),
then GEMM2 candidates (split_k among them) with the winning GEMM1 and its GEMM1 knobs, then the winner with one knob flipped: pdl, fuse_x_quant (fp8), w_convert
(int4). Candidates compile beforehand in parallel processes, the flips while the sweep runs.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

OUT = os.environ.get("OUT") or "quant-h200"
# (shape, scheme, static fp8 activation scales, Ms), most important first.
SWEEP = (
    ("mixtral-8x7b", "int4_w4a16", False, (16, 1, 64)),
    ("qwen3-30b-a3b", "int4_w4a16", False, (16, 1, 64)),
    ("deepseek-v3", "fp8_w8a8_block128", False, (16384, 16, 64, 256, 4096)),
    ("qwen3-30b-a3b", "fp8_w8a8", True, (16, 16384, 64, 256, 4096)),
    ("mixtral-8x7b", "fp8_w8a8", True, (256, 16, 64, 16384, 4096)),
    ("mixtral-8x7b", "int8_w8a16", False, (16, 1, 64)),
    ("qwen3-30b-a3b", "int8_w8a16", False, (16, 1, 64)),
)
PERF_MS = (1, 16, 64, 256, 1024, 4096, 16384)


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=OUT)
    p.add_argument("--budget", type=float, default=330.0, help="seconds for the whole call")
    p.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 4) - 4))
    p.add_argument("--skip-tests", action="store_true")
    p.add_argument("--cap", type=int, default=28, help="candidates timed per GEMM and point")
    p.add_argument("--unpack", metavar="TUNED_CONFIGS_JSON", help="write a run's tables into src/moekit/kernels/configs/")
    p.add_argument("--points", help="sweep only these points, ';'-separated SHAPE:SCHEME:s|d:M,M,... (s: static "
                                    "fp8 activation scales); the tables keep their shipped entries at other Ms and "
                                    "the benchmark runs these points only")
    return p.parse_args()


def parse_points(text: str):
    """--points into SWEEP's form."""
    out = []
    for part in filter(None, text.split(";")):
        shape, scheme, st, ms = part.split(":")
        out.append((shape, scheme, st == "s", tuple(int(m) for m in ms.split(","))))
    return tuple(out)


def unpack(bundle: str) -> None:
    folder = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src", "moekit", "kernels", "configs")
    with open(bundle, encoding="utf-8") as fh:
        tables = json.load(fh)
    for name, table in tables.items():
        with open(os.path.join(folder, name), "w", encoding="utf-8") as fh:
            json.dump(table, fh, indent=1)
            fh.write("\n")
        print("wrote", os.path.normpath(os.path.join(folder, name)))


if __name__ == "__main__":  # not in the compile processes, which import this file again
    args = parse_args()
    if args.unpack:
        unpack(args.unpack)
        sys.exit(0)
    T0 = time.monotonic()
    # The tables the benchmark reads live outside DIR (a call returns few files): DIR gets one bundle.
    CONFIGS = os.path.join(tempfile.gettempdir(), "moekit-quant-configs")
    shutil.rmtree(CONFIGS, ignore_errors=True)
    os.makedirs(CONFIGS)
    os.makedirs(args.out, exist_ok=True)
    os.environ["MOEKIT_TUNED_CONFIG_DIR"] = CONFIGS  # read once, when moekit is imported
    if args.points:
        SWEEP = parse_points(args.points)

import multiprocessing  # noqa: E402

import torch  # noqa: E402

from moekit.benchmarks import gpu  # noqa: E402
from moekit.kernels import quant_tuning  # noqa: E402
from moekit.cli.tune_quant import GEMM1_KNOBS, gemm1_candidate  # noqa: E402
from moekit.kernels.launch_quant import quant_config, quant_tiles  # noqa: E402
from moekit.kernels.quant_rows import modes_of  # noqa: E402
from moekit.kernels.quant_tuning import QuantKnobs, quant_file_name, quant_search_space  # noqa: E402
from moekit.kernels.tuning import SHIPPED_DIR, MoEConfig, device_name, get_config  # noqa: E402
from moekit.quant import emulated_experts, get_scheme  # noqa: E402


def say(msg: str) -> None:
    print(f"[{time.monotonic() - T0:6.1f}s] {msg}", flush=True)


def left() -> float:
    return args.budget - (time.monotonic() - T0)


def start_tests():
    env = {k: v for k, v in os.environ.items() if k != "MOEKIT_TUNED_CONFIG_DIR"}
    out = open(os.path.join(args.out, "tests.txt"), "w", encoding="utf-8")
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider",
           "tests/kernels/test_triton_quant_gpu.py", "tests/kernels/test_triton_quant_knobs_gpu.py"]
    return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env), out


def plan():
    """Points of the sweep with their candidates and the untuned choice."""
    dev = device_name()
    points = []
    for name, scheme, static, Ms in SWEEP:
        _, E, k, H, I = gpu.shape_by_name(name)
        sch = get_scheme(scheme)
        modes = modes_of(sch)
        for M in Ms:
            g1, g2 = quant_search_space(M, E, k, modes.kgroup, modes.act_dtype is None, modes.w_int4,
                                        modes.a_kscale or modes.w_kscale)
            g2 = {bm: c[:args.cap] for bm, c in g2.items()}
            default = quant_tiles(M, E, k, H, I, torch.bfloat16, dev, sch, modes)
            points.append(dict(shape=name, scheme=scheme, static=static, E=E, k=k, H=H, I=I, M=M,
                               g1=[c for c in g1 if c[0].BLOCK_SIZE_M in g2][:args.cap], g2=g2, default=default))
    return points


def stage1(pt, t, kn):
    return gemm1_candidate(t, kn, pt["g2"], pt["default"])


def stage2(g1, kn1, t2, kn2):
    return MoEConfig(g1, t2), QuantKnobs(**dict(kn1, **kn2))


def kernel_ids(pt, cfg, kn):
    """The compiled GEMM1 and GEMM2 kernels a candidate runs (knobs that change other kernels left out)."""
    base = [pt["scheme"], pt["static"], pt["H"], pt["I"], kn.w_convert, kn.pdl]
    g1 = json.dumps(base + [cfg.gemm1.to_json(), kn.gate_up, kn.prefetch1, kn.swap1])
    g2 = json.dumps(base + [cfg.block_m, cfg.gemm2.to_json(), kn.prefetch2, kn.split_k > 1, kn.swap2])
    return g1, g2


def jobs_of(points):
    """Compile jobs, round-robin over points by rank (a deadline cut drops every list's tail)."""
    lists = []
    for pt in points:
        head = [pt["default"]]
        if pt["scheme"].startswith("int4"):
            head += [(pt["default"][0], QuantKnobs(w_convert=c)) for c in ("cast", "ptx")]
        g1 = [stage1(pt, t, kn) for t, kn in pt["g1"]]
        firsts = {}
        for t, kn in pt["g1"]:
            firsts.setdefault(t.BLOCK_SIZE_M, (t, kn))
        g2 = [stage2(*firsts[bm], t2, kn2) for bm, cands in pt["g2"].items() if bm in firsts for t2, kn2 in cands]
        lists.append([(pt, c) for c in head + g1 + g2])
    order, seen = [], set()
    for rank in range(max(len(x) for x in lists)):
        for lst in lists:
            if rank < len(lst):
                pt, (cfg, kn) = lst[rank]
                entry = gpu.quant_entry(cfg, kn)
                key = json.dumps([pt["scheme"], pt["static"], pt["H"], pt["I"], entry], sort_keys=True)
                if key not in seen:
                    seen.add(key)
                    order.append((kernel_ids(pt, cfg, kn),
                                  [pt["scheme"], pt["static"], pt["H"], pt["I"], min(pt["M"], 64), pt["k"], entry]))
    return order


class Compiler:
    """A pool of processes compiling jobs (Triton's disk cache then serves this process); the
    kernels compiled so far are in `done`."""

    def __init__(self):
        self.pool = multiprocessing.get_context("spawn").Pool(args.workers)
        self.pending, self.done, self.failures = [], set(), []

    def submit(self, order):
        self.pending += [(ids, self.pool.apply_async(gpu._compile_quant_job, (job,))) for ids, job in order]

    def collect(self, deadline=0.0):
        """Take in finished jobs, waiting until the deadline for the rest; returns how many are left."""
        while True:
            still = []
            for ids, res in self.pending:
                if res.ready():
                    err = res.get()
                    if err:
                        self.failures.append(err)
                    else:
                        self.done.update(ids)
                else:
                    still.append((ids, res))
            self.pending = still
            if not still or time.monotonic() >= deadline:
                return len(still)
            time.sleep(0.25)

    def close(self):
        self.pool.terminate()


def timed(fn, sets, M):
    try:
        return gpu.graph_time_us(fn, sets, replays=3 if M <= 256 else 2)
    except Exception as err:  # noqa: BLE001 - a candidate that fails to run is skipped
        say(f"   candidate failed: {type(err).__name__}: {str(err).splitlines()[0][:160] if str(err) else ''}")
        return float("inf")


def sweep_point(pt, wts, compiled, budget, device="cuda", dtype=torch.bfloat16):
    """Time the point's compiled candidates (GEMM1 stage: half the budget, GEMM2 stage: the rest);
    returns its sweep record (timings by entry) and the routing sets."""
    start = time.monotonic()
    sets = gpu.routing_sets(pt["M"], pt["E"], pt["k"], pt["H"], 4 if pt["M"] <= 4096 else 2, dtype, device)
    seen = {}
    stage_end = [start + 0.5 * budget]

    def run(cfg, kn):
        entry = gpu.quant_entry(cfg, kn)
        key = json.dumps([pt["scheme"], pt["static"], pt["H"], pt["I"], entry], sort_keys=True)
        if key in seen:
            return seen[key]
        if not compiled.issuperset(kernel_ids(pt, cfg, kn)) or time.monotonic() > stage_end[0]:
            return float("inf")
        seen[key] = us = timed(lambda x, w, i: gpu._quant_call(wts, x, w, i, cfg, kn), sets, pt["M"])
        return us

    default_us = run(*pt["default"])
    best = (default_us, pt["default"])
    for t, kn in pt["g1"]:
        cfg = stage1(pt, t, kn)
        best = min(best, (run(*cfg), cfg), key=lambda b: b[0])
    g1, kn1 = best[1][0].gemm1, {k: v for k, v in best[1][1].to_json().items() if k in GEMM1_KNOBS}
    stage_end[0] = start + budget
    for t2, kn2 in pt["g2"].get(g1.BLOCK_SIZE_M, []):
        cfg = stage2(g1, kn1, t2, kn2)
        best = min(best, (run(*cfg), cfg), key=lambda b: b[0])
    rec = {k: pt[k] for k in ("shape", "scheme", "static", "E", "k", "H", "I", "M")}
    rec.update(default_us=default_us, default=gpu.quant_entry(*pt["default"]), best_us=best[0],
               best=gpu.quant_entry(*best[1]), timings=seen)
    return rec, sets


def toggles(pt, rec):
    """Variants of a point's winner, one knob flipped each: PDL; x quantized in its own launch (fp8);
    the other int4 weight conversions."""
    cfg, kn = gpu.parse_quant_entry(rec["best"])
    flips = [dict(pdl=not kn.pdl)]
    if pt["scheme"].startswith("fp8"):
        flips.append(dict(fuse_x_quant=not kn.fuse_x_quant))
    if pt["scheme"].startswith("int4"):
        flips += [dict(w_convert=c) for c in ("cast", "bits", "ptx") if c != kn.w_convert]
    return [(cfg, QuantKnobs(**dict(kn.to_json(), **f))) for f in flips]


def finish_point(pt, rec, sets, wts, compiled, budget):
    """Time the winner's toggles, keep the best; check it against the emulated reference (M <= 64)."""
    t_end = time.monotonic() + budget
    best = (rec["best_us"], gpu.parse_quant_entry(rec["best"]))
    for cfg, kn in toggles(pt, rec):
        entry = gpu.quant_entry(cfg, kn)
        key = json.dumps([pt["scheme"], pt["static"], pt["H"], pt["I"], entry], sort_keys=True)
        if key in rec["timings"] or not compiled.issuperset(kernel_ids(pt, cfg, kn)) or time.monotonic() > t_end:
            continue
        rec["timings"][key] = us = timed(lambda x, w, i: gpu._quant_call(wts, x, w, i, cfg, kn), sets, pt["M"])
        best = min(best, (us, (cfg, kn)), key=lambda b: b[0])
    cfg, kn = best[1]
    rec.update(best_us=best[0], best=gpu.quant_entry(cfg, kn),
               tried=sum(1 for v in rec["timings"].values() if v != float("inf")),
               timings=[[k, v] for k, v in rec["timings"].items()])
    if best[0] != float("inf") and pt["M"] <= 64:
        x, w, ids = sets[0]
        ref = emulated_experts(x, wts, w, ids)
        out = gpu._quant_call(wts, x, w, ids, cfg, kn).float()
        rec["rel_err_vs_reference"] = float((out - ref).norm() / ref.norm())
    return rec


def write_tables(records):
    """One tuned file per (shape, scheme): the winners, and the untuned choice at the other PERF.md Ms."""
    dev = device_name()
    by_file = {}
    for r in records:
        if r["best_us"] == float("inf"):
            continue
        sch = get_scheme(r["scheme"])
        path = os.path.join(CONFIGS, quant_file_name(r["E"], r["I"], dev, sch))
        table = by_file.setdefault(path, ({}, r))[0]
        table[r["M"]] = r["best"]
    bundle = {}
    for path, (table, r) in by_file.items():
        sch = get_scheme(r["scheme"])
        shipped = {}
        shipped_path = os.path.join(SHIPPED_DIR, quant_file_name(r["E"], r["I"], dev, sch))
        if args.points and os.path.isfile(shipped_path):
            with open(shipped_path, encoding="utf-8") as fh:
                shipped = json.load(fh)
        for M in PERF_MS:
            if M not in table and str(M) in shipped:  # a partial sweep keeps the shipped entries
                table[M] = shipped[str(M)]
            elif M not in table:
                bf16 = get_config(M, r["E"], r["k"], r["H"], r["I"], torch.bfloat16, dev)
                table[M] = gpu.quant_entry(quant_config(bf16, modes_of(sch)), QuantKnobs())
        bundle[os.path.basename(path)] = {str(M): table[M] for M in sorted(table)}
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(bundle[os.path.basename(path)], fh, indent=1)
        say(f"tuned table {os.path.basename(path)}")
    with open(os.path.join(args.out, "tuned-configs.json"), "w", encoding="utf-8") as fh:
        json.dump(bundle, fh, indent=1)


def compact(entry):
    g2 = entry.get("gemm2", {})
    s = (f"{entry['BLOCK_SIZE_M']}x{entry['BLOCK_SIZE_N']}x{entry['BLOCK_SIZE_K']}w{entry['num_warps']}s{entry['num_stages']}"
         f"/{g2.get('BLOCK_SIZE_N')}x{g2.get('BLOCK_SIZE_K')}w{g2.get('num_warps')}s{g2.get('num_stages')}")
    kn = entry.get("quant", {})
    return s + ("" if not kn else " " + ",".join(f"{k}={v}" for k, v in kn.items()))


def main():
    say(f"out {args.out}, budget {args.budget:.0f} s, {args.workers} compile workers, {torch.cuda.get_device_name()}")
    tests = None if args.skip_tests else start_tests()
    points = plan()
    order = jobs_of(points)
    say(f"{len(points)} points, {len(order)} compile jobs")
    compiler = Compiler()
    compiler.submit(order)
    cut = compiler.collect(T0 + min(110.0, 0.35 * args.budget))
    say(f"compiled {len(compiler.done)} kernels, {len(compiler.failures)} jobs failed, {cut} jobs not done yet")
    for f in compiler.failures[:6]:
        say(f"   compile failure: {f[:300]}")
    if tests is not None:
        proc, out = tests
        try:
            proc.wait(timeout=max(1.0, T0 + 0.45 * args.budget - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            say("GPU tests killed: out of time")
        out.close()
        with open(os.path.join(args.out, "tests.txt"), encoding="utf-8") as fh:
            lines = fh.read().splitlines()
        say("GPU tests: " + (lines[-1] if lines else "no output") + f" (rc {proc.returncode})")
        for line in [ln for ln in lines if ln.startswith("FAILED")][:8]:
            say("   " + line[:200])
    # Time, case by case (one set of weights each): large-M points get more seconds (fewer, slower
    # candidates); each winner's toggles compile meanwhile and are timed at the end of the case;
    # the benchmark keeps 60 s.
    weight = {p["M"]: (3.0 if p["M"] >= 4096 else 1.0) for p in points}
    records, cases = [], []
    for pt in points:
        if not cases or cases[-1][0] != (pt["shape"], pt["scheme"], pt["static"]):
            cases.append(((pt["shape"], pt["scheme"], pt["static"]), []))
        cases[-1][1].append(pt)
    done_pts = 0
    for key, pts in cases:
        torch.cuda.empty_cache()
        wts = gpu.quantized_weights(key[1], pts[0]["E"], pts[0]["H"], pts[0]["I"], key[2], "cuda")
        staged = []
        for pt in pts:
            share = weight[pt["M"]] / sum(weight[p["M"]] for p in points[done_pts:])
            budget = max(0.0, (left() - 60.0) * share)
            done_pts += 1
            compiler.collect()
            with torch.inference_mode():
                rec, sets = sweep_point(pt, wts, compiler.done, 0.9 * budget)
            compiler.submit([(kernel_ids(pt, cfg, kn), [pt["scheme"], pt["static"], pt["H"], pt["I"], min(pt["M"], 64),
                                                        pt["k"], gpu.quant_entry(cfg, kn)]) for cfg, kn in toggles(pt, rec)])
            staged.append((pt, rec, sets, 0.1 * budget))
        compiler.collect(time.monotonic() + 3.0)
        for pt, rec, sets, budget in staged:
            with torch.inference_mode():
                rec = finish_point(pt, rec, sets, wts, compiler.done, budget)
            records.append(rec)
            say(f"{pt['shape']:14s} {pt['scheme']:18s} M={pt['M']:6d}: default {rec['default_us']:9.1f} us, "
                f"best {rec['best_us']:9.1f} us ({rec['tried']} timed) {compact(rec['best'])}")
        with open(os.path.join(args.out, "sweep.json"), "w", encoding="utf-8") as fh:
            json.dump({"device": torch.cuda.get_device_name(), "records": records,
                       "compile_failures": compiler.failures}, fh, indent=1)
        del staged, wts
    compiler.close()
    torch.cuda.empty_cache()
    write_tables(records)
    quant_tuning.load_quant_configs.cache_clear()
    cases = gpu.QUANT_CASES if not args.points else SWEEP
    result = gpu.run_quant_bench(os.path.join(args.out, "h200-triton-quant.json"), cases=cases,
                                 deadline_s=max(5.0, left() - 10.0),
                                 command="PYTHONPATH=src python bench/triton_quant_h200.py (tuned tables in "
                                         f"{CONFIGS}, then quant_tuning lookups)",
                                 progress=lambda line: say(line))
    sweep = {(r["shape"], r["scheme"], r["static"], r["M"]): r for r in records}
    print("\nshape          scheme             st      M  untuned_us  tuned_us  %floor  x_bf16  rel_err  variant")
    for r in result["records"]:
        s = sweep.get((r["shape"], r["scheme"], r["static_act_scales"], r["M"]), {})
        print(f"{r['shape']:14s} {r['scheme']:18s} {'s' if r['static_act_scales'] else 'd'} {r['M']:6d} "
              f"{s.get('default_us', float('nan')):11.1f} {r.get('us', float('nan')):9.1f} "
              f"{r.get('pct_of_floor', float('nan')):6.1f} {r.get('speedup_vs_bf16_triton', float('nan')):7.2f} "
              f"{r.get('rel_err_vs_reference', s.get('rel_err_vs_reference', float('nan'))):8.1e}  "
              f"{compact(r['config']) if 'config' in r else r.get('error', r.get('skipped', ''))}")
    say("done")


if __name__ == "__main__":
    main()

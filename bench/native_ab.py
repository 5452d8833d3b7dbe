"""A/B of moekit's native CPU kernels between two versions of cpu_kernels.c, one process.

Each version is compiled (for this CPU) into its own cache folder; every timed call alternates
between them (the order flipped every round) on the same weights, rotated over several copies
so the weights stream from memory, with fresh routing per call. Prints the medians and B/A.

    python bench/native_ab.py --a HEAD~1 --b WORKTREE decode --schemes int4_w4a16 bf16
    python bench/native_ab.py --a HEAD~1 sorted --schemes int8_w8a8 --rows 1 4 16

--a / --b: a git revision (its src/moekit/native/cpu_kernels.c), a file path, or WORKTREE
(the file as it is now); --isa-a / --isa-b: the build of each (moekit.native's names). `decode`: NativeLibrary.decode of one token (--shape E,k,H,I, by
default 64,8,1024,512); `sorted`: the w13 products of `rows` rows for each of the E experts.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import subprocess
import tempfile
import time

import torch

from moekit import native, quantize_experts
from moekit.experts.common import native_decode

E, K_TOP, H, I = 64, 8, 1024, 512
KERNELS = pathlib.Path(native.__file__).with_name("cpu_kernels.c")
KINDS = {"int4_w4a16": "int4", "int8_w8a16": "int8", "int8_w8a8": "int8_w8a8", "bf16": "float"}


def source(spec: str, folder: pathlib.Path, tag: str) -> pathlib.Path:
    """The kernel source of a revision, a path, or WORKTREE, as a file."""
    if spec == "WORKTREE":
        return KERNELS
    if pathlib.Path(spec).is_file():
        return pathlib.Path(spec)
    rel = KERNELS.relative_to(pathlib.Path(__file__).resolve().parents[1])
    text = subprocess.run(["git", "show", f"{spec}:{rel}"], capture_output=True, text=True, check=True).stdout
    path = folder / f"cpu_kernels_{tag}.c"
    path.write_text(text)
    return path


def build(src: pathlib.Path, folder: pathlib.Path, tag: str, isa: str):
    saved = native.SOURCE
    native.SOURCE = src
    try:
        return native.build(isa, cache_dir=folder / tag)
    finally:
        native.SOURCE = saved


def weights(scheme: str, copies: int, lib):
    """[(p13, p2, kept tensors)] for decode."""
    out = []
    for _ in range(copies):
        w13, w2 = torch.randn(E, 2 * I, H) * H ** -0.5, torch.randn(E, H, I) * I ** -0.5
        if scheme == "bf16":
            a, b = w13.bfloat16(), w2.bfloat16()
            out.append((native.projection(a, "float"), native.projection(b, "float"), (a, b)))
        else:
            w = quantize_experts(w13, w2, scheme)
            _, p13, p2, _, _ = native_decode(lib, w, KINDS[scheme], 128)
            out.append((p13, p2, w))
    return out


def ab(libs, call, rounds: int, items: int):
    """Median seconds of call(lib, item) per library, alternating."""
    times = [[], []]
    for r in range(rounds):
        for item in range(items):
            for i in ((0, 1) if r % 2 == 0 else (1, 0)):
                t0 = time.perf_counter()
                call(libs[i], item)
                times[i].append(time.perf_counter() - t0)
    return [statistics.median(t) for t in times]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--a", required=True)
    p.add_argument("--b", default="WORKTREE")
    p.add_argument("--isa-a", default="native", help="build of A (moekit.native's isa names, e.g. native_rows4)")
    p.add_argument("--isa-b", default="native")
    p.add_argument("what", choices=("decode", "sorted"))
    p.add_argument("--schemes", nargs="+", default=["int4_w4a16"], choices=sorted(KINDS))
    p.add_argument("--rows", nargs="+", type=int, default=[4], help="sorted: rows an expert")
    p.add_argument("--shape", default="64,8,1024,512", help="E,k,H,I")
    p.add_argument("--copies", type=int, default=8)
    p.add_argument("--rounds", type=int, default=24)
    args = p.parse_args()
    global E, K_TOP, H, I
    E, K_TOP, H, I = (int(v) for v in args.shape.split(","))
    folder = pathlib.Path(tempfile.mkdtemp(prefix="moekit-native-ab-"))
    libs = [build(source(s, folder, t), folder, t, isa)
            for s, t, isa in ((args.a, "a", args.isa_a), (args.b, "b", args.isa_b))]
    torch.manual_seed(0)
    for scheme in args.schemes:
        ws = weights(scheme, args.copies, libs[0])
        if args.what == "decode":
            x, out, tw = torch.randn(1, H), torch.empty(1, H), torch.rand(1, K_TOP)

            def call(lib, item):
                p13, p2, _ = ws[item]
                lib.decode(p13, p2, torch.randperm(E)[:K_TOP].view(1, K_TOP), tw, x, out, activation="silu",
                           trusted=True)

            a, b = ab(libs, call, args.rounds, len(ws))
            print(f"decode {scheme}: A {a * 1e6:.1f} us  B {b * 1e6:.1f} us  B/A {b / a:.3f}", flush=True)
            continue
        for rows in args.rows:
            experts, starts = torch.arange(E), torch.arange(0, E * rows + 1, rows)
            x, out = torch.randn(E * rows, H), torch.empty(E * rows, 2 * I)
            scales = torch.empty(E * rows, 1)

            def call(lib, item):
                w = ws[item][2]
                if scheme == "bf16":
                    lib.float_gemm(w[0], experts, x, out, starts, trusted=True)
                elif scheme == "int8_w8a8":
                    lib.int8_gemm(w.w13, experts, x, out, starts, scales=scales, w_scale=w.scales["w13_scale"],
                                  trusted=True)
                else:
                    s = w.scales
                    lib.wo_gemm(w.w13, s["w13_scale"], s.get("w13_zero"), experts, x, out,
                                int4=scheme == "int4_w4a16", group_size=128, starts=starts, trusted=True)

            a, b = ab(libs, call, max(2, args.rounds // 4), len(ws))
            print(f"sorted {scheme}, {rows} rows an expert: A {a * 1e3:.2f} ms  B {b * 1e3:.2f} ms  B/A {b / a:.3f}",
                  flush=True)


if __name__ == "__main__":
    main()

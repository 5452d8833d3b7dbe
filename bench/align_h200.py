"""Time the alignment of assignments by expert (kernels/launch.py's moe_align) on one GPU.

The chunked path (four launches) against the one-launch medium alignment at a few MCHUNK
values, and the one-program sort where it is small enough:

    PYTHONPATH=src python bench/align_h200.py [--tk 1024,2048,4096,8192,16384] [--experts 64,128,256]
        [--k 8] [--mchunk 128,256,512] [--block-m 16] [--out-dir DIR]

Each variant is timed in a CUDA graph over --sets routings (moekit.benchmarks.gpu.graph_time_us:
microseconds per call, graph nodes and the gaps between them included). Before timing, every
variant's alignment of the first routing is checked against an independent one computed with
torch: the same bits for the one-program and medium paths (assignment order within an expert),
the same rows per expert as sets for the chunked path (arrival order). Writes
DIR/align_h200.json (DIR: --out-dir, else $OUT, else the working directory) and prints a table.
"""

import argparse
import json
import os
import sys

import torch

# Largest T*k the one-program sort is timed at (its bitonic sort grows with T*k; it is the
# default only up to kernels/launch.py's ALIGN_SMALL_MAX).
SMALL_TIMED_MAX = 4096


def _ints(text: str) -> list:
    return [int(v) for v in text.split(",") if v]


def routings(T: int, E: int, k: int, sets: int, seed: int) -> list:
    """`sets` routings [T, k] int32 on the GPU: k distinct experts per token, uniformly at random."""
    gen = torch.Generator(device="cuda")
    gen.manual_seed(seed)
    return [torch.rand(T, E, device="cuda", generator=gen).topk(k, dim=1).indices.to(torch.int32).contiguous()
            for _ in range(sets)]


def expected(ids: torch.Tensor, E: int, bm: int):
    """(rows, expert_end) of the alignment in assignment order within an expert, by torch alone."""
    flat = ids.reshape(-1).long()
    TK = flat.numel()
    counts = torch.bincount(flat, minlength=E)
    padded = (counts + bm - 1) // bm * bm
    ends = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    e = flat[order]
    first = torch.cumsum(counts, 0) - counts  # where each expert's run starts in `order`
    rows = (ends - padded)[e] + torch.arange(TK, device=ids.device) - first[e]
    out = torch.full((int(ends[-1]),), TK, dtype=torch.int32, device=ids.device)
    out[rows] = order.to(torch.int32)
    return out, ends.to(torch.int32)


def check(al, want_rows: torch.Tensor, want_end: torch.Tensor, exact: bool) -> bool:
    """The alignment's written rows and ends against `expected`'s (exact, or as sets per expert)."""
    if not torch.equal(al.expert_end, want_end):
        return False
    got = al.sorted_ids[:want_rows.numel()].long()
    if exact:
        return torch.equal(got, want_rows.long())
    seg = torch.searchsorted(want_end.long(), torch.arange(got.numel(), device=got.device), right=True)
    span = want_rows.numel() + 1
    return torch.equal(torch.sort(seg * span + got).values, torch.sort(seg * span + want_rows.long()).values)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tk", type=_ints, default=[1024, 2048, 4096, 8192, 16384], help="T*k values (comma separated)")
    p.add_argument("--experts", type=_ints, default=[64, 128, 256], help="numbers of experts E")
    p.add_argument("--k", type=int, default=8, help="experts per token")
    p.add_argument("--mchunk", type=_ints, default=[128, 256, 512], help="medium path: assignments per program")
    p.add_argument("--block-m", type=int, default=16, help="rows per GEMM block")
    p.add_argument("--sets", type=int, default=4, help="routings per graph (each a call)")
    p.add_argument("--out-dir", default=os.environ.get("OUT", "."))
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("align_h200.py needs a CUDA GPU")

    from moekit.benchmarks.gpu import graph_time_us  # noqa: PLC0415
    from moekit.kernels.launch import moe_align  # noqa: PLC0415
    from moekit.kernels.tuning import device_name  # noqa: PLC0415

    bm = args.block_m
    records, ok_all = [], True
    with torch.inference_mode():
        for E in args.experts:
            for TK in args.tk:
                T = TK // args.k
                ids = routings(T, E, args.k, args.sets, seed=E * 100003 + TK)
                want_rows, want_end = expected(ids[0], E, bm)
                variants = {"chunked": (dict(small_max=0, medium_max=0), False)}
                if T * args.k <= SMALL_TIMED_MAX:
                    variants["small"] = (dict(small_max=10**9), True)
                for m in args.mchunk:
                    variants[f"medium_{m}"] = (dict(small_max=0, medium_max=10**9, mchunk=m), True)
                rec = dict(E=E, T=T, k=args.k, TK=T * args.k, block_m=bm, us={}, correct={})
                for name, (kw, exact) in variants.items():
                    ok = check(moe_align(ids[0], None, E, bm, **kw), want_rows, want_end, exact)
                    rec["correct"][name] = ok
                    ok_all &= ok
                    rec["us"][name] = graph_time_us(lambda i, kw=kw: moe_align(i, None, E, bm, **kw),
                                                    [(i,) for i in ids])
                records.append(rec)
                cells = "  ".join(f"{n} {u:6.1f}{'' if rec['correct'][n] else ' WRONG'}" for n, u in rec["us"].items())
                print(f"E={E:4d} TK={rec['TK']:6d}: {cells}  (us per call)", flush=True)
    result = dict(device=device_name(torch.device("cuda")), torch=torch.__version__, correct=ok_all, records=records)
    os.makedirs(args.out_dir, exist_ok=True)
    path = os.path.join(args.out_dir, "align_h200.json")
    with open(path, "w") as fh:
        json.dump(result, fh, indent=1)
    print(f"wrote {path}; every alignment correct: {ok_all}")
    if not ok_all:
        sys.exit(1)


if __name__ == "__main__":
    main()

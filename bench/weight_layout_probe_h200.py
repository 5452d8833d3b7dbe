"""Does the weights' layout limit the decode GEMMs' streaming rate? A probe on one H200.

The sorted decode GEMMs read a [BN, BK] weight tile per K step from row-major [N, K] expert
matrices: BN rows of BK bytes, K bytes apart. This times the same products (a few fp8 token rows
times BN weight rows, as the swapped kernels multiply them) over the same bytes stored two ways:
row-major, and pre-tiled so that each K step's tile is one contiguous BN * BK block and a
program's tiles follow each other ([E, N / BN, K / BK, BN, BK]). Shapes: Qwen3-30B-A3B's w13
(N = 1536, K = 2048) and w2 (N = 2048, K = 768) over the experts a decode step touches, and
Mixtral's w2. A copy of the same bytes gives the device's rate beside them.

    PYTHONPATH=src python bench/weight_layout_probe_h200.py [--set layout|features|stores|dead|evict] [--out FILE]
    TRITON_INTERPRET=1 ... --device cpu   (a dry run on tiny fp16 tensors)

Beyond the layout, --set times the sorted kernels' other features one at a time (VARIANT_SETS):
that is how the epilogue stores and their L2 policy came out as the cost (bench/NOTES-triton.md,
"What a decode GEMM could stream").
"""

import argparse
import json
import os
import time

import torch
import triton
import triton.language as tl

from moekit.benchmarks.gpu import capture_graph


@triton.jit
def stream_kernel(a_ptr, w_ptr, experts_ptr, out_ptr, y_ptr, N, K, USED,
                  BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, TILED: tl.constexpr,
                  SWAP: tl.constexpr, TWO: tl.constexpr, GROUP: tl.constexpr, MASK_A: tl.constexpr,
                  STORE: tl.constexpr, LIVE=0, SCAN: tl.constexpr = False, EVICT: tl.constexpr = 0):
    """The products of a decode GEMM over expert slots x column tiles, with the real kernels'
    features one by one: SWAP (weight rows on the MMA's 64-row side; else a [BM, BN] product,
    which converts fp8 weights for 16-row MMAs), TWO (gate rows n and up rows N / 2 + n: two
    products a step, as GEMM1 without gate_up), GROUP (programs ordered GROUP expert slots per
    column tile, as _grouped; else a slot's column tiles in a row), MASK_A (activation rows
    masked), STORE (the [BM, BN] result stored as bf16 rows; else one value a program)."""
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(N // (1 + TWO), BN)
    if LIVE > 0:  # programs past the live ones (a grid sized by a bound): find out and leave
        lanes = tl.arange(0, 256)
        ends = tl.load(experts_ptr + lanes, mask=lanes < USED, other=2**30)
        if (pid >= LIVE) | (tl.sum((ends <= pid // n_tiles).to(tl.int32), axis=0) > 100000):
            return
    if GROUP > 1:
        per_group = GROUP * n_tiles
        g = pid // per_group
        first = g * GROUP
        size = tl.minimum(USED - first, GROUP)
        slot = first + (pid % per_group) % size
        nt = (pid % per_group) // size
    else:
        slot = pid // n_tiles
        nt = pid % n_tiles
    if SCAN:  # the expert found by a comparison over 256 lanes, as _block_expert does
        lanes = tl.arange(0, 256)
        ends = tl.load(experts_ptr + lanes, mask=lanes < USED, other=2**30)
        e = (tl.sum((ends <= slot).to(tl.int32), axis=0) * 0 + tl.load(experts_ptr + slot)).to(tl.int64)
    else:
        e = tl.load(experts_ptr + slot).to(tl.int64)
    rows = tl.arange(0, BN)
    ks = tl.arange(0, BK)
    base = w_ptr + e * N * K
    if TILED:  # [N / BN, K / BK, BN, BK]: each step's tile contiguous, a program's tiles in a row
        w_ptrs = base + nt * BN * K + rows[:, None] * BK + ks[None, :]
        up_ptrs = w_ptrs + (N // 2) * K
        step = BN * BK
    else:  # row-major [N, K]
        w_ptrs = base + (nt * BN + rows)[:, None] * K + ks[None, :]
        up_ptrs = w_ptrs + (N // 2) * K
        step = BK
    m = tl.arange(0, BM)
    a_ok = m < BM - (pid % 3)
    a_ptrs = a_ptr + m[None, :] * K + ks[:, None]
    acc = tl.zeros([BN, BM], dtype=tl.float32)
    acc_u = tl.zeros([BN, BM], dtype=tl.float32)
    acc_t = tl.zeros([BM, BN], dtype=tl.float32)
    acc_tu = tl.zeros([BM, BN], dtype=tl.float32)
    W_POLICY: tl.constexpr = "evict_first" if EVICT % 2 == 1 else ""
    Y_POLICY: tl.constexpr = "evict_last" if EVICT >= 2 else ""
    for k0 in range(0, K, BK):
        w = tl.load(w_ptrs, eviction_policy=W_POLICY)
        if TWO:
            wu = tl.load(up_ptrs, eviction_policy=W_POLICY)
        if MASK_A:
            a = tl.load(a_ptrs + k0, mask=a_ok[None, :], other=0.0)
        else:
            a = tl.load(a_ptrs + k0)
        if SWAP:
            acc = tl.dot(w, a, acc)
            if TWO:
                acc_u = tl.dot(wu, a, acc_u)
        else:
            acc_t = tl.dot(a.T, w.T, acc_t)
            if TWO:
                acc_tu = tl.dot(a.T, wu.T, acc_tu)
        w_ptrs += step
        up_ptrs += step
    if SWAP:
        res = acc.T + acc_u.T
    else:
        res = acc_t + acc_tu
    cols = tl.arange(0, BN)
    if STORE == 1:  # [BM, BN] rows, masked, in y's dtype
        y_ptrs = y_ptr + (pid * BM + m)[:, None].to(tl.int64) * BN + cols[None, :]
        tl.store(y_ptrs, res.to(y_ptr.dtype.element_ty), mask=a_ok[:, None], eviction_policy=Y_POLICY)
    elif STORE == 2:  # the swapped accumulator through transposed pointers (no transpose of the value)
        y_ptrs = y_ptr + (pid * BM + m)[None, :].to(tl.int64) * BN + cols[:, None]
        tl.store(y_ptrs, (acc + acc_u).to(y_ptr.dtype.element_ty), mask=a_ok[None, :])
    elif STORE == 3:  # one value a row: the bytes gone, the reduction kept
        tl.store(y_ptr + pid * BM + m, tl.sum(res, axis=1).to(y_ptr.dtype.element_ty), mask=a_ok)
    elif STORE == 4:  # as 1, no mask
        y_ptrs = y_ptr + (pid * BM + m)[:, None].to(tl.int64) * BN + cols[None, :]
        tl.store(y_ptrs, res.to(y_ptr.dtype.element_ty))
    elif STORE == 5:  # as 1, fp32 values into the bf16 rows' bytes (no cast)
        y_ptrs = y_ptr.to(tl.pointer_type(tl.float32)) + (pid * BM + m)[:, None].to(tl.int64) * (BN // 2) \
            + cols[None, :] % (BN // 2)
        tl.store(y_ptrs, res, mask=a_ok[:, None] & (cols < BN // 2)[None, :])
    else:
        tl.store(out_ptr + pid, tl.sum(tl.sum(res, axis=1), axis=0))


# Variant sets, each timed in one run (bench/results/h200-weight-layout-probe.json holds one run
# of each): (layout, weights, stream_kernel features).
_ROW = ("row-major", "w")
VARIANT_SETS = {
    # the layouts
    "layout": [_ROW + ({},), ("tiled", "t", {})],
    # the real kernels' features one at a time, then together (GEMM1 at M = 16 runs two unswapped
    # products with grouped programs and masked rows; GEMM2 swapped, storing rows)
    "features": [_ROW + ({},), ("tiled", "t", {}), _ROW + ({"GROUP": 8},), _ROW + ({"SWAP": False},),
                 _ROW + ({"TWO": True},), _ROW + ({"MASK_A": True},), _ROW + ({"STORE": 1},),
                 _ROW + ({"SWAP": False, "TWO": True, "GROUP": 8, "MASK_A": True, "STORE": 1},),
                 _ROW + ({"TWO": True, "GROUP": 8, "MASK_A": True, "STORE": 1},)],
    # the result tiles' stores: layouts, masks, dtypes, a reduced store
    "stores": [_ROW + ({},)] + [_ROW + ({"STORE": s},) for s in (1, 2, 3, 4, 5)]
              + [_ROW + ({"SWAP": False, "STORE": 1},), _ROW + ({"SWAP": False, "STORE": 4},)],
    # programs past the live ones (DEAD row blocks), the 256-lane expert scan
    "dead": [_ROW + ({},), _ROW + ({"SCAN": True},), _ROW + ({"DEAD": 46},),
             _ROW + ({"DEAD": 46, "SCAN": True, "STORE": 1},), _ROW + ({"STORE": 1},)],
    # L2 eviction policies: evict-first weights (EVICT 1), evict-last result rows (2), both (3)
    "evict": [_ROW + ({},), _ROW + ({"STORE": 1},), _ROW + ({"EVICT": 1},), _ROW + ({"STORE": 1, "EVICT": 1},),
              _ROW + ({"STORE": 1, "EVICT": 2},), _ROW + ({"STORE": 1, "EVICT": 3},)],
    # slots with repeated experts (DUP_CASES: one slot per assignment, as a path without the
    # sort would run): do programs reading one expert at about the same time share its lines in
    # L2? GROUP slots per column tile run side by side.
    "dups": [_ROW + ({"GROUP": g},) for g in (1, 8, 32, 128)],
}

# (name, E, N, K, tokens, top_k, order): the slots of `tokens` tokens' top_k experts, by token
# ("token") or sorted by expert ("expert"), or the distinct experts only ("distinct").
DUP_CASES = [(f"qwen3 {w} m{t} {order}", 128, n, kk, t, 8, order)
             for w, n, kk in (("w13", 1536, 2048), ("w2", 2048, 768))
             for t in (8, 16) for order in ("distinct", "token", "expert")]


def tiled(w: torch.Tensor, BN: int, BK: int) -> torch.Tensor:
    E, N, K = w.shape
    return w.view(E, N // BN, BN, K // BK, BK).permute(0, 1, 3, 2, 4).contiguous()


def time_us(fn, reps: int) -> float:
    """Best of 5 replays of a CUDA graph of reps calls of fn, us per call (CPU: one call's wall time)."""
    if not torch.cuda.is_available():
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e6
    g = capture_graph(fn, [()] * reps)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(5):
        start.record()
        g.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / reps)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--set", choices=sorted(VARIANT_SETS), default="evict", help="which variants to time")
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "weight-layout-probe.json"))
    args = p.parse_args()
    cuda = args.device == "cuda"
    dev = torch.device(args.device)
    wdtype = torch.float8_e4m3fn if cuda else torch.float16
    cases = ([("qwen3 w13", 128, 1536, 2048, 82), ("qwen3 w2", 128, 2048, 768, 82),
              ("qwen3 w2", 128, 2048, 768, 128)]
             if cuda else [("tiny", 4, 256, 256, 3)])
    if args.set == "dups":
        cases = DUP_CASES if cuda else [("tiny m3 token", 4, 256, 256, 3, 2, "token")]
    tiles = [(64, 128, 4, 4)] if cuda else [(64, 128, 4, 2)]
    variants = VARIANT_SETS[args.set]
    rows = []
    for name, E, N, K, *pick in cases:
        # Several copies of the experts, used in turn, so no replay finds its weights in L2.
        copies = 4 if cuda else 1
        ws = [(torch.randn(E, N, K, device=dev) * 0.1).to(wdtype) for _ in range(copies)]
        gen = torch.Generator(device=dev).manual_seed(0)
        if len(pick) == 1:
            used = pick[0]
            experts = torch.randperm(E, device=dev, generator=gen)[:used].to(torch.int32)
            distinct = used
        else:
            tokens, top_k, order = pick
            ids = torch.stack([torch.randperm(E, device=dev, generator=gen)[:top_k] for _ in range(tokens)]).view(-1)
            uniq = torch.unique(ids)
            experts = (uniq if order == "distinct" else ids.sort().values if order == "expert" else ids)
            experts = experts.to(torch.int32).contiguous()
            used, distinct = experts.numel(), uniq.numel()
        nbytes = distinct * N * K * ws[0].element_size()
        a = (torch.randn(16, K, device=dev) * 0.1).to(wdtype)
        flat = [w.view(-1) for w in ws]
        dst = torch.empty_like(flat[0][: distinct * N * K])
        copy_us = time_us(lambda: [dst.copy_(f[: distinct * N * K]) for f in flat], 8) / copies
        rows.append({"case": name, "E": E, "N": N, "K": K, "experts": used, "distinct": distinct,
                     "MB": nbytes / 1e6, "layout": "copy",
                     "us": copy_us, "TBps": nbytes / copy_us / 1e6})
        print(f"{name:11s} {used:3d} experts copy {copy_us:8.1f} us {nbytes / copy_us / 1e6:5.2f} TB/s", flush=True)
        for BN, BK, warps, stages in tiles:
            if N % BN or K % BK:
                continue
            # the pre-tiled copies only for the sets that time them
            tiled_ws = [tiled(w, BN, BK) for w in ws] if any(v[1] == "t" for v in variants) else None
            res = {}
            for layout, src, feats in variants:
                feats = dict(feats)
                live = used * (N // BN // (2 if feats.get("TWO") else 1))
                grid = live + feats.pop("DEAD", 0) * (N // BN // (2 if feats.get("TWO") else 1))
                if grid > live:
                    feats = dict(feats, LIVE=live)
                out = torch.empty(grid, device=dev)
                y = torch.empty(grid * 16, BN, dtype=torch.bfloat16 if cuda else torch.float16, device=dev)
                flags = {**dict(SWAP=True, TWO=False, GROUP=1, MASK_A=False, STORE=0), **feats}
                srcs = ws if src == "w" else tiled_ws

                def call(srcs=srcs, flags=flags, grid=grid, out=out, y=y, layout=layout):
                    for w in srcs:
                        stream_kernel[(grid,)](a, w, experts, out, y, N, K, used, BM=16, BN=BN, BK=BK,
                                               TILED=layout == "tiled", num_warps=warps, num_stages=stages, **flags)
                us = time_us(call, 8) / copies
                label = f"{layout}" + "".join(f" {k.lower()}={v}" for k, v in feats.items())
                res[label] = out.clone()
                rows.append({"case": name, "E": E, "N": N, "K": K, "experts": used, "distinct": distinct,
                             "MB": nbytes / 1e6, "layout": layout, "features": flags, "BN": BN, "BK": BK, "num_warps": warps,
                             "num_stages": stages, "us": us, "TBps": nbytes / us / 1e6})
                print(f"{name:11s} {used:3d} experts {label:40s} {BN}x{BK} w{warps} s{stages} {us:8.1f} us "
                      f"{nbytes / us / 1e6:5.2f} TB/s", flush=True)
            if "tiled" in res and "row-major" in res:
                assert torch.allclose(res["tiled"], res["row-major"], rtol=1e-3, atol=1e-2), "layouts disagree"
        del ws
    with open(args.out, "w") as f:
        json.dump({"benchmark": "weight-layout-probe", "device": torch.cuda.get_device_name() if cuda else "cpu",
                   "torch": torch.__version__, "triton": triton.__version__,
                   "timing": "CUDA graph of 8 passes over 4 copies of the weights, best of 5 replays, us per pass",
                   "set": args.set,
                   "rows": rows}, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

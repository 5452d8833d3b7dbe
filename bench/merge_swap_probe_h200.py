"""Probe: an expert's short last rows multiplied as a swapped product inside its previous tile.

At M = 4096 the prefill GEMMs pad each expert's rows to whole 128-row tiles: Qwen3-30B-A3B has
about 256 +- 16 rows an expert, so half its experts run a third tile for a few rows (1.25 rows
multiplied an assignment), DeepSeek-V3 about 128 +- 11 (1.49). Merged tiles with a second
128- or 64-row accumulator spilled and lost (NOTES, "Merged tiles"). Here the tail of TT rows
(16 / 32 / 64) rides on the expert's last full tile as a swapped product: the tile's weight
block [2 BN, BK] (already in shared memory for the main product) times the tail's rows
transposed [BK, TT], a [2 BN, TT] accumulator (16-32 registers a thread, not 64-128).

Each expert here has TPE full tiles, plus a tail of TT rows on its last tile (merged) or none.
Times per variant (CUDA events, median of rounds), against the plain kernel with TPE and TPE + 1
tiles an expert: merged pays when it costs much less than the extra tile.

    python bench/merge_swap_probe_h200.py --out results.json        # on the H200
    TRITON_INTERPRET=1 python bench/merge_swap_probe_h200.py --check  # tiny, against torch
"""

import argparse
import json

import torch
import triton
import triton.language as tl

from moekit.benchmarks.gpu import eager_time_us


@triton.jit
def _silu_mul(g, u):
    return g / (1.0 + tl.exp(-g)) * u


@triton.jit
def _weight_block(w_desc, e, n0, k0, N, WR: tl.constexpr, BK: tl.constexpr, GATED: tl.constexpr):
    """Expert e's [WR, BK] weight block at column n0 (gated: its gate and up rows), K offset k0."""
    if GATED:
        return w_desc.load([2 * e, n0, k0]).reshape([WR, BK])
    return w_desc.load([e * N + n0, k0])


@triton.jit
def probe_kernel(x_ptr, w_ptr, out_ptr, E, N, K, TPE, PROGRAMS,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, TT: tl.constexpr, GROUP_M: tl.constexpr,
                 GATED: tl.constexpr, MERGE: tl.constexpr):
    """out rows of every expert: x [E * (TPE * BM + TT), K]; GATED: w [E, 2N, K] (silu(gate) * up
    out [.., N]); else w [E, N, K] (out = x w^T). With MERGE the tail's TT rows ride on the
    expert's last tile as a swapped product; without, TT must be 0."""
    stride_e = TPE * BM + TT
    R = E * stride_e
    WR: tl.constexpr = 2 * BN if GATED else BN
    x_desc = tl.make_tensor_descriptor(x_ptr, shape=[R, K], strides=[K, 1], block_shape=[BM, BK])
    if MERGE:
        t_desc = tl.make_tensor_descriptor(x_ptr, shape=[R, K], strides=[K, 1], block_shape=[TT, BK])
    if GATED:
        w_desc = tl.make_tensor_descriptor(w_ptr, shape=[E * 2, N, K], strides=[N * K, K, 1], block_shape=[2, BN, BK])
    else:
        w_desc = tl.make_tensor_descriptor(w_ptr, shape=[E * N, K], strides=[K, 1], block_shape=[BN, BK])
    num_m = E * TPE
    num_n = tl.cdiv(N, BN)
    for t in tl.range(tl.program_id(0), num_m * num_n, PROGRAMS):
        per_group = GROUP_M * num_n
        first_m = (t // per_group) * GROUP_M
        group_rows = tl.minimum(num_m - first_m, GROUP_M)
        m = first_m + (t % per_group) % group_rows
        nt = (t % per_group) // group_rows
        e = m // TPE
        j = m % TPE
        row0 = e * stride_e + j * BM
        n0 = nt * BN
        r = tl.arange(0, BM)
        cols = n0 + tl.arange(0, BN)
        acc = tl.zeros([BM, WR], dtype=tl.float32)
        if MERGE and j == TPE - 1:
            acc_t = tl.zeros([WR, TT], dtype=tl.float32)
            for k0 in range(0, K, BK):
                b = _weight_block(w_desc, e, n0, k0, N, WR, BK, GATED)
                acc = tl.dot(x_desc.load([row0, k0]), b.T, acc)
                acc_t = tl.dot(b, t_desc.load([row0 + BM, k0]).T, acc_t)
            if GATED:
                g_t, u_t = acc_t.reshape([2, BN, TT]).permute(1, 2, 0).split()
                h_t = _silu_mul(g_t, u_t)
            else:
                h_t = acc_t
            rt = row0 + BM + tl.arange(0, TT)
            tl.store(out_ptr + rt.to(tl.int64)[:, None] * N + cols[None, :], h_t.T.to(out_ptr.dtype.element_ty),
                     mask=(cols < N)[None, :])
        else:
            for k0 in range(0, K, BK):
                acc = tl.dot(x_desc.load([row0, k0]), _weight_block(w_desc, e, n0, k0, N, WR, BK, GATED).T, acc)
        if GATED:
            g, u = acc.reshape([BM, 2, BN]).permute(0, 2, 1).split()
            h = _silu_mul(g, u)
        else:
            h = acc
        tl.store(out_ptr + (row0 + r).to(tl.int64)[:, None] * N + cols[None, :], h.to(out_ptr.dtype.element_ty),
                 mask=(cols < N)[None, :])


def _alloc(size, alignment, stream):
    return torch.empty(size, dtype=torch.int8, device="cuda" if torch.cuda.is_available() else "cpu")


def run(x, w, E, N, K, TPE, BM, BN, BK, TT, merge, gated, warps, stages, programs):
    R = x.shape[0]
    out = torch.empty(R, N, dtype=x.dtype, device=x.device)
    probe_kernel[(programs,)](x, w, out, E, N, K, TPE, programs, BM=BM, BN=BN, BK=BK, TT=TT, GROUP_M=8,
                              GATED=gated, MERGE=merge, num_warps=warps, num_stages=stages)
    return out


def reference(x, w, E, N, TPE, BM, TT, gated):
    per = TPE * BM + TT
    outs = []
    for e in range(E):
        xe = x[e * per:(e + 1) * per].float()
        p = xe @ w[e].float().T
        outs.append(torch.nn.functional.silu(p[:, :N]) * p[:, N:] if gated else p)
    return torch.cat(outs)


def check():
    triton.set_allocator(_alloc)
    torch.manual_seed(0)
    dt = torch.float32
    for gated in (True, False):
        E, N, K, BM, BN, BK = 3, 48, 64, 32, 16, 32
        for TPE, TT in ((2, 16), (1, 16), (2, 0)):
            x = torch.randn(E * (TPE * BM + TT), K, dtype=dt)
            w = torch.randn(E, 2 * N if gated else N, K, dtype=dt)
            out = run(x, w, E, N, K, TPE, BM, BN, BK, TT, TT > 0, gated, 4, 2, 4)
            ref = reference(x, w, E, N, TPE, BM, TT, gated)
            err = (out.float() - ref).abs().max().item()
            print(f"gated={gated} TPE={TPE} TT={TT}: max err {err:.2e}")
            assert err < 1e-3 * ref.abs().max().item()


SHAPES = {  # name: E, H, I, full tiles an expert with a tail (the common case at M = 4096)
    "qwen3-30b-a3b": (128, 2048, 768, 2),
    "deepseek-v3": (256, 7168, 2048, 1),
}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--check", action="store_true")
    p.add_argument("--out")
    p.add_argument("--shapes", default="qwen3-30b-a3b,deepseek-v3")
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args()
    if args.check:
        check()
        return
    triton.set_allocator(_alloc)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    records = []
    for name in args.shapes.split(","):
        E, H, I, TPE = SHAPES[name]
        torch.manual_seed(0)
        for gemm, gated, N, K in (("gemm1", True, I, H), ("gemm2", False, H, I)):
            w = (torch.randn(E, 2 * N if gated else N, K, device="cuda") * K ** -0.5).to(torch.bfloat16)
            tiles = [(128, 128, 64, 8, 3), (128, 128, 64, 8, 4), (128, 64, 64, 4, 3)] if gated else \
                [(128, 256, 64, 8, 3), (128, 128, 64, 8, 3), (128, 128, 64, 4, 4)]
            for BM, BN, BK, warps, stages in tiles:
                row = dict(shape=name, gemm=gemm, BM=BM, BN=BN, BK=BK, warps=warps, stages=stages, TPE=TPE, us={})
                variants = [("plain", TPE, 0, False), ("plain+1", TPE + 1, 0, False)] + \
                           [(f"merged{tt}", TPE, tt, True) for tt in (16, 32, 64)]
                xs = {}
                for tag, tpe, tt, merge in variants:
                    x = torch.randn(E * (tpe * BM + tt), K, device="cuda").to(torch.bfloat16)
                    xs[tag] = x
                    try:
                        out = run(x, w, E, N, K, tpe, BM, BN, BK, tt, merge, gated, warps, stages, sms)
                        ref = reference(x[: 2 * (tpe * BM + tt)], w[:2], 2, N, tpe, BM, tt, gated)
                        err = (out[: ref.shape[0]].float() - ref).abs().max().item() / ref.abs().max().item()
                        row.setdefault("rel_err", {})[tag] = err
                        row["us"][tag] = eager_time_us(lambda *_: run(x, w, E, N, K, tpe, BM, BN, BK, tt, merge,
                                                                      gated, warps, stages, sms), [()] * 5,
                                                       replays=args.rounds)
                    except Exception as exc:  # noqa: BLE001 (a variant that fails to compile is reported)
                        row.setdefault("errors", {})[tag] = f"{type(exc).__name__}: {str(exc)[:300]}"
                    torch.cuda.empty_cache()
                # interleaved second pass, so clocks drift into both
                for tag, tpe, tt, merge in variants:
                    if tag in row["us"]:
                        x = xs[tag]
                        t2 = eager_time_us(lambda *_: run(x, w, E, N, K, tpe, BM, BN, BK, tt, merge, gated, warps,
                                                          stages, sms), [()] * 5, replays=args.rounds)
                        row["us"][tag] = min(row["us"][tag], t2)
                del xs
                base = row["us"].get("plain")
                if base:
                    row["ratio_to_plain"] = {k: round(v / base, 3) for k, v in row["us"].items()}
                print(json.dumps(row), flush=True)
                records.append(row)
            del w
            torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"records": records, "device": torch.cuda.get_device_name(0),
                       "torch": torch.__version__, "triton": triton.__version__}, f, indent=1)


if __name__ == "__main__":
    main()

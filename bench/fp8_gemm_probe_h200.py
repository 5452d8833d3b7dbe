"""How fast Triton multiplies fp8 on one H200 with the scale layouts of moekit's schemes: a
dense persistent TMA GEMM (C = A B^T, A [M, K], B [N, K]) in bf16, fp8 with no scale, fp8
with per-tensor scales applied after the K loop, and fp8 with 128 x 128 weight blocks and
1 x 128 activation groups promoted into the fp32 accumulator every K tile of 128.

    PYTHONPATH=src python bench/fp8_gemm_probe_h200.py [--out FILE]

It answers one question before the prefill kernels take fp8: what fraction of the fp8 rate a
block-scaled product keeps in Triton, at the GEMM shapes of DeepSeek-V3 and Qwen3-30B-A3B.
`--device cpu` checks the kernel under TRITON_INTERPRET=1 on fp16 stand-ins.
"""

import argparse
import json
import os
import sys
import time

import torch
import triton
import triton.language as tl


@triton.jit
def _tile_of(t, num_m, num_n, GROUP_M: tl.constexpr):
    per_group = GROUP_M * num_n
    first_m = (t // per_group) * GROUP_M
    rows_g = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (t % per_group) % rows_g, (t % per_group) // rows_g


@triton.jit
def probe_kernel(a_ptr, b_ptr, c_ptr, as_ptr, bs_ptr, idx_ptr, M, N, K, PROGRAMS,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, MODE: tl.constexpr, GROUP_M: tl.constexpr,
                 WS: tl.constexpr, IDX: tl.constexpr):
    """MODE 0: plain; 1: one scale for A and one for B after the loop; 2: per K tile of 128,
    a scale per A row and one per 128 x 128 block of B, promoted into the accumulator. WS:
    Triton's Hopper warp specialization of the tile loop (a producer warpgroup of TMA loads,
    two consumer warpgroups). IDX: C's rows are stored at rows read from idx (an identity
    index), not at rows computed from the tile's first row."""
    a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[K, 1], block_shape=[BM, BK])
    b_desc = tl.make_tensor_descriptor(b_ptr, shape=[N, K], strides=[K, 1], block_shape=[BN, BK])
    KT = tl.cdiv(K, BK)
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(N, BN)
    for t in tl.range(tl.program_id(0), num_m * num_n, PROGRAMS, warp_specialize=WS):
        pm, pn = _tile_of(t, num_m, num_n, GROUP_M)
        rm = pm * BM + tl.arange(0, BM)
        rn = pn * BN + tl.arange(0, BN)
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        for kt in range(0, KT):
            a = a_desc.load([pm * BM, kt * BK])
            b = b_desc.load([pn * BN, kt * BK])
            if MODE == 2:
                a_s = tl.load(as_ptr + rm * KT + kt, mask=rm < M, other=0.0)
                b_s = tl.load(bs_ptr + (rn // 128) * KT + kt, mask=rn < N, other=0.0)
                acc += tl.dot(a, b.T) * (a_s[:, None] * b_s[None, :])
            else:
                acc = tl.dot(a, b.T, acc)
        if MODE == 1:
            acc = acc * (tl.load(as_ptr) * tl.load(bs_ptr))
        if IDX:
            rows = tl.load(idx_ptr + rm, mask=rm < M, other=0)
        else:
            rows = rm
        tl.store(c_ptr + rows[:, None] * N + rn[None, :], acc.to(c_ptr.dtype.element_ty),
                 mask=(rm < M)[:, None] & (rn < N)[None, :])


def run(a, b, a_s, b_s, mode, bm, bn, bk, warps, stages, ws, programs, idx=None):
    M, K = a.shape
    N = b.shape[0]
    c = torch.empty(M, N, dtype=torch.bfloat16 if a.is_cuda else torch.float32, device=a.device)
    p = min(programs, triton.cdiv(M, bm) * triton.cdiv(N, bn))
    probe_kernel[(p,)](a, b, c, a_s, b_s, idx if idx is not None else a_s, M, N, K, p, BM=bm, BN=bn, BK=bk, MODE=mode,
                       GROUP_M=8, WS=ws, IDX=idx is not None,
                       num_warps=warps, num_stages=stages)
    return c


def reference(a, b, a_s, b_s, mode):
    af, bf = a.float(), b.float()
    if mode == 2:
        KT = a_s.shape[1]
        af = af * a_s.repeat_interleave(128, 1)[:, :a.shape[1]]
        bf = bf * b_s.repeat_interleave(128, 0)[:b.shape[0]].repeat_interleave(128, 1)[:, :a.shape[1]]
        assert KT == triton.cdiv(a.shape[1], 128)
    out = af @ bf.T
    if mode == 1:
        out = out * (a_s[0] * b_s[0])
    return out


def operands(M, N, K, mode, dtype, device):
    a = torch.randn(M, K, device=device).to(dtype)
    b = torch.randn(N, K, device=device).mul(0.05).to(dtype)
    KT = triton.cdiv(K, 128)
    if mode == 2:
        a_s = torch.rand(M, KT, device=device) + 0.5
        b_s = torch.rand(triton.cdiv(N, 128), KT, device=device) + 0.5
    else:
        a_s = torch.rand(1, device=device) + 0.5
        b_s = torch.rand(1, device=device) + 0.5
    return a, b, a_s.contiguous(), b_s.contiguous()


TILES = [  # BM, BN, BK, warps, stages, warp-specialized (4 warps: a producer and two consumer warpgroups)
    (128, 128, 128, 8, 4, False), (128, 256, 128, 8, 3, False), (256, 128, 128, 8, 3, False),
    (128, 128, 128, 4, 3, True), (128, 128, 128, 4, 4, True), (128, 256, 128, 4, 3, True),
    (128, 128, 64, 8, 4, False), (128, 256, 64, 8, 4, False), (128, 256, 64, 4, 4, True),
]
SHAPES = {  # name: M, N, K (DeepSeek-V3 / Qwen3 per-expert GEMMs at 16384 tokens, experts stacked)
    "dsv3-gemm1": (8192, 4096, 7168), "dsv3-gemm2": (8192, 7168, 2048),
    "qwen3-gemm1": (16384, 1536, 2048), "qwen3-gemm2": (16384, 2048, 768),
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "fp8_probe.json"))
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    dev = torch.device(args.device)
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device=dev))
    if dev.type == "cpu":
        for mode in (0, 1, 2):
            a, b, a_s, b_s = operands(130, 260, 256, mode, torch.float16, dev)
            c = run(a, b, a_s, b_s, mode, 64, 128, 128, 4, 2, False, 3)
            err = (c - reference(a, b, a_s, b_s, mode)).abs().max().item()
            print("cpu mode", mode, "max err", err)
            assert err < 1e-2, err
        return
    fp8 = torch.float8_e4m3fn
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    results = []
    for name, (M, N, K) in SHAPES.items():
        flops = 2.0 * M * N * K
        for dtype, mode in ((torch.bfloat16, 0), (fp8, 0), (fp8, 1), (fp8, 2)):
            a, b, a_s, b_s = operands(M, N, K, mode, dtype, dev)
            ref = reference(a, b, a_s, b_s, mode)
            idx = torch.arange(M, dtype=torch.int32, device=dev)
            for (bm, bn, bk, w, s, ws), by_idx in [(t, i) for t in TILES for i in ((False, True) if t[5] else (False,))]:
                if (dtype == torch.bfloat16) != (bk == 64) or (mode == 2 and bk != 128):
                    continue
                rec = dict(shape=name, M=M, N=N, K=K, dtype=str(dtype), mode=mode, tile=[bm, bn, bk, w, s, ws],
                           rows_by_index=by_idx)
                call = (lambda bm=bm, bn=bn, bk=bk, w=w, s=s, ws=ws, by_idx=by_idx:
                        run(a, b, a_s, b_s, mode, bm, bn, bk, w, s, ws, sms, idx if by_idx else None))
                try:
                    c = call()
                    rec["rel_err"] = ((c.float() - ref).norm() / ref.norm()).item()
                    torch.cuda.synchronize()
                    for _ in range(3):
                        call()
                    ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    ts = []
                    for _ in range(10):
                        ev0.record()
                        call()
                        ev1.record()
                        torch.cuda.synchronize()
                        ts.append(ev0.elapsed_time(ev1) * 1e3)
                    ts.sort()
                    rec["us"] = ts[len(ts) // 2]
                    rec["tflops"] = flops / rec["us"] / 1e6
                except Exception as exc:  # noqa: BLE001 (a tile the compiler refuses is a result)
                    rec["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                results.append(rec)
                print(json.dumps(rec), flush=True)
    best = {}
    for r in results:
        if "tflops" in r and r["rel_err"] < 1e-2:
            key = f"{r['shape']} {r['dtype']} mode={r['mode']}"
            if key not in best or r["tflops"] > best[key]["tflops"]:
                best[key] = r
    for key, r in best.items():
        print(f"BEST {key}: {r['tflops']:.0f} TFLOP/s tile {r['tile']} err {r['rel_err']:.2e}")
    with open(args.out, "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(dev), torch=torch.__version__, triton=triton.__version__,
                       results=results, best=best), f, indent=1)


if __name__ == "__main__":
    sys.exit(main())

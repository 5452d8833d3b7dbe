"""The block-scaled fp8 GEMMs alone: moekit's CUDA kernels (kernels/hopper_block.py) against
cuBLAS (torch._scaled_mm, DeepSeek-V3's recipe) on the same rows, to tell the kernel's own pace
from what the layer around it costs.

Rows R = 131072 (DeepSeek-V3 at M = 16384, k = 8). Cases, for GEMM1 (N = 2I = 4096, K = H = 7168)
and GEMM2 (N = H = 7168, K = I = 2048):
  cuda E=1    one expert holding every row (a dense product through the MoE kernel)
  cuda E=256  256 experts of exactly 512 rows (uniform routing without its spread)
  cublas      one dense product of R rows (torch._scaled_mm)
Timed with CUDA events (--rounds interleaved rounds of --reps calls, medians; TFLOP/s), or with
--ncu one call of each between cudaProfilerStart / Stop (run under `ncu --profile-from-start off`).

    PYTHONPATH=src python bench/block_kernel_probe_h200.py [--rounds 3] [--out FILE] [--ncu]
"""

import argparse
import json
import statistics

import torch

from moekit.kernels import hopper_block
from scaled_mm_block_probe_h200 import quant_groups, time_ms  # a sibling script

FP8 = torch.float8_e4m3fn
R, H, I = 131072, 7168, 2048


def quant_blocks(w):
    """w [E, N, K] -> fp8, scales [E, N/128, K/128]."""
    E, N, K = w.shape
    b = w.view(E, N // 128, 128, K // 128, 128)
    s = b.abs().amax(dim=(2, 4)).clamp_min(1e-12) / 448.0
    return (b / s[:, :, None, :, None]).to(FP8).view(E, N, K), s.contiguous()


def rows_fp8(K):
    out_q, out_s = torch.empty(R, K, dtype=FP8, device="cuda"), torch.empty(R, K // 128, device="cuda")
    for r0 in range(0, R, 16384):
        out_q[r0:r0 + 16384], out_s[r0:r0 + 16384] = quant_groups(torch.randn(16384, K, device="cuda"))
    return out_q, out_s


def weights(E, N, K):
    q, s = [], []
    for e0 in range(0, E, 16):
        qq, ss = quant_blocks(torch.randn(min(16, E - e0), N, K, device="cuda") * K ** -0.5)
        q.append(qq)
        s.append(ss)
    return torch.cat(q), torch.cat(s)


def cases():
    a1, a1_s = rows_fp8(H)
    a2, a2_s = rows_fp8(I)
    act = torch.empty(R, I, dtype=torch.bfloat16, device="cuda")
    y = torch.empty(R, H, dtype=torch.bfloat16, device="cuda")
    ids = torch.arange(R, dtype=torch.int32, device="cuda")
    tw = torch.ones(R, device="cuda")
    out = {}
    for E in (1, 256):
        ends = torch.arange(1, E + 1, dtype=torch.int32, device="cuda") * (R // E)
        w13, w13_s = weights(E, 2 * I, H)
        w2, w2_s = weights(E, H, I)
        out[f"gemm1 cuda E={E}"] = (2 * R * 2 * I * H,
                                    lambda w13=w13, w13_s=w13_s, ends=ends: hopper_block.gemm1(a1, a1_s, w13, w13_s,
                                                                                               act, ends))
        out[f"gemm2 cuda E={E}"] = (2 * R * H * I,
                                    lambda w2=w2, w2_s=w2_s, ends=ends: hopper_block.gemm2(a2, a2_s, w2, w2_s, y, tw,
                                                                                           ids, ends))
        if E == 1:
            sa1, sa2 = a1_s.t().contiguous().t(), a2_s.t().contiguous().t()  # M-major, as cuBLAS asks
            o1 = torch.empty(R, 2 * I, dtype=torch.bfloat16, device="cuda")
            o2 = torch.empty(R, H, dtype=torch.bfloat16, device="cuda")
            out["gemm1 cublas"] = (2 * R * 2 * I * H, lambda w=w13[0], s=w13_s[0]: torch.ops.aten._scaled_mm.out(
                a1, w.t(), sa1, s.t(), out_dtype=torch.bfloat16, out=o1))
            out["gemm2 cublas"] = (2 * R * H * I, lambda w=w2[0], s=w2_s[0]: torch.ops.aten._scaled_mm.out(
                a2, w.t(), sa2, s.t(), out_dtype=torch.bfloat16, out=o2))
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--ncu", action="store_true")
    p.add_argument("--only", default="", help="comma-separated case names (default: all)")
    p.add_argument("--group-m", default="8", help="comma-separated row tiles a column group for the CUDA cases")
    p.add_argument("--stages", default="5", help="comma-separated GEMM1 ring stages for the CUDA cases (5, 6)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    print("hopper_block:", hopper_block.status(), flush=True)
    torch.manual_seed(0)
    cs = cases()
    if args.only:
        cs = {k: v for k, v in cs.items() if k in args.only.split(",")}
    for _, fn in cs.values():
        fn()
    torch.cuda.synchronize()
    if args.ncu:
        cudart = torch.cuda.cudart()
        for name, (_, fn) in cs.items():
            torch.cuda.nvtx.range_push(name)
            cudart.cudaProfilerStart()
            fn()
            torch.cuda.synchronize()
            cudart.cudaProfilerStop()
            torch.cuda.nvtx.range_pop()
        return
    lib = hopper_block.load()
    settings = [(int(g), int(st)) for g in args.group_m.split(",") for st in args.stages.split(",")]
    timed = {}
    for name, (flop, fn) in cs.items():
        for g in (settings if "cuda" in name else [None]):
            if g is not None and g[1] != 5 and "gemm2" in name:
                continue
            timed[name if g is None else f"{name} group_m={g[0]} stages={g[1]}"] = (flop, fn, g)
    res = {name: [] for name in timed}
    for _ in range(args.rounds):
        for name, (_, fn, g) in timed.items():
            if g is not None:
                lib.moekit_block_set_group_m(g[0])
                lib.moekit_block_set_stages(g[1])
            res[name].append(time_ms(fn, args.reps))
    lib.moekit_block_set_group_m(8)
    lib.moekit_block_set_stages(5)
    rows = []
    for name, (flop, _, _) in timed.items():
        ms = statistics.median(res[name])
        rows.append({"case": name, "ms": round(ms, 4), "TFLOPs": round(flop / ms / 1e9, 1),
                     "rounds_ms": [round(t, 4) for t in res[name]]})
        print(f"{name:18s} {ms:8.3f} ms {flop / ms / 1e9:8.1f} TFLOP/s", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "R": R, "H": H, "I": I,
                       "variant": {"CLUSTER": hopper_block.CLUSTER, "PIPELINED": hopper_block.PIPELINED},
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

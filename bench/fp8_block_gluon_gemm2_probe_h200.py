"""The block-scaled fp8 GEMM2 of the layer on the Gluon schedule of fp8_block_gluon_probe_h200.py.

The dense probe kept one product in flight while it promoted the previous one and beat
Triton's promoted products by 1.25x at DeepSeek-V3's shapes (bench/NOTES-triton.md). This is
the same K loop over the layer's sorted rows: GEMM2 of the "fp8_w8a8_block128" scheme,

    y[a, :] = w[a] * sum over K blocks kb of (a2[row] . w2[e]^T)[kb] * a2_s[row, kb] * w2_s[e, n / 128, kb],

for the rows of expert e's tiles (moekit's alignment), a2 [R, I] fp8 with a scale per row and
128 columns (moekit's quantize_rows), w2 [E, H, I] fp8 with a scale per 128 x 128 block
(moekit's quantize_experts), y [T * k, H] bf16 stored at each row's assignment. One program per
SM walks its (row tile, column tile) items as one flat sequence of K steps through a ring of
NUM_BUF stages; an item's expert comes from the padded expert ends (the schedule of the Gluon
GEMM2 at commit 98e72fb, validated on the H200 then).

    PYTHONPATH=src python bench/fp8_block_gluon_gemm2_probe_h200.py [--out FILE]   # on the H200
    PYTHONPATH=src python bench/fp8_block_gluon_gemm2_probe_h200.py --sass DIR      # compile here
    TRITON_INTERPRET=1 PYTHONPATH=src python bench/fp8_block_gluon_gemm2_probe_h200.py --check

On the H200: each point's y against an fp32 dequantized reference (per expert, in torch), run to
run bits, and its time next to the GEMM2 the layer runs at the same point, profiled through the
layer (profile_h200.py). --sass compiles moekit's Gluon GEMM1 and GEMM2 for sm_90a without a GPU.
The kernel is moekit's (kernels/gluon_block.py), which the layer runs under QuantKnobs.gluon.
"""

import argparse
import json
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from moekit.benchmarks.gpu import routing_sets, shape_by_name  # noqa: E402

import fp8_block_gluon_probe_h200 as dense  # noqa: E402 (compile report and measurement)
from moekit.kernels import gluon_block  # noqa: E402 (the layer's Gluon kernels)

GLUON = gluon_block.GLUON_MISSING


def gemm2(a2, a2_s, w2, w2_s, topk_weights, sorted_ids, expert_end, TK, BM, programs):
    """y [TK, H] bf16 of the layer's GEMM2 on moekit's Gluon kernel (rows of assignments without an
    expert are not written)."""
    y = torch.empty(TK, w2.shape[1], dtype=torch.bfloat16, device=a2.device)
    gluon_block.gemm2(a2, a2_s, w2, w2_s, y, topk_weights, sorted_ids, expert_end, BM, programs)
    return y


def problem(name, M, device):
    """The layer's GEMM2 operands at a point: sorted rows of random routing (moekit's alignment in
    128-row blocks), act quantized per row and 128 columns, w2 per 128 x 128 block."""
    from moekit.kernels.launch import moe_align  # noqa: PLC0415
    from moekit.kernels.quant_rows import quantize_rows  # noqa: PLC0415
    from moekit.quant import get_scheme, quantize_experts  # noqa: PLC0415

    _, E, k, H, I = shape_by_name(name)
    scheme = get_scheme("fp8_w8a8_block128")
    _, w, ids = routing_sets(M, E, k, H, 1, torch.bfloat16, device)[0]
    al = moe_align(ids, None, E, 128)
    R = al.max_blocks * al.block_m
    act = torch.randn(R, I, device=device).to(torch.bfloat16)
    a2, a2_s = quantize_rows(act, scheme, expert_end=al.expert_end)
    q = quantize_experts(torch.randn(E, 2 * 128, H, device=device) * H ** -0.5,
                         torch.randn(E, H, I, device=device) * I ** -0.5, scheme)
    return dict(a2=a2, a2_s=a2_s, w2=q.w2, w2_s=q.scales["w2_scale"], w=w, ids=ids, al=al, E=E, k=k, H=H, I=I)


def reference(p):
    """y [TK, H] fp32 from dequantized operands, expert by expert (rows of no expert stay 0)."""
    al, a2, w2 = p["al"], p["a2"], p["w2"]
    TK, H = p["ids"].numel(), p["H"]
    a = a2.float() * p["a2_s"].repeat_interleave(128, 1)
    ws = p["w2_s"].repeat_interleave(128, 1).repeat_interleave(128, 2)
    y = torch.zeros(TK, H, device=a2.device)
    ends = [0] + al.expert_end.tolist()
    rows_ids = al.sorted_ids.long()
    for e in range(p["E"]):
        r = torch.arange(ends[e], ends[e + 1], device=a2.device)
        assign = rows_ids[r]
        live = assign < TK
        if live.any():
            prod = a[r[live]] @ (w2[e].float() * ws[e]).T
            y[assign[live]] = prod * p["w"].reshape(-1)[assign[live]][:, None]
    return y


def check():
    """On CPU (TRITON_INTERPRET=1 for moekit's alignment and row quantization): reference() on a
    tiny problem against a row-by-row dequantized product, and every assignment's row written."""
    global shape_by_name
    real = shape_by_name
    shape_by_name = lambda name: (name, 4, 2, 256, 256)  # noqa: E731 (E, k, H, I)
    try:
        p = problem("tiny", 40, torch.device("cpu"))
    finally:
        shape_by_name = real
    ref = reference(p)
    a = p["a2"].float() * p["a2_s"].repeat_interleave(128, 1)
    ws = p["w2_s"].repeat_interleave(128, 1).repeat_interleave(128, 2)
    TK = p["ids"].numel()
    rows = p["al"].sorted_ids.long()
    y = torch.zeros_like(ref)
    for row in range(int(p["al"].expert_end[-1])):
        a_i = int(rows[row])
        if a_i < TK:
            e = int(p["ids"].reshape(-1)[a_i])
            y[a_i] = (a[row] @ (p["w2"][e].float() * ws[e]).T) * p["w"].reshape(-1)[a_i]
    err = (y - ref).abs().max().item()
    print(f"reference: max diff {err:.2e}, rows written {int((ref.abs().sum(1) > 0).sum())} of {TK}")
    assert err < 1e-4 and bool((ref.abs().sum(1) > 0).all())


ROWS = (128, 64)  # row tiles of the Gluon kernels (8 and 4 warps)
POINTS = ("deepseek-v3:4096", "deepseek-v3:16384", "qwen3-30b-a3b:16384")


def offline(out_dir):
    """moekit's Gluon GEMM1 and GEMM2 compiled for sm_90a here at each row tile (the dense probe's
    sass_report), at DeepSeek-V3's shapes at M = 16384 (the operands' shapes and strides; nothing
    runs)."""
    E, H, I, R, TK = 256, 7168, 2048, 65536, 131072
    f8 = torch.float8_e4m3fn
    ends, ids = torch.empty(E, dtype=torch.int32), torch.empty(R, dtype=torch.int32)
    a1, w13 = torch.empty(R, H, dtype=f8), torch.empty(E, 2 * I, H, dtype=f8)
    a2, w2 = torch.empty(R, I, dtype=f8), torch.empty(E, H, I, dtype=f8)
    gemm1 = (a1, torch.empty(R, H // 128), w13, torch.empty(E, 2 * I // 128, H // 128),
             torch.empty(R, I, dtype=torch.bfloat16), ends)
    gemm2_args = (a2, torch.empty(R, I // 128), w2, torch.empty(E, H // 128, I // 128), torch.empty(TK), ids, ends,
                  TK)
    report = {}
    for bm in ROWS:
        report[f"gemm1 {bm}"] = dense.sass_report(lambda: gluon_block.gemm1(*gemm1, bm, 132),
                                                  os.path.join(out_dir, f"block_gemm1_{bm}.sass"))
        report[f"gemm2 {bm}"] = dense.sass_report(lambda: gemm2(*gemm2_args, bm, 132),
                                                  os.path.join(out_dir, f"block_gemm2_{bm}.sass"))
    with open(os.path.join(out_dir, "block_gemm2_offline.json"), "w") as f:
        json.dump(report, f, indent=1)
    return report


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "fp8_block_gluon_gemm2.json"))
    ap.add_argument("--points", default=",".join(POINTS))
    ap.add_argument("--sass", metavar="DIR", help="only compile the kernel for sm_90a here (no GPU)")
    ap.add_argument("--check", action="store_true", help="check the reference on CPU (TRITON_INTERPRET=1)")
    args = ap.parse_args()
    if args.check:
        check()
        return
    if GLUON is not None:
        raise SystemExit(f"this triton has no Gluon Hopper module: {GLUON}")
    if args.sass:
        print(json.dumps(offline(args.sass), indent=1))
        return
    import profile_h200  # noqa: PLC0415 (the shipped GEMM2's time through the layer)

    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    results = []
    for spec in args.points.split(","):
        name, M = spec.split(":")[0], int(spec.split(":")[1])
        p = problem(name, M, dev)
        ref = reference(p)
        TK = p["ids"].numel()
        flops = 2.0 * TK * p["H"] * p["I"]
        shipped = profile_h200.profile_point(f"{name}:fp8_w8a8_block128:{M}")
        kr = next((kr for kr in shipped["kernels"] if "gemm2" in kr["kernel"]), {})
        gemm2_us = kr.get("us_per_call")
        results.append(dict(point=spec, kernel=f"the layer's {kr.get('kernel')} (profiled)", us=gemm2_us,
                            tflops=flops / gemm2_us / 1e6 if gemm2_us else None))
        print(json.dumps(results[-1]), flush=True)
        for bm in ROWS:
            call = (lambda bm=bm: gemm2(p["a2"], p["a2_s"], p["w2"], p["w2_s"], p["w"], p["al"].sorted_ids,
                                        p["al"].expert_end, TK, bm, sms))
            results.append(dense.measure(dict(point=spec, kernel=f"gluon BM={bm}"), call, ref, flops))
        del p, ref
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(dev), torch=torch.__version__, triton=triton.__version__,
                       results=results), f, indent=1)


if __name__ == "__main__":
    sys.exit(main())

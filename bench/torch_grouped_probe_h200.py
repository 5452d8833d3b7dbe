"""torch's own grouped GEMMs (CUTLASS) at the experts' GEMM shapes, beside moekit's calls, in one process.

For each point "shape:M": the rows of uniform softmax top-k routing grouped by expert with no
padding (offsets = the per-expert counts' cumulative sum), then
- bf16: torch._grouped_mm for GEMM1 ([rows, H] x w13^T) and GEMM2 ([rows, I] x w2^T);
- fp8: torch._scaled_grouped_mm with row-wise scales (one per row of x, one per output channel
  of each expert's weights; a per-tensor scale is the broadcast case), fast accumulation on and off;
- moekit's whole call in bf16 and fp8_w8a8 with static scales (the shipped tables).
A check compares each grouped GEMM's first and last expert against torch.matmul in fp32.
TFLOP/s count the routed rows only (no padding exists here). Times: CUDA graphs of 4 calls,
median over replays.

    PYTHONPATH=src python bench/torch_grouped_probe_h200.py --point qwen3-30b-a3b:16384 [--point ...] [--out FILE]
"""

import torch

from moekit.benchmarks.gpu import _quant_call, ab_arg_parser, graph_time_us, quantized_weights, routing_sets, \
    shape_by_name, write_ab_result
from moekit.kernels.launch import fused_moe

F8 = torch.float8_e4m3fn


def _check(out, a, b, offs, n_check=2):
    """Largest relative error of the first and last non-empty groups against fp32 matmuls."""
    starts = torch.cat([offs.new_zeros(1), offs[:-1]]).tolist()
    ends = offs.tolist()
    groups = [g for g in range(len(ends)) if ends[g] > starts[g]]
    err = 0.0
    for g in (groups[0], groups[-1])[:n_check]:
        ref = a[starts[g]:ends[g]].float() @ b[g].float()
        got = out[starts[g]:ends[g]].float()
        err = max(err, ((got - ref).norm() / ref.norm()).item())
    return err


def probe(name: str, M: int, replays: int) -> dict:
    _, E, k, H, I = shape_by_name(name)
    dev = "cuda"
    sets = routing_sets(M, E, k, H, 4, torch.bfloat16, dev)
    R = M * k
    offs_list = [torch.cumsum(torch.bincount(ids.flatten().long(), minlength=E), 0).to(torch.int32)
                 for _, _, ids in sets]
    w13 = torch.randn(E, 2 * I, H, device=dev, dtype=torch.bfloat16) / H ** 0.5
    w2 = torch.randn(E, H, I, device=dev, dtype=torch.bfloat16) / I ** 0.5
    xs = torch.randn(R, H, device=dev, dtype=torch.bfloat16)
    act = torch.randn(R, I, device=dev, dtype=torch.bfloat16)
    flops1, flops2 = 2.0 * R * 2 * I * H, 2.0 * R * H * I
    row = {"point": f"{name}:{M}", "E": E, "k": k, "H": H, "I": I, "rows": R, "impls": {}}

    def record(label, fn, arg_sets, flops, check=None):
        try:
            us = graph_time_us(fn, arg_sets, replays=replays)
            entry = {"us": us, "tflops": flops / us / 1e6}
            if check is not None:
                entry["rel_err_vs_fp32"] = check()
        except Exception as exc:  # noqa: BLE001 (a variant that cannot run is a result)
            entry = {"failed": f"{type(exc).__name__}: {exc}"[:400]}
        row["impls"][label] = entry
        print(name, M, label, entry, flush=True)

    gmm = torch._grouped_mm
    o_sets = [(o,) for o in offs_list]
    record("torch bf16 GEMM1", lambda o: gmm(xs, w13.transpose(1, 2), offs=o), o_sets, flops1,
           lambda: _check(gmm(xs, w13.transpose(1, 2), offs=offs_list[0]), xs, w13.transpose(1, 2), offs_list[0]))
    record("torch bf16 GEMM2", lambda o: gmm(act, w2.transpose(1, 2), offs=o), o_sets, flops2)

    w13q, w2q = w13.to(F8), w2.to(F8)
    xq, aq = xs.to(F8), act.to(F8)
    sa1, sa2 = torch.ones(R, device=dev), torch.ones(R, device=dev)
    sb1, sb2 = torch.ones(E, 2 * I, device=dev), torch.ones(E, H, device=dev)
    for fast in (True, False):
        tag = "fast" if fast else "exact"

        def g1(o, fast=fast):
            return torch._scaled_grouped_mm(xq, w13q.transpose(1, 2), sa1, sb1, offs=o, out_dtype=torch.bfloat16,
                                            use_fast_accum=fast)

        def g2(o, fast=fast):
            return torch._scaled_grouped_mm(aq, w2q.transpose(1, 2), sa2, sb2, offs=o, out_dtype=torch.bfloat16,
                                            use_fast_accum=fast)

        record(f"torch fp8 rowwise GEMM1 {tag}", g1, o_sets, flops1,
               lambda g1=g1: _check(g1(offs_list[0]), xq, w13q.transpose(1, 2), offs_list[0]))
        record(f"torch fp8 rowwise GEMM2 {tag}", g2, o_sets, flops2)
    del w13q, w2q, xq, aq

    total = flops1 + flops2
    record("moekit bf16 call", lambda x, w, ids: fused_moe(x, w13, w2, None, None, w, ids, None, "silu", out_dtype=x.dtype), sets, total)
    wts = quantized_weights("fp8_w8a8", E, H, I, True, dev)
    record("moekit fp8 static call", lambda x, w, ids: _quant_call(wts, x, w, ids), sets, total)
    return row


def main() -> None:
    p = ab_arg_parser(__doc__, "torch_grouped_probe.json")
    p.add_argument("--point", action="append", required=True, help="shape:M (repeatable)")
    p.add_argument("--replays", type=int, default=5)
    args = p.parse_args()
    rows = []
    for point in args.point:
        name, M = point.split(":")
        rows.append(probe(name, int(M), args.replays))
        torch.cuda.empty_cache()
    write_ab_result(args.out, "torch grouped GEMMs beside moekit", True,
                    "CUDA graph of 4 calls (distinct routing), median us per call over replays", points=rows)


if __name__ == "__main__":
    main()

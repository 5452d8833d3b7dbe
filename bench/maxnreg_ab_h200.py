"""Register caps (ptxas .maxnreg) on the shipped kernels of a call, A/B in one process, on one H200.

A kernel's registers set how many of its warps an SM holds; the decode GEMMs wait on loads and
fixed-latency chains with a quarter to a third of an SM's warps resident (Nsight Compute:
bench/results/h200-ncu-int4-16.json). A variant caps the registers of the kernels whose name
matches a pattern (Triton's `maxnreg` launch option: ptxas fits the kernel into that many
registers a thread, spilling to local memory where it must). Each point's call runs through the
shipped tables as shipped (A) and under each variant: outputs compared bit for bit (a register
cap must not change them), registers and spills of each capped kernel recorded, then timed in
CUDA graphs of 8 calls with distinct routing, interleaved.

    PYTHONPATH=src python bench/maxnreg_ab_h200.py --point qwen3-30b-a3b:int4_w4a16:16 \\
        --variant gemm1=64 --variant gemm1=64,gemm2=80 [--rounds 3] [--out FILE]

A point is shape:scheme:M[:static] as in profile_h200.py ("bf16" for unquantized weights); a
variant is NAME=REGS pairs, NAME a substring of the kernels' names (gemm1 matches gemm1_kernel,
gemm1_quant_kernel and prefill_gemm1_kernel; gemv1 the direct path's). `--device cpu` is a dry
run under TRITON_INTERPRET=1 on a tiny bf16 shape (no caps apply there: wall-clock times).
"""

import statistics

import torch
from triton.runtime.jit import JITFunction

from moekit.benchmarks.gpu import (AB_TIMING, ab_arg_parser, ab_device, ab_time_us, point_call, routing_sets,
                                  write_ab_result)

_CAPS = {}  # kernel-name substring -> maxnreg, read at each launch
_SEEN = {}  # kernel name -> (registers, spills) of its last launch under caps
_launch = JITFunction.run


def _capped_run(self, *args, **kwargs):
    name = self.fn.__name__
    caps = [n for pattern, n in _CAPS.items() if pattern in name]
    if caps:
        kwargs["maxnreg"] = min(caps)
    kernel = _launch(self, *args, **kwargs)
    if caps and hasattr(kernel, "n_regs"):
        _SEEN[name] = (kernel.n_regs, kernel.n_spills)
    return kernel


JITFunction.run = _capped_run


def parse_variant(text: str):
    """{name substring: registers} of a variant's NAME=REGS,... text."""
    out = {}
    for item in text.split(","):
        name, _, regs = item.partition("=")
        if not name or not regs.isdigit() or not 24 <= int(regs) <= 255:
            raise ValueError(f"a variant is NAME=REGS[,NAME=REGS...] with 24 <= REGS <= 255, got {text!r}")
        out[name] = int(regs)
    return out


def _tiny_call(dev):
    from moekit.experts.api import fused_experts  # noqa: PLC0415

    E, k, H, I = 8, 2, 64, 32
    w13 = torch.randn(E, 2 * I, H, device=dev, dtype=torch.float16) * H ** -0.5
    w2 = torch.randn(E, H, I, device=dev, dtype=torch.float16) * I ** -0.5
    fn = lambda x, w, i: fused_experts(x, w13, w2, w, i, backend="triton")  # noqa: E731
    return fn, routing_sets(5, E, k, H, 2, torch.float16, dev)


def main():
    p = ab_arg_parser(__doc__, "h200-maxnreg-ab.json")
    p.add_argument("--point", action="append", required=True, help="shape:scheme:M[:static] (repeatable)")
    p.add_argument("--variant", action="append", required=True, help="NAME=REGS[,NAME=REGS...] (repeatable)")
    args = p.parse_args()
    cuda, dev = ab_device(args)
    variants = [parse_variant(v) for v in args.variant]
    rows = []
    for spec in args.point:
        fn, sets = point_call(spec, 8)[:2] if cuda else _tiny_call(dev)
        _CAPS.clear()
        ref = [fn(*s).clone() for s in sets]
        times = {"A": []}
        info = {}
        for i, caps in enumerate(variants):
            _CAPS.clear()
            _CAPS.update(caps)
            _SEEN.clear()
            try:
                out = [fn(*s) for s in sets]
            except Exception as exc:  # noqa: BLE001 (ptxas refuses caps below what an instruction needs)
                print(f"{spec:34s} {str(caps):34s} does not compile: {str(exc).splitlines()[-1][:200]}", flush=True)
                info[f"B{i}"] = {"caps": caps, "error": str(exc).splitlines()[-1][:500]}
                continue
            info[f"B{i}"] = {"caps": caps, "same_bits": all(torch.equal(a, b) for a, b in zip(ref, out)),
                             "registers_spills": dict(_SEEN)}
            times[f"B{i}"] = []
        for _ in range(args.rounds):
            for key in times:
                _CAPS.clear()
                if key != "A":
                    _CAPS.update(variants[int(key[1:])])
                times[key].append(ab_time_us(fn, sets, cuda, replays=10))
        _CAPS.clear()
        a = statistics.median(times["A"])
        row = {"point": spec, "A_us": a, "A_rounds": times["A"]}
        for key, meta in info.items():
            if key not in times:
                row[key] = meta
                continue
            b = statistics.median(times[key])
            row[key] = {**meta, "us": b, "rounds": times[key], "speedup": a / b}
            print(f"{spec:34s} {str(meta['caps']):34s} {a:9.1f} -> {b:9.1f} us  x{a / b:.3f}  "
                  f"bits {'same' if meta['same_bits'] else 'DIFFER'}  {meta['registers_spills']}", flush=True)
        rows.append(row)
        del fn, sets, ref
        if cuda:
            torch.cuda.empty_cache()
    write_ab_result(args.out, "maxnreg_ab_h200", cuda, AB_TIMING, points=rows)


if __name__ == "__main__":
    main()

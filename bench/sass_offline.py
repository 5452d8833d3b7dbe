"""The SASS of a call's Triton kernels for an H200 (sm_90a), compiled here, without a GPU.

Triton is told its device is a CUDA target of the given architecture, and every launch of the
call only compiles (Triton's warmup path); the call runs on CPU tensors of the point's real
shapes through the H200's tuned tables, so each kernel gets the specialization it gets there
(tiles, knobs, dtypes, 16-byte alignments). For each kernel it writes the SASS
(`nvdisasm`), its registers (`cuobjdump -res-usage`), shared memory and warps, and the program
order of its global loads, async copies, barriers, MMAs and stores: where a load sits relative
to the weight pipeline, which a GPU profile shows only as stall samples.

    pip install --target /tmp/t36 triton==3.6.0        # the H200 machine's Triton, to match it
    PYTHONPATH=/tmp/t36:src python bench/sass_offline.py --point qwen3-30b-a3b:fp8_w8a8:16:static \\
        [--point ...] [--out DIR] [--arch 90]

A point is shape:scheme:M[:static] as in profile_h200.py ("bf16" for unquantized weights).
Launch options that need a CUDA device are dropped and reported (programmatic dependent
launch: its wait and trigger instructions are missing from these kernels; int4 weights
converted by inline PTX are compiled with the bit-operation conversion instead). Compare two
versions of src/ by running twice with different PYTHONPATHs.
"""

import argparse
import contextlib
import dataclasses
import json
import os
import re
import subprocess
import tempfile

import torch
import triton

from moekit.benchmarks.gpu import shape_by_name

# Instructions listed in a kernel's order summary: global memory, async copies and their
# waits, barriers, warpgroup MMAs, exits.
ORDER_OPS = re.compile(r"^(LDG|LDGSTS|STG|LDGDEPBAR|DEPBAR|BAR\.SYNC|WARPGROUP\.DEPBAR|QGMMA|HGMMA|HMMA|UTMALDG|UTMASTG|"
                       r"SYNCS|EXIT|ACQBULK|REDG|ATOMG)")


class _OfflineDriver:
    """What Triton's launch path asks its driver for, for a CUDA target with no device."""

    def __init__(self, arch: int):
        from triton.backends.compiler import GPUTarget  # noqa: PLC0415

        self.target = GPUTarget("cuda", arch, 32)

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")

    def is_active(self):
        return True


@contextlib.contextmanager
def compile_only(arch: int = 90):
    """Within: every Triton launch compiles for sm_{arch} and returns without running; yields the
    list of (kernel name, CompiledKernel) in launch order."""
    from triton.runtime import driver  # noqa: PLC0415
    from triton.runtime.jit import JITFunction  # noqa: PLC0415

    compiled = []
    run = JITFunction.run

    def warmup_only(self, *args, grid, warmup, **kwargs):
        kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        compiled.append((self.fn.__name__, kernel))
        return kernel

    previous = driver._active
    driver.set_active(_OfflineDriver(arch))
    JITFunction.run = warmup_only
    try:
        yield compiled
    finally:
        JITFunction.run = run
        driver._active = previous


def point_launch(spec: str, knobs_json: str = ""):
    """(fn of no arguments running the point's call on CPU tensors through the H200 tables,
    [launch options dropped]); knobs_json: QuantKnobs fields set over the table's (quantized
    points; "entry": a whole table entry instead of the table's)."""
    from moekit.kernels import launch  # noqa: PLC0415
    from moekit.kernels.tuning import get_config  # noqa: PLC0415

    parts = spec.split(":")
    name, scheme_name, M = parts[0], parts[1], int(parts[2])
    static = len(parts) > 3 and parts[3] == "static"
    _, E, k, H, I = shape_by_name(name)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(M, H, generator=gen).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(M)]).to(torch.int32)
    w = torch.rand(M, k, generator=gen)
    dropped = []
    if scheme_name == "bf16":
        cfg = get_config(M, E, k, H, I, torch.bfloat16, "NVIDIA_H200")
        if cfg.gemm2.PDL:
            cfg = dataclasses.replace(cfg, gemm2=dataclasses.replace(cfg.gemm2, PDL=0))
            dropped.append("gemm2.PDL")
        w13 = torch.empty(E, 2 * I, H, dtype=torch.bfloat16)
        w2 = torch.empty(E, H, I, dtype=torch.bfloat16)
        return (lambda: launch.fused_moe(x, w13, w2, None, None, w, ids, None, "silu", config=cfg,
                                         out_dtype=torch.bfloat16)), dropped
    from moekit.kernels.launch_quant import fused_moe_quant, prefill_refusal, quant_tiles  # noqa: PLC0415
    from moekit.kernels.quant_rows import modes_of  # noqa: PLC0415
    from moekit.quant import get_scheme, quantize_experts  # noqa: PLC0415

    scheme = get_scheme(scheme_name)
    modes = modes_of(scheme)
    # One expert quantized for the layouts and dtypes of the weights and scales; E of each,
    # uninitialized (the values do not matter: nothing runs).
    extra = dict(a13_scale=torch.ones(1), a2_scale=torch.ones(1)) if static else {}
    q = quantize_experts(torch.randn(1, 2 * I, H, generator=gen) * H ** -0.5,
                         torch.randn(1, H, I, generator=gen) * I ** -0.5, scheme, **extra)
    rep = lambda t: None if t is None else torch.empty(E, *t.shape[1:], dtype=t.dtype)  # noqa: E731
    args = [rep(q.w13), rep(q.w2), None, None] + [rep(q.scales.get(n)) for n in
                                                  ("w13_scale", "w2_scale", "w13_zero", "w2_zero", "a13_scale",
                                                   "a2_scale")]
    cfg, knobs = quant_tiles(M, E, k, H, I, torch.bfloat16, "NVIDIA_H200", scheme, modes)
    # On CUDA an entry's static_prefill tiles replace its own where the prefill kernels take the
    # call; an explicit config (as here) does not, so that choice is made here.
    if knobs.static_prefill is not None and prefill_refusal(modes, static, False, args[4], args[5]) is None:
        cfg = knobs.static_prefill
    if knobs_json:
        over = json.loads(knobs_json)
        if "entry" in over:  # a whole table entry (tiles, "gemm2", "quant") instead of the table's
            from moekit.benchmarks.gpu import parse_quant_entry  # noqa: PLC0415

            cfg, knobs = parse_quant_entry(over.pop("entry"))
        knobs = dataclasses.replace(knobs, **over)
    if knobs.pdl:
        knobs = dataclasses.replace(knobs, pdl=False)
        dropped.append("quant.pdl")
    if knobs.w_convert == "ptx":  # refused off CUDA (the interpreter cannot run inline PTX)
        knobs = dataclasses.replace(knobs, w_convert="bits")
        dropped.append("quant.w_convert=ptx (compiled as bits)")
    return (lambda: fused_moe_quant(x, *args, w, ids, None, scheme, "silu", config=cfg, knobs=knobs,
                                    out_dtype=torch.bfloat16)), dropped


def _tool(name: str) -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def describe(kernel, sass_path: str) -> dict:
    """Registers, shared memory, warps, instruction count and order summary of a compiled kernel;
    its SASS written to sass_path, its TTGIR beside it (.ttgir)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        sass = subprocess.run([_tool("nvdisasm"), "-c", f.name], capture_output=True, text=True, check=True).stdout
        usage = subprocess.run([_tool("cuobjdump"), "-res-usage", f.name], capture_output=True, text=True,
                               check=True).stdout
    with open(sass_path, "w") as out:
        out.write(sass)
    with open(os.path.splitext(sass_path)[0] + ".ttgir", "w") as out:  # the layouts Triton chose
        out.write(kernel.asm["ttgir"])
    regs = re.search(r"REG:(\d+)", usage)
    spill = re.search(r"LOCAL:(\d+)", usage)
    instrs = []
    for line in sass.splitlines():
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line)
        if m:
            instrs.append((int(m.group(1), 16), m.group(2)))
    order = []
    for addr, text in instrs:
        op = re.sub(r"^@!?U?P\w+\s+", "", text)
        if ORDER_OPS.match(op):
            order.append(f"{addr:05x} {text}")
    return {"registers": int(regs.group(1)) if regs else None, "local_bytes": int(spill.group(1)) if spill else None,
            "shared_bytes": kernel.metadata.shared,
            "num_warps": kernel.metadata.num_warps, "instructions": len(instrs), "sass": os.path.basename(sass_path),
            "order": order}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--point", action="append", required=True, help="shape:scheme:M[:static] (repeatable)")
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "sass-offline"))
    p.add_argument("--knobs", default="", help='QuantKnobs fields over the tables\', e.g. \'{"swap1": true}\'; '
                   '"entry": a table entry to run instead')
    p.add_argument("--arch", type=int, default=90, help="CUDA compute capability x 10 (90: H100/H200)")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    report = {"triton": triton.__version__, "arch": f"sm_{args.arch}a" if args.arch == 90 else f"sm_{args.arch}",
              "points": []}
    for spec in args.point:
        fn, dropped = point_launch(spec, args.knobs)
        with compile_only(args.arch) as compiled:
            fn()
        stem = spec.replace(":", "_")
        kernels = []
        for i, (name, kernel) in enumerate(compiled):
            row = {"kernel": name, **describe(kernel, os.path.join(args.out, f"{stem}-{i}-{name}.sass"))}
            kernels.append(row)
            print(f"{spec:36s} {name:24s} {row['registers']:4d} registers {row['local_bytes']:5d} B local "
                  f"{row['shared_bytes']:7d} B shared "
                  f"{row['num_warps']:2d} warps {row['instructions']:5d} instructions", flush=True)
        report["points"].append({"point": spec, "dropped": dropped, "kernels": kernels})
    with open(os.path.join(args.out, "sass-offline.json"), "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

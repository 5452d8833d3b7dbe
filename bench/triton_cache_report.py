"""What Triton compiled, from its cache: per kernel, warps, stages, shared memory, registers and
spills (ptxas -v on the cached PTX), and the load and product instructions it holds.

    python bench/triton_cache_report.py gemm1_quant_kernel,gemm2_quant_kernel [--cache DIR]

Run after the kernels have been compiled (on the machine whose GPU they were compiled for): the
shared memory and registers say how many programs share a multiprocessor; cp.async / bulk
counts show whether the loads are pipelined into shared memory.
"""

import argparse
import glob
import json
import os
import re
import subprocess

import triton

PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
# (label, pattern) of the instructions counted in a kernel's PTX
COUNTED = (("cp.async", r"cp\.async\.c[ag]"), ("bulk", r"cp\.async\.bulk"), ("ld.global", r"ld\.global"),
           ("wgmma", r"wgmma\.mma_async"), ("mma.sync", r"mma\.sync"))


def report(meta_path: str) -> str:
    md = json.load(open(meta_path, encoding="utf-8"))
    ptx_path = meta_path[:-len(".json")] + ".ptx"
    ptx = open(ptx_path, encoding="utf-8").read()
    arch = md["target"]["arch"]
    out = subprocess.run([PTXAS, f"-arch=sm_{arch}a" if arch >= 90 else f"-arch=sm_{arch}", "-v", ptx_path,
                          "-o", os.devnull], capture_output=True, text=True).stderr
    regs = re.findall(r"Used (\d+) registers", out)
    spills = re.findall(r"(\d+) bytes spill stores", out)
    counts = " ".join(f"{label} {len(re.findall(pattern, ptx))}" for label, pattern in COUNTED)
    return (f"{md['name']}: warps {md.get('num_warps')} stages {md.get('num_stages')} shared {md.get('shared')} B "
            f"registers {','.join(regs) or '?'} spill stores {','.join(spills) or '?'} B; {counts}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("kernels", help="kernel names, comma-separated")
    p.add_argument("--cache", default=os.path.expanduser("~/.triton/cache"))
    args = p.parse_args()
    names = set(args.kernels.split(","))
    for meta in sorted(glob.glob(os.path.join(args.cache, "*", "*.json"))):
        if os.path.basename(meta)[:-len(".json")] in names and os.path.exists(meta[:-len(".json")] + ".ptx"):
            print(report(meta))


if __name__ == "__main__":
    main()

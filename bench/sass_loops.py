"""Instructions in the warpgroup-product loops of a compiled CUDA source, without a GPU.

Compiles the source for sm_90a (nvcc -cubin), disassembles it (nvdisasm: CUDA's, else Triton's
copy) and, for each kernel, lists every loop (a backward branch to a label) that holds
warpgroup products (QGMMA / HGMMA): its instructions by opcode. The K loop of a GEMM is where an
instruction more or fewer shows in the time.

    python bench/sass_loops.py src/moekit/kernels/cuda/hopper_block.cu [--kernel SUBSTRING] [--dump]
"""

import argparse
import collections
import glob
import os
import re
import shutil
import subprocess
import tempfile


def _nvdisasm() -> str:
    found = shutil.which("nvdisasm") or next(iter(glob.glob("/usr/local/cuda*/bin/nvdisasm")), None)
    if found:
        return found
    import triton  # noqa: PLC0415 (Triton ships its own copy)
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")


def kernels(source: str) -> dict:
    """{kernel symbol: [SASS lines without comments]}."""
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "k.cubin")
        subprocess.run(["nvcc", "-O3", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a", "-cubin", "-o", cubin,
                        source], check=True)
        sass = subprocess.run([_nvdisasm(), "-c", cubin], capture_output=True, text=True, check=True).stdout
    out, name = {}, None
    for line in sass.splitlines():
        if line.startswith(".text."):
            name = line[len(".text."):].rstrip(":")
            out[name] = []
        elif name:
            text = re.sub(r"/\*[0-9a-f]{4}\*/", "", line).split("/*")[0].strip().rstrip(";").strip()
            if text and not text.startswith("."):
                out[name].append(text)
            elif text.startswith(".L_x_"):
                out[name].append(text)
    return out


def product_loops(lines: list) -> list:
    """[(label, [instructions])] of the loops that hold warpgroup products."""
    where = {l[:-1]: i for i, l in enumerate(lines) if l.startswith(".L_x_") and l.endswith(":")}
    loops = []
    for i, l in enumerate(lines):
        m = re.search(r"BRA `\((\.L_x_\d+)\)", l)
        if m and m.group(1) in where and where[m.group(1)] < i:
            body = [x for x in lines[where[m.group(1)]:i + 1] if not x.startswith(".L_x_")]
            if any("GMMA" in x for x in body):
                loops.append((m.group(1), body))
    return loops


def opcode(ins: str) -> str:
    parts = ins.split()
    op = parts[1] if parts[0].startswith("@") else parts[0]
    return op.split(".")[0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source")
    p.add_argument("--kernel", default="", help="only kernels whose symbol contains this")
    p.add_argument("--dump", action="store_true", help="print the loops' instructions")
    args = p.parse_args()
    for name, lines in kernels(args.source).items():
        if args.kernel not in name:
            continue
        print(name[-90:])
        for label, body in product_loops(lines):
            ops = collections.Counter(opcode(x) for x in body)
            print(f"  loop {label}: {len(body)} instructions, {ops.get('QGMMA', 0) + ops.get('HGMMA', 0)} products; "
                  + ", ".join(f"{k} {v}" for k, v in ops.most_common(14)))
            if args.dump:
                print("\n".join("      " + x for x in body))


if __name__ == "__main__":
    main()

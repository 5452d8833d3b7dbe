"""Does ptxas keep warpgroup products in flight inside a Gluon warp-specialized partition? (offline)

The block-scaled fp8 GEMMs (moekit.kernels.gluon_block) keep one product in flight while they
promote the previous one. Their next step, two warpgroups out of phase (one promotes while the
other's products run), needs gl.warp_specialize, and every such variant compiled with Triton 3.6
had ptxas serialize its products (bench/NOTES-triton.md, "The block scheme on Gluon kernels in
the layer"). This is the smallest kernel that shows it: the same pair-of-steps loop (a product
issued, the previous one waited for and promoted, the product in flight across the loop's back
edge), compiled for sm_90a here without a GPU,

    plain: the loop in the kernel itself (the shape of the shipped kernels);
    ws:    the loop in two partitions of gl.warp_specialize, one warpgroup each;

and it prints, for each, the registers, the waits that leave products in flight
(`WARPGROUP.DEPBAR.LE gsb0, 0x1`), those that wait for all of them, and ptxas's own reason
(C7514) when it serializes.

    PYTHONPATH=src python bench/gluon_ws_wgmma_probe.py     # with the H200's triton: PYTHONPATH=/tmp/t36:src

With triton 3.6 and 3.9: plain keeps its products in flight; ws is serialized ("non wgmma
instructions reading accumulator registers of a wgmma between start and end of the pipeline
stage"), with waits injected at the worker partitions' dispatch loop (setmaxnreg): a product
may be in flight when a partition's loop exits, which the pair schedule needs.
"""

import os
import subprocess
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sass_offline import compile_only, describe  # noqa: E402
from moekit.kernels.gluon_block import GLUON_MISSING  # noqa: E402

if GLUON_MISSING is None:
    from moekit.kernels.gluon_block import gl, gluon, warpgroup_mma, warpgroup_mma_wait  # noqa: E402

    @gluon.jit
    def _pairs(half: gl.constexpr, a_bufs, b_bufs, out_ptr, steps):
        """64 rows (half) of a pair-of-steps loop: promote step s - 1 while step s multiplies;
        every fourth pair ends an item (the last product waited for, the rows stored)."""
        ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, 128, 32])
        STORE: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
        zero = gl.zeros([64, 128], gl.float32, ACC)
        acc = zero
        t1 = zero
        for s in range(0, steps, 2):
            t0 = warpgroup_mma(a_bufs.index(s % 2).slice(half * 64, 64), b_bufs.index(s % 2).permute((1, 0)), zero,
                               use_acc=False, is_async=True)
            t1, t0 = warpgroup_mma_wait(1, deps=(t1, t0))
            if s % 8 > 0:
                acc = acc + t1 * 2.0
            t1 = warpgroup_mma(a_bufs.index((s + 1) % 2).slice(half * 64, 64),
                               b_bufs.index((s + 1) % 2).permute((1, 0)), zero, use_acc=False, is_async=True)
            t0, t1 = warpgroup_mma_wait(1, deps=(t0, t1))
            if s + 2 >= steps:  # the last pair: nothing in flight when the loop ends
                t1 = warpgroup_mma_wait(0, deps=(t1,))
            acc = acc + t0 * 3.0
            if s % 8 == 6:
                t1 = warpgroup_mma_wait(0, deps=(t1,))
                out = gl.convert_layout(acc + t1, STORE)
                rs = half * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, STORE))
                cs = gl.arange(0, 128, layout=gl.SliceLayout(0, STORE))
                gl.store(out_ptr + s * 128 + gl.expand_dims(rs, 1) * 128 + gl.expand_dims(cs, 0), out)
                acc = zero

    @gluon.jit
    def _buffers():
        layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([128, 128], gl.float8e4nv)
        return (gl.allocate_shared_memory(gl.float8e4nv, [2, 128, 128], layout),
                gl.allocate_shared_memory(gl.float8e4nv, [2, 128, 128], layout))

    @gluon.jit
    def plain_kernel(out_ptr, steps, num_warps: gl.constexpr):
        a_bufs, b_bufs = _buffers()
        _pairs(0, a_bufs, b_bufs, out_ptr, steps)

    @gluon.jit
    def ws_kernel(out_ptr, steps, num_warps: gl.constexpr):
        a_bufs, b_bufs = _buffers()
        gl.warp_specialize([(_pairs, (0, a_bufs, b_bufs, out_ptr, steps)),
                            (_pairs, (1, a_bufs, b_bufs, out_ptr, steps))], [4], [240])


def report(kernel, out_dir: str) -> dict:
    """Compile kernel for sm_90a here; its registers, waits and ptxas's serialization notice."""
    with compile_only(90) as compiled:
        kernel[(1,)](torch.empty(1024, 128), 8, num_warps=4)
    ck = compiled[-1][1]
    name = kernel.fn.__name__
    d = describe(ck, os.path.join(out_dir, f"{name}.sass"))
    with open(os.path.join(out_dir, f"{name}.sass")) as f:
        sass = f.read()
    ptx = os.path.join(out_dir, f"{name}.ptx")
    with open(ptx, "w") as f:
        f.write(ck.asm["ptx"])
    text = ""
    for tool in ("ptxas", "ptxas-blackwell"):  # the one that reads this triton's PTX version
        ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", tool)
        if os.path.exists(ptxas):
            notes = subprocess.run([ptxas, "-v", "--gpu-name=sm_90a", ptx, "-o", os.devnull], capture_output=True,
                                   text=True)
            text = notes.stdout + notes.stderr
            if notes.returncode == 0:
                break
    reason = [line.split(")", 1)[1].strip() for line in text.splitlines() if "C7514" in line]
    return dict(kernel=name, registers=d["registers"], in_flight_waits=sass.count("WARPGROUP.DEPBAR.LE gsb0, 0x1"),
                wait_all=sass.count("WARPGROUP.DEPBAR.LE gsb0, 0x0"), products=sass.count("QGMMA"),
                ptxas_serializes=reason[0] if reason else None)


def main() -> None:
    if GLUON_MISSING:
        raise SystemExit(GLUON_MISSING)
    import tempfile  # noqa: PLC0415

    with tempfile.TemporaryDirectory() as out_dir:
        for kernel in (plain_kernel, ws_kernel):
            print(report(kernel, out_dir), flush=True)


if __name__ == "__main__":
    main()

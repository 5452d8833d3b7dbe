"""moekit's CUDA kernels of the block-scaled fp8 scheme (kernels/hopper_block.py) without a GPU:
why a call is refused, how an unavailable build is reported, the knob's values, and, where nvcc
is installed, the compiled kernels' schedule (the GPU suite runs them: test_hopper_block_gpu.py)."""

import os
import re
import shutil
import stat
import subprocess
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from moekit.kernels import hopper_block
from moekit.kernels.quant_tuning import QuantKnobs

CPU = torch.device("cpu")


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """hopper_block with its library forgotten and its cache in tmp_path; restored after."""
    monkeypatch.setenv("MOEKIT_CACHE_DIR", str(tmp_path))
    hopper_block.reset()
    yield hopper_block
    hopper_block.reset()


def test_the_knob_takes_auto_on_off():
    assert QuantKnobs().cuda == "auto"
    assert QuantKnobs(cuda="off").to_json() == {"cuda": "off"}
    with pytest.raises(ValueError, match="cuda must be one of \\['auto', 'on', 'off', 'gemm1'\\], got 'yes'"):
        QuantKnobs(cuda="yes")


@pytest.mark.parametrize("device,x_dtype,E,H,I,rows,why", [
    (CPU, torch.bfloat16, 8, 256, 256, 64, "they run 128-row tiles, got 64"),
    (CPU, torch.float32, 8, 256, 256, 128, "x must be bfloat16 or float16, got torch.float32"),
    (CPU, torch.bfloat16, 8, 320, 256, 128, "H and I must be multiples of 128, got H=320, I=256"),
    (CPU, torch.bfloat16, 2048, 256, 256, 128, "at most 1024 experts' tables in shared memory, got E=2048"),
    (CPU, torch.float16, 8, 256, 256, 128, "need compute capability 9.x"),
])
def test_refusals_name_what_was_expected(device, x_dtype, E, H, I, rows, why):
    assert why in hopper_block.refusal(device, x_dtype, E, H, I, rows)


def test_turned_off_by_the_environment(fresh, monkeypatch):
    monkeypatch.setenv("MOEKIT_CUDA_KERNELS", "0")
    assert fresh.load() is None
    assert fresh.status() == "unavailable: turned off by MOEKIT_CUDA_KERNELS=0"


def test_no_nvcc_is_reported(fresh, monkeypatch, tmp_path):
    monkeypatch.delenv("MOEKIT_NVCC", raising=False)
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert fresh.load() is None
    assert "no nvcc found (set MOEKIT_NVCC or CUDA_HOME" in fresh.status()


def test_a_failing_compiler_is_reported_with_its_message(fresh, monkeypatch, tmp_path):
    fake = tmp_path / "nvcc"
    fake.write_text("#!/bin/sh\necho 'error: unsupported gpu architecture' >&2\nexit 1\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("MOEKIT_NVCC", str(fake))
    assert fresh.load() is None
    assert "nvcc failed to compile hopper_block.cu: error: unsupported gpu architecture" in fresh.status()
    assert not list(Path(tmp_path).rglob("*.so"))  # nothing half-written left in the cache


def _nvcc():
    return hopper_block._nvcc()


def _cuobjdump():
    try:
        import triton  # noqa: PLC0415
    except ImportError:
        return shutil.which("cuobjdump")
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    return str(tool) if tool.exists() else shutil.which("cuobjdump")


def _product_loops(sass: str) -> list:
    """The instructions of each innermost loop (a branch back to a lower address) of a kernel's
    SASS, as cuobjdump prints it, that holds eight warpgroup products: a paired K loop."""
    code = []  # (address, instruction)
    for line in sass.splitlines():
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line)
        if m:
            code.append((int(m.group(1), 16), m.group(2)))
    back = {a: int(t.group(1), 16) for a, ins in code if (t := re.search(r"\bBRA 0x([0-9a-f]+)$", ins))
            and int(t.group(1), 16) < a}  # the backward branches: address -> loop head
    loops = []
    for addr, head in back.items():
        inner = not any(head <= a < addr and head <= h for a, h in back.items())  # no loop inside
        body = [x for a, x in code if head <= a <= addr]
        if inner and sum("QGMMA" in x for x in body) == 8:
            loops.append(body)
    return loops


@pytest.mark.skipif(_nvcc() is None, reason="no nvcc here")
@pytest.mark.skipif(_cuobjdump() is None, reason="no cuobjdump here")
def test_the_kernels_keep_products_in_flight(tmp_path):
    """Compiled for sm_90a as build() does: no ptxas serialization of the products (C7514), the
    K-step pairs leave one product group in flight while the other is promoted, every variant
    issues its fp8 warpgroup products and its TMA loads, the roles rebalance their registers."""
    so = tmp_path / "k.so"
    run = subprocess.run([_nvcc(), *hopper_block._FLAGS, "-Xptxas", "-v", str(hopper_block.SOURCE), "-o", str(so)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "C7514" not in run.stderr and "C7508" not in run.stderr, run.stderr[-3000:]
    sass = subprocess.run([_cuobjdump(), "--dump-sass", str(so)], capture_output=True, text=True, timeout=600).stdout
    functions = re.split(r"\n\s*Function : ", sass)[1:]
    # GEMM1 / GEMM2 x bf16 / fp16 x single CTAs / pairs x serial / paired K steps, and GEMM1's
    # six-stage ring on single CTAs with paired K steps
    assert len(functions) == 18
    assert sum("ELi6E" in body.splitlines()[0] for body in functions) == 2
    for body in functions:
        name = body.splitlines()[0]
        assert "QGMMA.64x128x32.F32.E4M3.E4M3" in body and "UTMALDG.2D" in body, name
        assert "USETMAXREG.DEALLOC" in body and "USETMAXREG.TRY_ALLOC" in body, name
        paired = "Lb1E" in name
        assert ("WARPGROUP.DEPBAR.LE gsb0, 0x1" in body) == paired, name
        if "Li2ELb" in name:  # CTA pairs: the A tile multicast
            assert "UTMALDG.2D.MULTICAST" in body, name
        if "Li1ELb1E" in name:  # the shipped variant: its K loop is issue-bound, every instruction counts
            loops = _product_loops(body)
            assert loops, name
            for loop in loops:  # 8 products, 128 FFMA of the promotion; no descriptor moves a product
                assert len(loop) <= 260 and sum("R2UR" in x for x in loop) <= 8, (name, len(loop))


def test_the_source_ships_with_the_package():
    assert hopper_block.SOURCE.is_file()
    text = hopper_block.SOURCE.read_text()
    for name in ("moekit_block_gemm1", "moekit_block_gemm2", "moekit_block_last_grid"):
        assert f"int {name}(" in text

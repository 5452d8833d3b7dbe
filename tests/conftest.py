"""Shared test helpers: tolerances (PERF.md), relative error, GPU skipping, generators, expert maps,
the quantized kernels' activation rounding."""

import pytest
import torch

# PERF.md tolerance table: relative error ||out - ref|| / ||ref|| against the fp32 reference.
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; NaN anywhere gives inf so it never passes."""
    out, ref = out.double(), ref.double()
    if torch.isnan(out).any() or torch.isnan(ref).any():
        return float("inf")
    denom = ref.norm().item()
    num = (out - ref).norm().item()
    if denom == 0.0:
        return 0.0 if num == 0.0 else float("inf")
    return num / denom


def triton_act_dtype(weights, x: torch.Tensor):
    """What the quantized Triton kernels round GEMM1's activation to before GEMM2's input is
    quantized (quant.emulated_experts' act_dtype): x's dtype, as they store it, except with static
    activation scales, which GEMM1 applies to its fp32 output itself."""
    return None if "a2_scale" in weights.scales else x.dtype


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords or "multigpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def gen():
    """A torch.Generator with a fresh seed per test (printed on failure via the seed attr)."""
    g = torch.Generator()
    g.seed()
    return g


@pytest.fixture
def cuda_gen():
    """A CUDA torch.Generator with a fresh seed per test."""
    g = torch.Generator(device="cuda")
    g.seed()
    return g


def random_expert_map(E: int, n_remote: int, gen: torch.Generator, device="cpu"):
    """None without remote experts; else a map [E + n_remote] int32 placing the E local ids at
    random global positions, -1 elsewhere (drawn on the generator's device)."""
    if not n_remote:
        return None
    emap = torch.full((E + n_remote,), -1, dtype=torch.int32, device=device)
    emap[torch.randperm(E + n_remote, device=device, generator=gen)[:E]] = torch.arange(E, dtype=torch.int32,
                                                                                          device=device)
    return emap

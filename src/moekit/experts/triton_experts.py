"""`triton`: the fused Triton experts for CUDA GPUs (SM80+, tuned for SM90).

Pipeline (moekit/kernels): align assignments by expert on the GPU (no host sync) ->
GEMM1 over w13 with bias and activation fused -> GEMM2 over w2 with bias and routed
weight fused -> fixed-order sum over k. A few tokens take the direct path instead: no
sort, two launches, the k-sum fused into GEMM2. Tiles come from tuned JSON files
(kernels/tuning.py) or heuristics.

Supports: CUDA bf16/fp16/fp32 (fp32 with exact-fp32 dots), every activation of
moekit.activations, biases, expert_map, weights on input, CUDA graphs and torch.compile
(a custom op with a fake implementation). No autograd. On CPU tensors it runs only under
the Triton interpreter (TRITON_INTERPRET=1, for tests) and only in fp16/fp32: tl.dot on
bf16 operands returns wrong values there.

Quantized weights (every scheme of moekit.quant, bf16/fp16 activations; fp8 on SM89+,
int8/int4 on SM80+) take kernels/launch_quant.py: the sorted path with activation
quantization on the device, scales applied in the GEMM epilogues or per K tile.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import library

from ..config import settings
from ..kernels.launch import fused_moe
from ..kernels.launch_quant import fused_moe_quant, quant_unsupported
from ..kernels.triton_moe import MAX_EXPERTS, MAX_TOP_K
from ..kernels.tuning import cuda_capability
from ..quant.layout import scheme_of
from ..quant.schemes import SCHEMES, get_scheme
from .base import ExpertsBackend, ExpertsProblem, register_backend

__all__ = ["TritonBackend", "triton_fused_experts", "triton_quant_experts", "TOLERANCE"]

# PERF.md: relative error against the fp32 reference backend.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}


# Each call runs as a torch custom op under torch.compile (with a fake implementation for
# tracing) and as the plain function eagerly: the op's dispatch (autograd, redispatch, aliasing
# checks) costs host time per call that an eager decode step, host-bound already, would feel.


def _fused_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    b13: Optional[torch.Tensor],
    b2: Optional[torch.Tensor],
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_map: Optional[torch.Tensor],
    activation: str,
    alpha: float,
    limit: float,
    on_input: bool,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """Routed output [T, H] in out_dtype (fp32 or x's) of x [T, H] (arguments: kernels.launch.fused_moe)."""
    return fused_moe(x, w13, w2, b13, b2, topk_weights, topk_ids, expert_map, activation,
                     alpha=alpha, limit=limit, on_input=on_input, out_dtype=out_dtype)


triton_fused_experts = library.custom_op("moekit::triton_fused_experts", mutates_args=())(_fused_experts)


@triton_fused_experts.register_fake
def _triton_fused_experts_fake(x, w13, w2, b13, b2, topk_weights, topk_ids, expert_map, activation, alpha,
                               limit, on_input, out_dtype):
    return x.new_empty((x.shape[0], x.shape[1]), dtype=out_dtype)


def _quant_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    b13: Optional[torch.Tensor],
    b2: Optional[torch.Tensor],
    w13_scale: torch.Tensor,
    w2_scale: torch.Tensor,
    w13_zero: Optional[torch.Tensor],
    w2_zero: Optional[torch.Tensor],
    a13_scale: Optional[torch.Tensor],
    a2_scale: Optional[torch.Tensor],
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_map: Optional[torch.Tensor],
    quant: str,
    group_size: int,
    activation: str,
    alpha: float,
    limit: float,
    on_input: bool,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """Routed output [T, H] of x [T, H] over quantized weights (arguments: kernels.launch_quant.fused_moe_quant;
    group_size 0 for schemes without weight groups, zero points present = asymmetric)."""
    scheme = get_scheme(quant)
    if scheme.weight_granularity == "group":
        scheme = get_scheme(scheme, group_size=group_size, symmetric=w13_zero is None)
    return fused_moe_quant(x, w13, w2, b13, b2, w13_scale, w2_scale, w13_zero, w2_zero, a13_scale, a2_scale,
                           topk_weights, topk_ids, expert_map, scheme, activation, alpha=alpha, limit=limit,
                           on_input=on_input, out_dtype=out_dtype)


triton_quant_experts = library.custom_op("moekit::triton_quant_experts", mutates_args=())(_quant_experts)


@triton_quant_experts.register_fake
def _triton_quant_experts_fake(x, w13, w2, b13, b2, w13_scale, w2_scale, w13_zero, w2_zero, a13_scale, a2_scale,
                               topk_weights, topk_ids, expert_map, quant, group_size, activation, alpha, limit,
                               on_input, out_dtype):
    return x.new_empty((x.shape[0], x.shape[1]), dtype=out_dtype)


class TritonBackend(ExpertsBackend):
    name = "triton"
    description = "fused Triton GEMMs after a GPU sort by expert (CUDA)"
    graph_safe = True
    differentiable = False
    # apply(..., out_dtype=x.dtype) writes x's dtype directly (the k-sum stays fp32), which
    # spares the caller a cast kernel (see experts.api.experts_forward).
    native_out_dtype = True

    def available(self) -> Optional[str]:
        if getattr(torch.version, "hip", None) and not settings.triton_interpret:
            # torch's ROCm builds call their GPUs "cuda" too; the kernels are NVIDIA's (inline PTX,
            # float8 e4m3fn, TMA descriptors, Hopper warp specialization).
            return f"the kernels are written for NVIDIA GPUs; this torch is a ROCm build ({torch.version.hip})"
        if not torch.cuda.is_available() and not settings.triton_interpret:
            return "no CUDA GPU here (on CPU tensors it runs only under TRITON_INTERPRET=1, for tests)"
        return None

    def unsupported(self, problem: ExpertsProblem) -> Optional[str]:
        if problem.quant is not None:
            return self._quant_unsupported(problem)
        if problem.dtype != problem.weight_dtype:
            return f"activation dtype {problem.dtype} differs from weight dtype {problem.weight_dtype}"
        if problem.num_experts > MAX_EXPERTS:
            return f"takes at most {MAX_EXPERTS} local experts, got {problem.num_experts}"
        if problem.device == "cuda":
            if settings.triton_interpret:
                return "the Triton interpreter is on (TRITON_INTERPRET=1) and would run the kernels on the CPU"
            if problem.dtype not in (torch.bfloat16, torch.float16, torch.float32):
                return f"takes bfloat16, float16 or float32, got {problem.dtype}"
            if torch.cuda.is_available() and cuda_capability() < (8, 0):
                return f"needs compute capability 8.0 or newer, got {cuda_capability()}"
            return None
        if problem.device == "cpu":
            if not settings.triton_interpret:
                return "runs on CPU tensors only under the Triton interpreter (TRITON_INTERPRET=1, for tests)"
            if problem.dtype not in (torch.float16, torch.float32):
                return f"under the Triton interpreter takes float16 or float32 (bf16 dots are wrong there), got {problem.dtype}"
            return None
        return f"device {problem.device!r} is not supported (cuda; cpu under the Triton interpreter)"

    def _quant_unsupported(self, problem: ExpertsProblem) -> Optional[str]:
        """Why the quantized kernels cannot serve `problem`, or None."""
        if problem.quant not in SCHEMES:
            return f"quantization scheme {problem.quant!r} is not registered (known: {sorted(SCHEMES)})"
        if problem.num_experts > MAX_EXPERTS:
            return f"takes at most {MAX_EXPERTS} local experts, got {problem.num_experts}"
        if problem.static_scales and problem.top_k > MAX_TOP_K:
            return (f"static activation scales take top_k <= {MAX_TOP_K} (a token's slots are held in registers), "
                    f"got {problem.top_k}")
        capability = None
        if problem.device == "cuda":
            if settings.triton_interpret:
                return "the Triton interpreter is on (TRITON_INTERPRET=1) and would run the kernels on the CPU"
            if torch.cuda.is_available():
                capability = cuda_capability()
        elif problem.device == "cpu":
            if not settings.triton_interpret:
                return "runs on CPU tensors only under the Triton interpreter (TRITON_INTERPRET=1, for tests)"
            if problem.dtype != torch.float16:
                return f"quantized weights under the Triton interpreter take float16 activations (bf16 dots are wrong there), got {problem.dtype}"
        else:
            return f"device {problem.device!r} is not supported (cuda; cpu under the Triton interpreter)"
        return quant_unsupported(SCHEMES[problem.quant], problem.dtype, capability, problem.hidden_size,
                                 problem.intermediate_size)

    def apply(self, x, weights, topk_weights, topk_ids, *, activation, activation_params,
              apply_router_weight_on_input, expert_map, out_dtype=torch.float32):
        emap = None if expert_map is None else expert_map.to(torch.int32).contiguous()
        compiling = torch.compiler.is_compiling()
        if weights.quant is not None:
            scheme = scheme_of(weights)
            sc = weights.scales
            return (triton_quant_experts if compiling else _quant_experts)(
                x, weights.w13, weights.w2, weights.b13, weights.b2, sc["w13_scale"], sc["w2_scale"],
                sc.get("w13_zero"), sc.get("w2_zero"), sc.get("a13_scale"), sc.get("a2_scale"), topk_weights,
                topk_ids, emap, scheme.name, scheme.group_size or 0, activation, float(activation_params.alpha),
                float(activation_params.limit), bool(apply_router_weight_on_input), out_dtype)
        return (triton_fused_experts if compiling else _fused_experts)(
            x, weights.w13, weights.w2, weights.b13, weights.b2, topk_weights, topk_ids, emap, activation,
            float(activation_params.alpha), float(activation_params.limit), bool(apply_router_weight_on_input),
            out_dtype)


register_backend(TritonBackend())

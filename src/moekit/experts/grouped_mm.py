"""`grouped_mm`: sort assignments by expert, then two torch grouped GEMMs.

Pipeline: flatten (t, j) assignments -> stable sort by local expert -> gather x rows ->
grouped GEMM over w13 -> activation -> grouped GEMM over w2 -> weight -> deterministic
sum over k. GEMMs run in the weights' dtype (fp32 accumulate inside), the k-sum in fp32.

Supports: CPU (fp32, bf16) and CUDA (bf16, SM90 kernels in torch), biases, expert_map,
every activation, weights on input, autograd. No host synchronisation, so it can be
captured in a CUDA graph.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..activations import apply_activation
from .base import ExpertsBackend, ExpertsProblem, register_backend
from .common import local_ids, sort_by_expert, weighted_combine

__all__ = ["GroupedMMBackend"]

_grouped_mm = getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def _local_rows(t: torch.Tensor, valid: Optional[torch.Tensor]) -> torch.Tensor:
    """t [T*k, N] with the rows of non-local experts set to zero (valid [T*k, 1] bool; None: all local).

    grouped_mm leaves the rows past the last group unwritten, in the forward and in its
    backward, so those rows are masked where they enter and leave the GEMMs: neither their
    values nor their gradients reach the output, x, b13, b2 or topk_weights.
    """
    if valid is None:
        return t
    return torch.where(valid, t, torch.zeros((), dtype=t.dtype, device=t.device))


class GroupedMMBackend(ExpertsBackend):
    name = "grouped_mm"
    description = "torch grouped GEMM after a sort by expert"
    graph_safe = True

    def available(self) -> Optional[str]:
        if _grouped_mm is None:
            return f"torch {torch.__version__} has no grouped_mm (needs torch >= 2.8)"
        return None

    def unsupported(self, problem: ExpertsProblem) -> Optional[str]:
        if problem.quant is not None:
            return f"grouped_mm runs unquantized weights only, got quant={problem.quant!r}"
        if problem.dtype != problem.weight_dtype:
            return f"activation dtype {problem.dtype} differs from weight dtype {problem.weight_dtype}"
        size = problem.dtype.itemsize
        if (problem.hidden_size * size) % 16 or (problem.intermediate_size * size) % 16:
            return (f"torch's grouped_mm needs rows of a multiple of 16 bytes: H={problem.hidden_size} and "
                    f"I={problem.intermediate_size} must be multiples of {16 // size} in {problem.dtype}")
        if problem.device == "cpu":
            if problem.dtype not in (torch.float32, torch.bfloat16):
                return f"torch's CPU grouped_mm takes float32 or bfloat16, got {problem.dtype}"
            if problem.dtype != torch.bfloat16 and torch.compiler.is_compiling():
                return "under torch.compile torch's grouped_mm traces for bfloat16 only (its meta kernel refuses " \
                       f"{problem.dtype})"
        elif problem.device == "cuda":
            if problem.dtype != torch.bfloat16:
                return f"torch's CUDA grouped_mm takes bfloat16 only, got {problem.dtype}"
            if torch.cuda.is_available() and torch.cuda.get_device_capability() < (9, 0):
                return "torch's CUDA grouped_mm needs compute capability 9.0 or newer"
        else:
            return f"device {problem.device!r} is not supported (cpu, cuda)"
        return None

    def apply(self, x, weights, topk_weights, topk_ids, *, activation, activation_params,
              apply_router_weight_on_input, expert_map):
        T, k = topk_ids.shape
        E = weights.num_experts
        ids_flat = local_ids(topk_ids, expert_map).reshape(-1)  # [T*k]
        order, counts = sort_by_expert(ids_flat, E)  # [T*k], [E]
        offs = torch.cumsum(counts, 0).to(torch.int32)  # [E] group ends
        ids_sorted = ids_flat[order]  # [T*k]
        # [T*k, 1]; rows past offs[-1] are non-local (only with an expert_map)
        valid = None if expert_map is None else (ids_sorted >= 0).unsqueeze(-1)
        e_sorted = ids_sorted.clamp_min(0)  # only to index biases; masked below
        w_sorted = topk_weights.reshape(-1)[order].unsqueeze(-1)  # [T*k, 1] fp32
        x_sorted = x[order // k]  # [T*k, H]
        if apply_router_weight_on_input:
            x_sorted = (x_sorted.float() * w_sorted).to(x.dtype)
        x_sorted = _local_rows(x_sorted, valid)
        h = _grouped_mm(x_sorted, weights.w13.transpose(1, 2), offs=offs)  # [T*k, 2I]
        if weights.b13 is not None:
            h = h + _local_rows(weights.b13[e_sorted], valid)
        a = apply_activation(h, activation, activation_params)  # [T*k, I]
        y = _local_rows(_grouped_mm(a, weights.w2.transpose(1, 2), offs=offs), valid)  # [T*k, H]
        if weights.b2 is not None:
            y = y.float() + _local_rows(weights.b2[e_sorted].float(), valid)
        return weighted_combine(y, None if apply_router_weight_on_input else w_sorted, order, T, k)


register_backend(GroupedMMBackend())

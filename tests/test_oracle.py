"""The oracle: priority order, explicit choices never overridden, refusals explained."""

import pytest
import torch

from moekit import ExpertsProblem, choose_backend, explain
from moekit.experts.base import BACKENDS, ExpertsBackend, register_backend
from moekit.oracle import PRIORITIES, available_backends


def problem(**kw):
    base = dict(device="cpu", dtype=torch.float32, weight_dtype=torch.float32, activation="silu",
                has_bias=False, has_expert_map=False, apply_router_weight_on_input=False,
                num_experts=8, hidden_size=64, intermediate_size=32, top_k=2)
    base.update(kw)
    return ExpertsProblem(**base)


def test_auto_takes_first_supported():
    assert choose_backend(problem()).backend.name == PRIORITIES["unquantized"]["cpu"][0]


def test_explicit_choice_is_honoured():
    assert choose_backend(problem(), "reference").backend.name == "reference"
    assert choose_backend(problem(), "reference").reason == "chosen explicitly"


def test_explicit_unsupported_raises_with_reason():
    p = problem(dtype=torch.float16, weight_dtype=torch.float16)
    with pytest.raises(ValueError, match="backend='grouped_mm' cannot run .* takes float32 or bfloat16"):
        choose_backend(p, "grouped_mm")


class _Picky(ExpertsBackend):
    name = "picky_test_backend"

    def unsupported(self, problem):
        return "only serves E=3"


def test_auto_skips_refusing_backend_and_says_why(monkeypatch):
    register_backend(_Picky())
    monkeypatch.setitem(PRIORITIES["unquantized"], "cpu", ["picky_test_backend", "reference"])
    try:
        choice = choose_backend(problem())
        assert choice.backend.name == "reference"
        assert "picky_test_backend: only serves E=3" in choice.reason
        assert ("picky_test_backend", "only serves E=3") in explain(problem())
    finally:
        BACKENDS.pop("picky_test_backend")


def test_nothing_can_serve(monkeypatch):
    monkeypatch.setitem(PRIORITIES["unquantized"], "cpu", ["not_a_backend"])
    with pytest.raises(ValueError, match="no experts backend can run .* not_a_backend: not installed"):
        choose_backend(problem())


def test_available_backends_reports_reasons():
    avail = available_backends("cpu")
    assert avail["reference"] is None and avail["cpu"] is None
    if "triton" in avail:
        assert avail["triton"]  # a sentence: no GPU and no interpreter here


def test_available_backends_on_cuda_without_a_gpu_and_a_bad_device(monkeypatch):
    """available_backends("cuda") said grouped_mm and reference could run on a machine without a GPU,
    and an unknown device name was answered rather than refused."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    avail = available_backends("cuda")
    assert avail and all(reason and "no CUDA GPU here" in reason for reason in avail.values()), avail
    assert available_backends(torch.device("cpu")) == available_backends("cpu")
    with pytest.raises(ValueError, match="device must be None, 'cpu' or 'cuda', got 'tpu'"):
        available_backends("tpu")


def test_capture_needs_a_graph_safe_backend():
    # During CUDA-graph capture only backends without host reads may run; the oracle says why.
    p = problem(device="cuda", dtype=torch.bfloat16, weight_dtype=torch.bfloat16, capturing=True)
    with pytest.raises(ValueError, match="backend='reference' cannot run .* cannot be captured in a CUDA graph"):
        choose_backend(p, "reference")
    reasons = dict(explain(p))
    assert "cannot be captured" in reasons["reference"]
    assert "cannot be captured" not in (reasons.get("grouped_mm") or "")


def test_triton_refuses_static_scales_beyond_its_slots():
    """Static fp8 activation scales hold a token's slots in registers (top_k <= 32): the oracle used
    not to know a call had them, so `auto` could pick triton on CUDA and the launcher then raised."""
    pytest.importorskip("triton")
    from moekit.experts.triton_experts import TritonBackend

    def problem(k, static):
        return ExpertsProblem("cuda", torch.bfloat16, torch.float8_e4m3fn, "silu", False, False, False, 64, 256, 128,
                              k, quant="fp8_w8a8", static_scales=static)

    assert "static activation scales take top_k <= 32" in (TritonBackend().unsupported(problem(33, True)) or "")
    for k, static in ((33, False), (8, True)):
        assert "static activation scales" not in (TritonBackend().unsupported(problem(k, static)) or "")

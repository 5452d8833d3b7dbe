"""`moekit bench`: argument checks, and what the GPU paths hand to the benchmark functions
(the functions themselves run on a GPU; here they are replaced by recorders)."""

import importlib.util
import json
import sys
import types

import pytest
import torch

import moekit.benchmarks.gpu as gpu
from moekit.cli.main import main


@pytest.mark.parametrize("argv, message", [
    (["--quant", "fp8_w8a8"], "--quant times the Triton kernels, so it needs --device cuda"),
    (["--warm-ms", "100"], "--warm-ms times the Triton kernels, so it needs --device cuda"),
    (["--device", "cuda", "--quant", "fp8"], "--quant: quant must be one of"),
    (["--device", "cuda", "--quant", "int4_w4a16", "--static-scales"], "--static-scales goes with --quant fp8_w8a8"),
    (["--device", "cuda", "--quant", "fp8_w8a8", "--impls", "moekit_triton"], "--impls chooses among the peers"),
    (["--shapes", "mixtral-8x7b"], "--shapes on cpu must be among"),
    (["--device", "cuda", "--shapes", "E64-k8-H1024-I512"], "--shapes on cuda must be among"),
    (["--device", "cuda", "--quant", "fp8_w8a8", "--rounds", "0"], "--rounds must be >= 1"),
    (["--reps", "0"], "--reps must be >= 1"),
    # options that used to be silently ignored
    (["--rounds", "5"], "--rounds goes with --quant"),
    (["--device", "cuda", "--reps", "3"], "--reps sets the CPU benchmark's timing"),
    (["--device", "cuda", "--budget", "5"], "--budget sets the CPU benchmark's timing"),
    (["--M", "16", "0"], "--M takes token counts >= 1"),
    (["--impls", "moekit_auto", "bogus"], "--impls on cpu must be among"),
    (["--device", "cuda", "--impls", "hf_eager"], "--impls on cuda must be among"),
])
def test_bad_arguments_are_refused_with_the_reason(argv, message, capsys, monkeypatch):
    """Exit status 2 and the reason on stderr, as argparse refuses its own bad options (no traceback)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert main(["bench", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("moekit bench: error: ") and message in err


def test_cuda_without_a_gpu_and_an_unwritable_out_are_refused_before_timing(capsys, monkeypatch, tmp_path):
    """Both used to end in a traceback: --device cuda inside torch.cuda's lazy init, --out after the whole run."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["bench", "--device", "cuda"]) == 2
    assert "--device cuda needs a CUDA GPU" in capsys.readouterr().err
    assert main(["bench", "--M", "1", "--out", str(tmp_path / "no_such_folder" / "b.json")]) == 2
    assert "--out: no folder" in capsys.readouterr().err


def test_quant_cases_rounds_and_warm_up_reach_the_quantized_benchmark(monkeypatch, tmp_path):
    seen = {}

    def fake(out_json, cases, rounds, sustain_ms, sustain_from_m, command, progress):
        seen.update(out_json=out_json, cases=cases, rounds=rounds, sustain_ms=sustain_ms, sustain_from_m=sustain_from_m,
                    command=command)
        return {"records": [{"M": m} for _, _, _, ms in cases for m in ms]}

    monkeypatch.setattr(gpu, "run_quant_bench", fake)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    if importlib.util.find_spec("triton") is None:  # --quant needs Triton installed; the benchmark is a fake here
        monkeypatch.setitem(sys.modules, "triton", types.ModuleType("triton"))
    out = tmp_path / "q.json"
    argv = ["bench", "--device", "cuda", "--quant", "fp8_w8a8", "--static-scales", "--shapes", "qwen3-30b-a3b",
            "mixtral-8x7b", "--M", "16", "4096", "--rounds", "2", "--warm-ms", "250", "--out", str(out)]
    assert main(argv) == 0
    assert seen["cases"] == (("qwen3-30b-a3b", "fp8_w8a8", True, (16, 4096)), ("mixtral-8x7b", "fp8_w8a8", True, (16, 4096)))
    assert (seen["rounds"], seen["sustain_ms"], seen["sustain_from_m"]) == (2, 250.0, 0)
    written = json.loads(out.read_text())
    assert [r["M"] for r in written["records"]] == [16, 4096, 16, 4096]
    assert written["command"].startswith("moekit ")


def test_gpu_bench_gets_the_implementations_and_the_warm_up(monkeypatch):
    seen = {}

    def fake(shapes, Ms, out_json, impls, progress, warm_ms):
        seen.update(shapes=shapes, Ms=Ms, impls=impls, warm_ms=warm_ms)
        return {"records": []}

    monkeypatch.setattr(gpu, "run_gpu_bench", fake)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert main(["bench", "--device", "cuda", "--shapes", "olmoe-1b-7b", "--M", "1", "--impls", "moekit_triton",
                 "--warm-ms", "50"]) == 0
    assert seen == {"shapes": ["olmoe-1b-7b"], "Ms": [1], "impls": ["moekit_triton"], "warm_ms": 50.0}


def test_quant_bench_skips_a_shape_the_scheme_cannot_quantize_and_says_why():
    pytest.importorskip("triton")
    said = []
    result = gpu.run_quant_bench(None, cases=(("gpt-oss-20b", "int8_w8a16", False, (16, 4096)),), device="cpu",
                                 progress=said.append)
    assert [r["M"] for r in result["records"]] == [16, 4096]
    assert all("multiples of 128" in r["skipped"] and "group_size=64" in r["skipped"] for r in result["records"])
    assert len(said) == 1 and said[0].startswith("gpt-oss-20b int8_w8a16: skipped:")


def test_transformers_peers_without_transformers_name_the_extra(capsys, monkeypatch):
    """Without transformers, --impls hf_eager ended in a ZeroDivisionError, and a plain run left
    transformers' peers out without a word."""
    import moekit.benchmarks.cpu as cpu  # noqa: PLC0415

    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers raises ImportError
    assert main(["bench", "--impls", "hf_eager", "moekit_auto"]) == 2
    assert "transformers' experts need transformers: pip install 'moekit[hf]'" in capsys.readouterr().err
    monkeypatch.setattr(cpu, "run_cpu_bench", lambda *a, **kw: {"records": []})
    assert main(["bench", "--M", "1"]) == 0
    assert "transformers is not installed" in capsys.readouterr().err


def test_quant_without_triton_names_the_extra(capsys, monkeypatch):
    """On a GPU without Triton, --quant ended in an ImportError traceback inside the benchmark."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "triton", None)  # import triton raises ImportError
    monkeypatch.setattr(gpu, "run_quant_bench", lambda *a, **kw: pytest.fail("ran without Triton"))
    assert main(["bench", "--device", "cuda", "--quant", "fp8_w8a8"]) == 2
    assert "--quant times the Triton kernels, so it needs Triton: pip install 'moekit[gpu]'" in capsys.readouterr().err

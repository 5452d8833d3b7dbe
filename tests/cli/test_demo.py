"""`moekit demo` runs at its default small size, checks, and reports; --model takes a local folder."""

import pytest

pytest.importorskip("transformers")

from moekit.cli.main import main  # noqa: E402


def test_demo_default_passes(capsys):
    assert main(["demo"]) == 0
    out = capsys.readouterr().out
    assert "built-in tiny DeepSeek-V3" in out and "all checks passed" in out
    assert "greedy ids identical   32/32" in out
    for layer in ("model.layers.0.mlp", "model.layers.1.mlp"):
        line = next(ln for ln in out.splitlines() if ln.startswith(layer))
        counts = [int(c) for c in line.split()[-8:]]  # 8 experts, top-2
        assert sum(counts) == (8 + 32 - 1) * 2  # the prompt, then every generated token but the last
    assert "decode tokens/s" in out and "prefill tokens/s (256-token prompt)" in out and "transformers eager" in out


def test_demo_prefill_timing_can_be_skipped(capsys):
    assert main(["demo", "--tokens", "2", "--prefill-tokens", "0"]) == 0
    out = capsys.readouterr().out
    assert "decode tokens/s" in out and "prefill" not in out


def test_demo_on_a_local_checkpoint_in_bf16(tmp_path, capsys):
    from moekit.cli.demo import tiny_deepseek_v3

    tiny_deepseek_v3(seed=3).save_pretrained(tmp_path)
    assert main(["demo", "--model", str(tmp_path), "--tokens", "4", "--dtype", "bfloat16"]) == 0
    out = capsys.readouterr().out
    assert str(tmp_path) in out and "all checks passed" in out


@pytest.mark.parametrize("argv, message", [
    (["--tokens", "0"], "--tokens and --prompt-tokens must be >= 1"),
    (["--prefill-tokens", "-1"], "--prefill-tokens must be >= 0"),
    (["--rounds", "0"], "--rounds must be >= 1"),
    # these two used to fail only after the models were built, in a traceback
    (["--backend", "no_such_backend"], "--backend: backend must be 'auto' or one of"),
    (["--model", "/no/such/folder"], "--model must be a local checkpoint folder with config.json"),
])
def test_demo_rejects_bad_arguments(argv, message, capsys):
    """Exit status 2 and the reason on stderr (no traceback), before any model is built."""
    assert main(["demo", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("moekit demo: error: ") and message in err


def test_demo_refuses_a_backend_that_cannot_run_the_model(capsys):
    """cpu_int8 runs int8_w8a8 only: the unquantized demo model used to fail in its first forward, in a traceback."""
    assert main(["demo", "--backend", "cpu_int8", "--tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert "moekit demo: error: --backend cpu_int8: " in err and "backend='cpu_int8' can never run" in err
    assert "int8_w8a8" in err


def test_demo_refuses_a_model_moekit_cannot_patch(tmp_path, capsys):
    """A folder of a family patch_model refuses used to end in a traceback."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("phimoe", hidden_size=32, intermediate_size=16, num_hidden_layers=1,
                                  num_attention_heads=2, num_key_value_heads=2, vocab_size=64, num_local_experts=4)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    assert main(["demo", "--model", str(tmp_path), "--tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert f"moekit demo: error: --model {tmp_path}: cannot patch these sparse-MoE blocks" in err


def test_demo_exit_status_follows_the_check(monkeypatch, capsys):
    """A logits comparison that fails (here forced to inf) makes the command fail."""
    from moekit.cli import demo

    monkeypatch.setattr(demo, "_rel_err", lambda out, ref: float("inf"))
    assert main(["demo", "--tokens", "2"]) == 1
    assert "CHECKS FAILED" in capsys.readouterr().out

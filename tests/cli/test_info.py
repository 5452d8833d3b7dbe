"""`moekit info` lists every backend and the oracle's pick with reasons, and with --tiles the
Triton tiles of a shape at each M with where they come from."""

import pytest
import torch

from moekit.cli.main import main


def test_info_lists_backends_and_choice(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    for name in ("reference", "grouped_mm", "cpu"):
        assert name in out
    assert "-> cpu: chosen" in out
    router = next(line for line in out.splitlines() if line.startswith("router: "))
    assert "torch ops on CPU tensors" in router and "one Triton launch on CUDA" in router


def test_info_shows_refusals(capsys):
    assert main(["info", "--dtype", "float16"]) == 0
    out = capsys.readouterr().out
    assert "grouped_mm: refused: torch's CPU grouped_mm takes float32 or bfloat16" in out


def test_no_command_prints_help(capsys):
    assert main([]) == 2


def test_info_says_where_each_m_takes_its_tiles_from(capsys, monkeypatch):
    pytest.importorskip("triton")
    assert main(["info", "--tiles", "mixtral-8x7b", "--device-name", "NVIDIA_H200", "--M", "1", "128", "300"]) == 0
    out = capsys.readouterr().out
    assert "E=8, k=2, H=4096, I=14336, bfloat16 on NVIDIA_H200" in out
    for m, entry in ((1, 1), (128, 128), (300, 256)):  # nearest M
        assert f"E=8,N=14336,device_name=NVIDIA_H200.json, entry M = {entry}" in out.split(f"M={m:6d}")[1].split("\n")[0]
    # an untuned shape: the heuristic off Hopper, the H200 rules on one
    assert main(["info", "--tiles", "64,6,2048,1408", "--quant", "fp8_w8a8", "--M", "4096"]) == 0
    assert "quant_config of default_config" in capsys.readouterr().out
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    from moekit.cli import info  # noqa: PLC0415

    info.print_tiles("64,6,2048,1408", [16, 4096], torch.bfloat16, None, "NO_SUCH_GPU")
    out = capsys.readouterr().out
    assert "default_config" in out.split("M=    16")[1].split("M=")[0] and "hopper_default" in out.split("M=  4096")[1]
    from moekit.quant import get_scheme  # noqa: PLC0415

    info.print_tiles("64,6,2048,1408", [4096], torch.bfloat16, get_scheme("int8_w8a8"), "NO_SUCH_GPU")
    assert "untuned_w8a8" in capsys.readouterr().out


@pytest.mark.parametrize("argv,match", [(["--tiles", "3,4,5,6"], "k <= E"), (["--tiles", "8,2,x,4"], "four integers"),
                                        (["--tiles", "no-such-model"], "shape must be one of"),
                                        (["--tiles", "8,2,64,64", "--M", "0"], "--M must be >= 1")])
def test_info_tiles_refuses_bad_shapes(argv, match, capsys):
    """Refused on stderr before the report (a bad shape used to be named after the whole report)."""
    assert main(["info", *argv]) == 2
    out, err = capsys.readouterr()
    assert err.startswith("moekit info: error: ") and match in err and out == ""


def test_info_refuses_tile_options_without_tiles(capsys):
    """--M and --device-name were silently ignored without --tiles."""
    assert main(["info", "--M", "16"]) == 2
    assert "moekit info: error: without --tiles SHAPE, --M would be ignored" in capsys.readouterr().err
    assert main(["info", "--device-name", "NVIDIA_H200", "--M", "1"]) == 2
    assert "without --tiles SHAPE, --M and --device-name would be ignored" in capsys.readouterr().err


def test_info_refuses_an_unknown_activation_and_scheme(capsys):
    """An unknown --activation used to be accepted, and the oracle reported a backend 'chosen' for it."""
    with pytest.raises(SystemExit) as exit_:
        main(["info", "--activation", "no_such_act"])
    assert exit_.value.code == 2 and "argument --activation: invalid choice: 'no_such_act'" in capsys.readouterr().err
    assert main(["info", "--quant", "no_such_scheme"]) == 2
    assert "moekit info: error: --quant: quant must be one of" in capsys.readouterr().err


def test_info_tiles_without_triton_names_the_extra(capsys, monkeypatch):
    """Without Triton, --tiles ended in a traceback after the whole report."""
    import sys  # noqa: PLC0415

    monkeypatch.setitem(sys.modules, "triton", None)  # import triton raises ImportError
    assert main(["info", "--tiles", "qwen3-30b-a3b"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "--tiles needs Triton" in err and "moekit[gpu]" in err


def test_info_lists_triton_where_it_is_not_installed(capsys, monkeypatch):
    """The backend list left 'triton' out without a word where Triton is not installed."""
    from moekit.experts import base  # noqa: PLC0415

    monkeypatch.delitem(base.BACKENDS, "triton", raising=False)
    assert main(["info"]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.strip().startswith("triton "))
    assert "no: not installed" in line and "pip install 'moekit[gpu]'" in line

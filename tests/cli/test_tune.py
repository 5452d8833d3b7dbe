"""`moekit tune`: its options are checked before the GPU is looked for (the search itself runs on a GPU)."""

import pytest
import torch

from moekit.cli.main import main


@pytest.mark.parametrize("argv, message", [
    ([], "give --shape or all of --experts, --top-k, --hidden, --intermediate"),
    (["--experts", "8", "--top-k", "2", "--hidden", "0", "--intermediate", "64"], "--hidden must be >= 1, got 0"),
    (["--experts", "4", "--top-k", "8", "--hidden", "64", "--intermediate", "64"], "--top-k must be <= --experts"),
    (["--shape", "olmoe-1b-7b", "--batch-sizes", "1,x"], "--batch-sizes must be comma-separated integers"),
    (["--shape", "olmoe-1b-7b", "--batch-sizes", "0,16"], "--batch-sizes must hold token counts >= 1"),
    (["--shape", "olmoe-1b-7b", "--workers", "0"], "--workers must be >= 1"),
    (["--shape", "olmoe-1b-7b", "--budget", "-1"], "--budget must be > 0 seconds"),
    (["--shape", "olmoe-1b-7b", "--quant", "int8_w8a16", "--static-scales"], "--static-scales goes with --quant fp8_w8a8"),
])
def test_bad_options_exit_2_before_the_gpu_check(argv, message, capsys, monkeypatch):
    """Bad options used to exit 1, and --batch-sizes was only read after the GPU check."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["tune", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("moekit tune: error: ") and message in err


def test_out_dir_that_is_a_file_is_refused(tmp_path, capsys):
    path = tmp_path / "a_file"
    path.write_text("")
    assert main(["tune", "--shape", "olmoe-1b-7b", "--out-dir", str(path)]) == 2
    assert "--out-dir must be a folder" in capsys.readouterr().err


def test_no_gpu_is_a_clear_refusal(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="moekit tune needs a CUDA GPU"):
        main(["tune", "--shape", "olmoe-1b-7b"])


def test_gpu_without_triton_names_the_extra(monkeypatch):
    """On a GPU without Triton, tune ended in an ImportError traceback from moekit.kernels."""
    import sys  # noqa: PLC0415

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "triton", None)  # import triton raises ImportError
    with pytest.raises(SystemExit, match=r"needs Triton: `pip install moekit\[gpu\]`"):
        main(["tune", "--shape", "olmoe-1b-7b"])

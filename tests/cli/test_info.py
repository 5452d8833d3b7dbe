"""`moekit info` lists every backend and the oracle's pick with reasons."""

from moekit.cli.main import main


def test_info_lists_backends_and_choice(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    for name in ("reference", "grouped_mm", "cpu"):
        assert name in out
    assert "-> cpu: chosen" in out


def test_info_shows_refusals(capsys):
    assert main(["info", "--dtype", "float16"]) == 0
    out = capsys.readouterr().out
    assert "grouped_mm: refused: torch's CPU grouped_mm takes float32 or bfloat16" in out


def test_no_command_prints_help(capsys):
    assert main([]) == 2

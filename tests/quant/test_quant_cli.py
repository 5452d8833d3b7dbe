"""`moekit info --quant SCHEME`: what would run here, and why every other backend would not."""

from moekit.cli.main import main


def test_info_quant_shows_the_choice_and_the_refusals(capsys):
    assert main(["info", "--quant", "int8_w8a8"]) == 0
    out = capsys.readouterr().out
    assert "oracle for cpu float32 int8_w8a8" in out
    assert "-> cpu_int8: chosen" in out
    assert "not in the 'int8' priority list for cpu" in out
    assert "cpu_wo: refused: runs weight-only schemes" in out
    assert "cpu: refused: unquantized weights only, got quant='int8_w8a8'" in out


def test_info_fp8_on_cpu_runs_the_emulation(capsys):
    assert main(["info", "--quant", "fp8_w8a8_block128", "--dtype", "bfloat16"]) == 0
    out = capsys.readouterr().out
    assert "-> reference: chosen" in out
    assert "cpu_int8: refused: runs quant='int8_w8a8' only, got quant='fp8_w8a8_block128'" in out


def test_info_unknown_scheme_is_a_clear_error(capsys):
    assert main(["info", "--quant", "int3"]) == 2
    assert "quant must be one of" in capsys.readouterr().err


def test_info_tiles_refuses_a_shape_the_scheme_cannot_take(capsys):
    """Regression: --quant int4_w4a16 --tiles printed tiles for H=1000, I=500, which the scheme refuses."""
    assert main(["info", "--quant", "int4_w4a16", "--tiles", "8,2,1000,500", "--M", "1"]) == 2
    got = capsys.readouterr()
    assert "quant='int4_w4a16' needs hidden_size and intermediate_size to be multiples of 128" in got.err
    assert got.out == ""  # refused before the report

"""README starts with exactly the two quickstart commands, and .ci/run runs the second."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_readme_commands_and_ci():
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)\n```", text, re.S)
    assert len(blocks) >= 2
    first, second = blocks[0].strip(), blocks[1].strip()
    assert first.startswith("pip install") and "moekit" in first
    assert "pytest" in second
    # the commands come first: only the title precedes them
    head = text.split("```bash")[0].strip().splitlines()
    assert head == ["# moekit"]
    ci = (ROOT / ".ci" / "run").read_text()
    assert "README.md" in ci

"""`import moekit` stays light: transformers is registered with on import, not imported by us."""

import subprocess
import sys


def _run(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()


def test_import_moekit_does_not_import_transformers():
    assert _run("import sys, moekit; print('transformers' in sys.modules)") == "False"


def test_registered_once_transformers_loads_its_moe_module():
    code = ("import moekit\nfrom transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS\n"
            "print('moekit' in ALL_EXPERTS_FUNCTIONS)")
    assert _run(code) == "True"


def test_registered_when_transformers_came_first():
    code = ("import transformers.integrations.moe\nimport moekit\n"
            "from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS\nprint('moekit' in ALL_EXPERTS_FUNCTIONS)")
    assert _run(code) == "True"

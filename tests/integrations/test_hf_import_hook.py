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


def test_a_failing_registration_does_not_break_transformers_import():
    """With moekit's integration unable to load (an incompatible transformers, simulated here),
    importing transformers' MoE module after `import moekit` raised moekit's ImportError."""
    code = ("import sys, warnings, moekit\n"
            "class Refuse:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name == 'moekit.integrations.transformers':\n"
            "            raise ImportError('simulated incompatible transformers')\n"
            "sys.meta_path.insert(1, Refuse())\n"
            "with warnings.catch_warnings(record=True) as seen:\n"
            "    warnings.simplefilter('always')\n"
            "    import transformers.integrations.moe\n"
            "print([str(w.message) for w in seen if 'moekit' in str(w.message)])")
    out = _run(code)
    assert "could not register its 'moekit' experts implementation" in out
    assert "simulated incompatible transformers" in out
    # transformers first: `import moekit` itself raised
    code = ("import sys, warnings, transformers.integrations.moe\n"
            "class Refuse:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name == 'moekit.integrations.transformers':\n"
            "            raise ImportError('simulated incompatible transformers')\n"
            "sys.meta_path.insert(0, Refuse())\n"
            "with warnings.catch_warnings(record=True) as seen:\n"
            "    warnings.simplefilter('always')\n"
            "    import moekit\n"
            "print(moekit.FusedMoE.__name__, [str(w.message) for w in seen if 'moekit' in str(w.message)])")
    out = _run(code)
    assert out.startswith("FusedMoE") and "could not register its 'moekit' experts implementation" in out

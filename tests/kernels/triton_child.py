"""Run a test file again in a child process with Triton's interpreter on.

TRITON_INTERPRET is read when moekit and the kernels are imported, so interpreter cases
cannot share a process with the rest of the suite: each interpreter test module has one
parent test that re-runs the module in a child with the variable set.
"""

import os
import subprocess
import sys

import pytest

IN_INTERPRETER = os.environ.get("MOEKIT_TEST_IN_INTERPRETER") == "1"


def run_in_interpreter(test_file: str, timeout_s: float = 900) -> None:
    """Run pytest on `test_file` under TRITON_INTERPRET=1; fail with the child's output tail.

    timeout_s only stops a hung child: on a 2-core AMD Zen 3 host the prefill file alone took
    327 s (over the former 300 s limit inside a full run)."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", MOEKIT_TEST_IN_INTERPRETER="1")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", os.path.abspath(test_file)],
        env=env, capture_output=True, text=True, timeout=timeout_s,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(test_file))))
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]

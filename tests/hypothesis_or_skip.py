"""hypothesis's `given`, `settings` and `strategies as st` for the property tests, or, where
hypothesis is not installed (it comes with `pip install -e ".[test]"`), stand-ins under which
those tests are collected and skipped while the rest of their file runs."""

import pytest

try:
    from hypothesis import given, settings
    from hypothesis import strategies as st
except ImportError:
    class _NoStrategies:
        """Any strategy built at import time (st.integers(0, 4), ...) is a placeholder."""

        def __getattr__(self, name):
            return lambda *args, **kwargs: None

    st = _NoStrategies()

    def settings(*args, **kwargs):
        return lambda test: test

    def given(*args, **kwargs):
        return pytest.mark.skip(reason="property test: needs hypothesis (pip install -e '.[test]')")

__all__ = ["given", "settings", "st"]

"""Register moekit with transformers without importing transformers at `import moekit`.

Importing transformers' MoE module costs seconds; most moekit users (and every spawned
worker process) never touch it. So `import moekit` registers the "moekit" experts
implementation right away only when transformers' MoE module is already loaded, and
otherwise installs a post-import hook that registers it the moment transformers loads
that module (which every MoE model file does before a model can name an
experts_implementation). A registration that fails (an incompatible transformers) is a
warning, never a failure of `import moekit` or of transformers' own import.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import warnings
from typing import Callable

__all__ = ["register_when_imported", "TARGET"]

TARGET = "transformers.integrations.moe"


class _PostImportFinder(importlib.abc.MetaPathFinder):
    """Finds `target` through the other finders and runs `callback` after it executes."""

    def __init__(self, target: str, callback: Callable[[], None]) -> None:
        self.target = target
        self.callback = callback

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.target:
            return None
        sys.meta_path.remove(self)  # one shot; also keeps the lookup below from recursing
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module
        callback = self.callback

        def exec_and_register(module):
            exec_module(module)
            callback()

        spec.loader.exec_module = exec_and_register
        return spec


def _register() -> None:
    # moekit.integrations.transformers registers itself when its import completes; if it is
    # the module whose import brought transformers' MoE module in, it is mid-import here.
    if __package__ + ".transformers" in sys.modules:
        return
    try:
        importlib.import_module(__package__ + ".transformers")
    except Exception as err:  # noqa: BLE001 - neither `import moekit` nor transformers' import may fail for it
        warnings.warn(f"moekit could not register its 'moekit' experts implementation with transformers "
                      f"({type(err).__name__}: {err}); `import moekit.hf` raises the full error", stacklevel=2)


def register_when_imported() -> None:
    """Register now if transformers' MoE module is loaded, else when it gets imported."""
    if TARGET in sys.modules:
        _register()
        return
    if importlib.util.find_spec("transformers") is None:
        return  # transformers not installed: nothing to register with
    if not any(isinstance(f, _PostImportFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _PostImportFinder(TARGET, _register))

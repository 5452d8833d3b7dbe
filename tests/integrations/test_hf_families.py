"""Every experts class of the installed transformers against its eager forward, through "moekit".

The classes are found, not listed: each model family whose modeling file uses transformers'
`@use_experts_implementation` is scanned for modules whose forward takes (hidden_states,
top_k_index, top_k_weights). Each is built from its family's default config shrunk to a tiny
size and must either match transformers' eager experts (fp32, 1e-5 relative) or be refused
with a ValueError naming its class. A class this harness cannot build small is skipped with
the reason, so a new transformers release that adds a family moekit computes wrongly fails here.
"""

import glob
import importlib
import inspect
import os
import re

import pytest
import torch

pytest.importorskip("transformers")

import transformers  # noqa: E402
from transformers import PretrainedConfig  # noqa: E402

import moekit  # noqa: E402, F401  (registers "moekit")

from conftest import rel_err  # noqa: E402

_SIZES = {"hidden_size": 64, "intermediate_size": 32, "moe_intermediate_size": 32, "expert_intermediate_size": 32,
          "ffn_hidden_size": 32, "moe_ffn_hidden_size": 32}
_EXPERT_COUNT = re.compile(r"(num_(local_|routed_)?experts|n_routed_experts|moe_num_experts|n_experts)$")
_MAX_PARAMS = 5_000_000


def _families():
    root = os.path.join(os.path.dirname(transformers.__file__), "models")
    found = []
    for path in sorted(glob.glob(os.path.join(root, "*", "modeling_*.py"))):
        with open(path, encoding="utf-8") as f:
            if "use_experts_implementation" in f.read():
                found.append((os.path.basename(os.path.dirname(path)), os.path.basename(path)[:-3]))
    return found


def _shrink(config: PretrainedConfig) -> None:
    """Tiny sizes in place: hidden 64, expert intermediate 32, 4 experts (nested configs too)."""
    for name, value in list(vars(config).items()):
        if isinstance(value, PretrainedConfig):
            _shrink(value)
        elif isinstance(value, bool) or not (value is None or isinstance(value, int)):
            continue
        elif name in _SIZES:
            setattr(config, name, _SIZES[name])
        elif _EXPERT_COUNT.search(name):
            setattr(config, name, 4)
        elif isinstance(value, int) and "intermediate" in name and value > 64:
            setattr(config, name, 32)


def _experts_classes(module):
    for obj in vars(module).values():
        if inspect.isclass(obj) and obj.__module__ == module.__name__ and issubclass(obj, torch.nn.Module):
            params = list(inspect.signature(obj.forward).parameters)
            if params[1:4] == ["hidden_states", "top_k_index", "top_k_weights"] and hasattr(obj, "_apply_gate"):
                yield obj


def _build(family: str, cls):
    """(module, config) of cls at tiny size, or a string saying why it could not be built."""
    try:
        configs = importlib.import_module(f"transformers.models.{family}.configuration_{family}")
    except ImportError as err:
        return f"no configuration module: {err}"
    why = "no config class"
    extra = (0,) if "layer_idx" in inspect.signature(cls.__init__).parameters else ()
    for config_cls in [c for c in vars(configs).values() if inspect.isclass(c) and issubclass(c, PretrainedConfig)
                       and c.__module__ == configs.__name__]:
        for nested in (None, "text_config"):
            try:
                config = config_cls()
                _shrink(config)
                config = config if nested is None else getattr(config, nested, None)
                if config is None:
                    continue
                with torch.device("meta"):
                    size = sum(p.numel() for p in cls(config, *extra).parameters())
                if size > _MAX_PARAMS:
                    why = f"{config_cls.__name__} stays at {size} parameters"
                    continue
                torch.manual_seed(0)
                return cls(config, *extra), config
            except Exception as err:  # noqa: BLE001 (any config this harness cannot shrink)
                why = f"{config_cls.__name__}: {type(err).__name__}: {str(err)[:120]}"
    return why


CASES = []
for _family, _module_name in _families():
    try:
        _module = importlib.import_module(f"transformers.models.{_family}.{_module_name}")
    except Exception:  # noqa: BLE001 (a family needing an extra package)
        continue
    CASES += [(_family, c) for c in _experts_classes(_module)]


@pytest.mark.parametrize("family,cls", CASES, ids=[f"{f}-{c.__name__}" for f, c in CASES])
def test_experts_class_matches_eager_or_is_refused_by_name(family, cls):
    built = _build(family, cls)
    if isinstance(built, str):
        pytest.skip(f"{cls.__name__} not built at a tiny size here: {built}")
    module, config = built
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.2)
    E = module.num_experts
    H = getattr(module, "hidden_dim", None) or config.hidden_size
    gen = torch.Generator().manual_seed(1)
    config._experts_implementation = "eager"
    for k in (2, 1):  # 1: classes fed one route a row with unit weight (Ergo's projections)
        x = torch.randn(9, H, generator=gen)
        ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(9)])
        w = torch.rand(9, k, generator=gen) if k > 1 else torch.ones(9, 1)
        try:
            with torch.no_grad():
                want = module(x, ids, w)
            break
        except (IndexError, RuntimeError) as err:
            why = f"{type(err).__name__}: {err}"
    else:
        pytest.skip(f"{cls.__name__}: its eager forward takes other inputs ({why})")
    with torch.no_grad():
        config._experts_implementation = "moekit"
        try:
            out = module(x, ids, w)
        except ValueError as err:
            assert cls.__name__ in str(err), err  # a refusal names the class and says why
            return
    assert rel_err(out, want) <= 1e-5, rel_err(out, want)


def test_the_families_moekit_reproduces_are_found():
    """The harness finds the families the README counts (the scan is not silently empty)."""
    names = {c.__name__ for _, c in CASES}
    for cls in ("MixtralExperts", "Qwen3MoeExperts", "DeepseekV3Experts"):
        assert cls in names

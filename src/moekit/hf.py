"""moekit inside Hugging Face transformers 5.x models (needs `pip install 'moekit[hf]'`).

Three ways in, from the least to the most moekit:

1. Experts implementation. `import moekit` registers "moekit" with transformers, so
   `from_pretrained(path, experts_implementation="moekit")` or
   `model.set_experts_implementation("moekit")` runs every experts module through moekit's
   `fused_experts`; routers and shared experts stay transformers' own.
2. Whole-block replacement. `patch_model(model)` swaps each sparse-MoE block (router,
   experts, shared experts) for a FusedMoE, for Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE,
   DeepSeek-V2, DeepSeek-V3, MiniMax-M2, Jamba, HunYuan-V3, Laguna, Lara-mini, MiMo-V2-Flash,
   MiniCPM-5-MoE, Granite-MoE, Ernie-4.5-MoE, Cohere2-MoE, GPT-OSS and code-identical clones;
   other blocks are refused by name.
3. Loading. `from_pretrained(path)` builds the model from its config, patches it and
   loads the safetensors checkpoint (legacy per-expert or stacked layout, single file or
   sharded) straight into the canonical layout with `load_checkpoint`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, List, Optional, Union

import torch
import torch.nn as nn

from .integrations.checkpoint import CheckpointError, SafetensorsCheckpoint, load_model_checkpoint
from .integrations.transformers import (
    EXPERTS_IMPLEMENTATION,
    ExpertsLayout,
    experts_layout,
    moekit_experts_forward,
    register_experts_implementation,
)
from .integrations.transformers_blocks import MoEBlock, family_of, moe_blocks, patch_model
from .integrations.transformers_families import FAMILIES, BlockFamily

__all__ = [
    "EXPERTS_IMPLEMENTATION",
    "register_experts_implementation",
    "moekit_experts_forward",
    "experts_layout",
    "ExpertsLayout",
    "patch_model",
    "family_of",
    "moe_blocks",
    "MoEBlock",
    "BlockFamily",
    "FAMILIES",
    "load_checkpoint",
    "from_pretrained",
    "CheckpointError",
    "SafetensorsCheckpoint",
]


def load_checkpoint(model: nn.Module, path: Union[str, Path, SafetensorsCheckpoint], *, strict: bool = True) -> List[str]:
    """Load a safetensors checkpoint into a (patched) transformers model.

    MoE blocks replaced by `patch_model` read their router, experts (per-expert or stacked
    layout) and shared experts through moekit's converter; every other parameter and
    persistent buffer is read by its name. Nothing is copied unless everything fits. A path
    that does not fit as stored is read again through the renamings transformers applies to
    the model type's original checkpoints (HunYuan-V3's `mlp.router.gate`, Laguna's
    `mlp.shared_expert.`, ...); when neither fits, the error with fewer problems is raised.

    Args:
        model: the model, usually after `patch_model`.
        path: checkpoint file, index json or folder (see SafetensorsCheckpoint).
        strict: a checkpoint tensor that the model does not use is an error.
    Returns:
        The checkpoint keys that were loaded.
    Raises:
        CheckpointError (a ValueError) naming each missing, unexpected or mis-shaped tensor.
    """
    blocks = moe_blocks(model)
    layers = {name: (block.moe, block.checkpoint_keys(name)) for name, block in blocks.items()}
    if isinstance(path, SafetensorsCheckpoint):
        return load_model_checkpoint(model, path, layers, strict=strict)
    try:
        return load_model_checkpoint(model, path, layers, strict=strict)
    except CheckpointError as as_stored:
        rename = checkpoint_renaming(getattr(getattr(model, "config", None), "model_type", None))
        if rename is None:
            raise
        try:
            return load_model_checkpoint(model, SafetensorsCheckpoint(path, rename=rename), layers, strict=strict)
        except CheckpointError as renamed:
            raise (renamed if str(renamed).count("\n") < str(as_stored).count("\n") else as_stored) from None


def checkpoint_renaming(model_type: Optional[str]) -> Optional[Callable[[str], str]]:
    """transformers' key renamings for a model type's original checkpoints (its conversion
    mapping's WeightRenaming entries; the expert merges are moekit's own), or None when the
    installed transformers has none."""
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping  # noqa: PLC0415
        from transformers.core_model_loading import WeightRenaming, apply_renamings  # noqa: PLC0415
    except ImportError:
        return None
    if model_type is None:
        return None
    renamings = [t for t in (get_checkpoint_conversion_mapping(model_type) or []) if isinstance(t, WeightRenaming)]
    if not renamings:
        return None
    return lambda key: apply_renamings(key, renamings)


def from_pretrained(path: Union[str, Path], *, dtype: torch.dtype = torch.float32, backend: str = "auto",
                    device: Optional[Union[str, torch.device]] = None) -> nn.Module:
    """Build a *ForCausalLM from a local checkpoint folder, patch it, and load it with moekit.

    Args:
        path: a folder with config.json and safetensors weights (no download happens).
        dtype: parameter dtype, a floating torch.dtype or its name ("bfloat16").
        backend: FusedMoE backend ("auto": the oracle picks).
        device: where to move the model afterwards (None: stay on CPU).
    Returns:
        The model in eval mode.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig  # noqa: PLC0415

    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise ValueError(f"path must be a local checkpoint folder with config.json, got {str(path)!r}")
    named = getattr(torch, dtype, None) if isinstance(dtype, str) else dtype
    if not isinstance(named, torch.dtype) or not named.is_floating_point:
        raise ValueError(f"dtype must be a floating torch.dtype or its name, got {dtype!r}")
    dtype = named
    if device is not None:
        device = torch.device(device)  # a bad device string fails here, before the checkpoint is read
    config = AutoConfig.from_pretrained(folder)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    if (folder / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(folder)
    patch_model(model, backend=backend)
    load_checkpoint(model, folder)
    if device is not None:
        model = model.to(device)
    return model.eval()

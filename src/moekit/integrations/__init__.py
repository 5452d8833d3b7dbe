"""Integrations: safetensors checkpoints (`checkpoint`) and Hugging Face transformers
(`transformers`: the "moekit" experts implementation; `transformers_blocks`: whole-block
replacement; `transformers_state`: the replaced blocks' names in state_dict). The transformers
modules need `pip install 'moekit[hf]'` and are imported on demand (see moekit.hf)."""

from .checkpoint import (
    CheckpointError,
    MoEKeys,
    SafetensorsCheckpoint,
    canonical_layout,
    deinterleave_gate_up,
    interleave_gate_up,
    load_fused_moe,
    load_model_checkpoint,
)

__all__ = [
    "CheckpointError",
    "MoEKeys",
    "SafetensorsCheckpoint",
    "canonical_layout",
    "deinterleave_gate_up",
    "interleave_gate_up",
    "load_fused_moe",
    "load_model_checkpoint",
]

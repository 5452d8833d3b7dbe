"""Quantized experts: schemes as data, quantize/dequantize, checkpoints, the reference emulation.

Schemes ("fp8_w8a8", "fp8_w8a8_channel", "fp8_w8a8_block128", "int8_w8a8", "int8_w8a16",
"int4_w4a16") and their stored layout: moekit.quant.schemes. Each scheme belongs to one
precision, and each precision has its own oracle priority list (added here).
"""

from ..oracle import PRIORITIES
from .checkpoint import load_deepseek_fp8, load_quantized, save_quantized
from .emulate import TOLERANCE, dequantize_expert, emulated_experts
from .layout import check_quantized_weights, logical_intermediate_size, scheme_of
from .quantize import (
    QuantizedWeight,
    check_fits,
    dequantize_activation,
    dequantize_weight,
    fake_quantize_activation,
    pack_int4,
    quantize_activation,
    quantize_experts,
    quantize_weight,
    unpack_int4,
)
from .schemes import (
    LAYER_ERROR_BOUND,
    SCHEMES,
    QuantScheme,
    get_scheme,
    precision_of_scheme,
    register_scheme,
    scheme_names,
)

# precision -> device -> backends in order of preference. fp8 on CPU runs the reference
# emulation (torch has float8 storage on CPU but no fp8 GEMM).
for _precision, _prio in {
    "fp8": {"cuda": ["triton", "reference"], "cpu": ["reference"], "other": ["reference"]},
    "int8": {"cuda": ["triton", "reference"], "cpu": ["cpu_int8", "reference"], "other": ["reference"]},
    "int8_w8a16": {"cuda": ["triton", "reference"], "cpu": ["cpu_wo", "reference"], "other": ["reference"]},
    "int4_w4a16": {"cuda": ["triton", "reference"], "cpu": ["cpu_wo", "reference"], "other": ["reference"]},
}.items():
    PRIORITIES.setdefault(_precision, _prio)

__all__ = [
    "QuantScheme",
    "SCHEMES",
    "LAYER_ERROR_BOUND",
    "get_scheme",
    "register_scheme",
    "scheme_names",
    "precision_of_scheme",
    "QuantizedWeight",
    "check_fits",
    "quantize_weight",
    "dequantize_weight",
    "pack_int4",
    "unpack_int4",
    "quantize_activation",
    "dequantize_activation",
    "fake_quantize_activation",
    "quantize_experts",
    "scheme_of",
    "logical_intermediate_size",
    "check_quantized_weights",
    "emulated_experts",
    "TOLERANCE",
    "dequantize_expert",
    "save_quantized",
    "load_quantized",
    "load_deepseek_fp8",
]

"""Quantization schemes as data: registry, options, precisions and the oracle's lists."""

import dataclasses

import pytest
import torch

from moekit import FusedMoE, RoutingConfig
from moekit.oracle import PRIORITIES, precision_of
from moekit.quant import QuantScheme, get_scheme, precision_of_scheme, scheme_names

EXPECTED = {
    # name: (precision, weight dtype, weight granularity, activation granularity)
    "fp8_w8a8": ("fp8", "fp8_e4m3", "tensor", "tensor"),
    "fp8_w8a8_channel": ("fp8", "fp8_e4m3", "channel", "token"),
    "fp8_w8a8_block128": ("fp8", "fp8_e4m3", "block", "group"),
    "int8_w8a8": ("int8", "int8", "channel", "token"),
    "int8_w8a16": ("int8_w8a16", "int8", "group", None),
    "int4_w4a16": ("int4_w4a16", "int4", "group", None),
}


def test_registry_holds_every_scheme_of_the_issue():
    assert set(scheme_names()) == set(EXPECTED)
    for name, (precision, wdt, wgran, agran) in EXPECTED.items():
        s = get_scheme(name)
        assert (s.precision, s.weight_dtype, s.weight_granularity, s.activation_granularity) == (
            precision, wdt, wgran, agran)
        assert precision_of_scheme(name) == precision == precision_of(name)
        assert s.weight_only == (agran is None)


def test_block_scheme_is_128x128_with_1x128_activation_groups():
    s = get_scheme("fp8_w8a8_block128")
    assert s.weight_block == (128, 128) and s.activation_group == 128 and s.column_multiple == 128


@pytest.mark.parametrize("name", ["int8_w8a16", "int4_w4a16"])
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("symmetric", [True, False])
def test_weight_only_options(name, group_size, symmetric):
    s = get_scheme(name, group_size=group_size, symmetric=symmetric)
    assert (s.name, s.group_size, s.symmetric) == (name, group_size, symmetric)
    assert s.column_multiple == group_size
    expected = torch.int8 if (name == "int8_w8a16" and symmetric) else torch.uint8
    assert s.storage_dtype() == expected


def test_defaults_are_group_128_symmetric():
    for name in ("int8_w8a16", "int4_w4a16"):
        s = get_scheme(name)
        assert s.group_size == 128 and s.symmetric


def test_int4_packs_two_per_byte():
    assert get_scheme("int4_w4a16").pack == 2 and get_scheme("int8_w8a16").pack == 1


@pytest.mark.parametrize("kwargs, match", [
    (dict(group_size=48), "group_size must be one of"),
    (dict(group_size=True), "group_size must be one of"),
    (dict(group_size=64.0), "group_size must be one of"),  # == 64, but a float breaks the views by group
    (dict(symmetric="no"), "symmetric must be a bool"),
])
def test_bad_options_are_errors(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        get_scheme("int4_w4a16", **kwargs)


def test_options_on_w8a8_schemes_are_errors():
    with pytest.raises(ValueError, match="apply to weight-only schemes"):
        get_scheme("fp8_w8a8", group_size=64)


def test_unknown_name_lists_the_known_ones():
    with pytest.raises(ValueError, match=r"quant must be one of \[.*'int4_w4a16'.*got 'int3'"):
        get_scheme("int3")
    with pytest.raises(TypeError, match="scheme name"):
        get_scheme(4)


def test_scheme_validation_names_the_field():
    with pytest.raises(ValueError, match="int4 weights need 'group' granularity"):
        QuantScheme("x", "x", "int4", "channel")
    with pytest.raises(ValueError, match="zero points"):
        QuantScheme("x", "x", "fp8_e4m3", "channel", symmetric=False)
    with pytest.raises(ValueError, match="group_size must be one of"):
        QuantScheme("x", "x", "int4", "group", group_size=32.0)
    with pytest.raises(ValueError, match="activation_dtype and activation_granularity"):
        QuantScheme("x", "x", "int8", "channel", activation_dtype="int8")


def test_each_precision_has_its_priority_list():
    assert PRIORITIES["fp8"]["cpu"] == ["reference"]  # no fp8 GEMM on CPU: the emulation runs
    assert PRIORITIES["int8"]["cpu"] == ["cpu_int8", "reference"]
    for p in ("int8_w8a16", "int4_w4a16"):
        assert PRIORITIES[p]["cpu"] == ["cpu_wo", "reference"]
    for p in ("fp8", "int8", "int8_w8a16", "int4_w4a16"):
        assert PRIORITIES[p]["cuda"][-1] == "reference"


def test_a_scheme_object_must_match_the_registered_scheme_of_its_name():
    """Regression: weights carry only the scheme's name, so an unregistered QuantScheme built a
    layer that failed at its first call, and a changed copy of a registered one (int8 activations
    per tensor under the name "int8_w8a8") quantized one way and ran the registered scheme."""
    custom = QuantScheme("my_int8", "int8", "int8", "channel", activation_dtype="int8", activation_granularity="token")
    with pytest.raises(ValueError, match="'my_int8' is not registered"):
        get_scheme(custom)
    changed = dataclasses.replace(get_scheme("int8_w8a8"), activation_granularity="tensor")
    with pytest.raises(ValueError, match="differs from the registered scheme of that name"):
        get_scheme(changed)
    with pytest.raises(ValueError, match="differs from the registered scheme"):
        FusedMoE(4, 128, 128, RoutingConfig(top_k=2), quant=changed)
    variant = dataclasses.replace(get_scheme("int4_w4a16"), group_size=64, symmetric=False)  # options are fine
    assert get_scheme(variant) == get_scheme("int4_w4a16", group_size=64, symmetric=False)

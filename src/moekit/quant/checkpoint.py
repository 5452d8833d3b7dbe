"""Load and save pre-quantized expert weights (safetensors).

moekit's own format (every scheme), one or more layers per file, each under a prefix:

    {prefix}w13              the stored weights, [E, 2I or I, H / pack]
    {prefix}w2               [E, H, I / pack]
    {prefix}b13, {prefix}b2  optional float biases [E, 2I or I], [E, H]
    {prefix}scales.{name}    every entry of ExpertWeights.scales ("w13_scale", "w2_zero", ...)
    metadata: "moekit.format" = "quantized-experts", "moekit.version" = "1",
              "{prefix}quant" = the scheme name

The shapes and dtypes of each scheme are those of moekit.quant.schemes; the group size and
zero points of weight-only schemes follow from the scales.

DeepSeek-V3 style fp8 checkpoints store each expert's projections separately:
`{prefix}.{e}.gate_proj.weight` float8_e4m3fn [I, H] with `.weight_scale_inv` fp32
[I/128, H/128] (a dequantization multiplier per 128x128 block, despite the name), likewise
up_proj, and down_proj [H, I] with [H/128, I/128]. `load_deepseek_fp8` stacks them into
"fp8_w8a8_block128" ExpertWeights.
"""

from __future__ import annotations

import os
from typing import Callable, Dict, Iterable, List, Mapping, Optional, Tuple, Union

import torch

from ..experts.base import ExpertWeights
from .layout import check_quantized_weights, scheme_of
from .schemes import get_scheme

__all__ = ["save_quantized", "load_quantized", "load_deepseek_fp8", "FORMAT", "FORMAT_VERSION"]

FORMAT = "quantized-experts"
FORMAT_VERSION = "1"

Source = Union[str, os.PathLike, Iterable[Union[str, os.PathLike]], Mapping[str, torch.Tensor]]


def _safetensors():
    try:
        import safetensors.torch  # noqa: PLC0415
        from safetensors import safe_open  # noqa: PLC0415
    except ImportError as err:  # pragma: no cover - safetensors is a core dependency
        raise ImportError("reading checkpoints needs the safetensors package: pip install safetensors") from err
    return safetensors.torch, safe_open


def _check_layout(weights: ExpertWeights, where: str) -> None:
    rows, I = weights.w13.shape[1], weights.w2.shape[2] * get_scheme(weights.quant).pack
    if rows not in (I, 2 * I):
        raise ValueError(f"{where}: w13 must have 2I={2 * I} (gated) or I={I} rows, got {tuple(weights.w13.shape)}")
    check_quantized_weights(weights, weights.w2.shape[1], "silu" if rows == 2 * I else "silu_no_mul")
    _check_values(weights, where)


def _check_values(weights: ExpertWeights, where: str) -> None:
    """Raise ValueError for values the quantizer never writes: non-finite scales, static activation
    scales <= 0, int4 zero points above 15 (a corrupted file would run and give NaN or garbage)."""
    scheme = scheme_of(weights)
    for name, t in weights.scales.items():
        if name.endswith("_zero"):
            if scheme.weight_dtype == "int4" and t.numel() and int(t.max()) > 15:
                raise ValueError(f"{where}: scales[{name!r}] holds {int(t.max())}; int4 zero points lie in [0, 15]")
        elif not bool(torch.isfinite(t).all()):
            raise ValueError(f"{where}: scales[{name!r}] holds non-finite values (inf or NaN)")
        elif name.startswith("a") and not bool((t > 0).all()):
            raise ValueError(f"{where}: scales[{name!r}] (static activation scales) must be > 0")


def save_quantized(path: Union[str, os.PathLike], layers: Union[ExpertWeights, Mapping[str, ExpertWeights]]) -> None:
    """Write quantized ExpertWeights to a safetensors file in moekit's format.

    Args:
        path: the file to write.
        layers: one ExpertWeights (stored under prefix "") or {prefix: ExpertWeights}.
    """
    st, _ = _safetensors()
    if isinstance(layers, ExpertWeights):
        layers = {"": layers}
    tensors: Dict[str, torch.Tensor] = {}
    metadata = {"moekit.format": FORMAT, "moekit.version": FORMAT_VERSION}
    storages = set()

    def own(t: torch.Tensor) -> torch.Tensor:
        # safetensors refuses tensors that share memory (one tensor passed as both a13_scale and
        # a2_scale, a layer saved under two prefixes): each is written from its own copy
        t = t.detach().contiguous().cpu()
        ptr = t.untyped_storage().data_ptr()
        if ptr in storages:
            t = t.clone()
        storages.add(t.untyped_storage().data_ptr())
        return t

    for prefix, w in layers.items():
        if not isinstance(w, ExpertWeights) or w.quant is None:
            raise ValueError(f"layers[{prefix!r}] must be quantized ExpertWeights (quant set), got "
                             f"{type(w).__name__}{'' if not isinstance(w, ExpertWeights) else ' with quant=None'}")
        _check_layout(w, f"layers[{prefix!r}]")
        metadata[f"{prefix}quant"] = w.quant
        for name, t in (("w13", w.w13), ("w2", w.w2), ("b13", w.b13), ("b2", w.b2)):
            if t is not None:
                tensors[prefix + name] = own(t)
        for name, t in w.scales.items():
            tensors[f"{prefix}scales.{name}"] = own(t)
    st.save_file(tensors, os.fspath(path), metadata=metadata)


def load_quantized(path: Union[str, os.PathLike], prefix: str = "", device=None) -> ExpertWeights:
    """Read one layer of quantized ExpertWeights written by save_quantized.

    Args:
        path: a safetensors file in moekit's format.  prefix: the layer's prefix.
        device: where to put the tensors (default CPU).
    """
    _, safe_open = _safetensors()
    with safe_open(os.fspath(path), framework="pt", device="cpu") as f:
        meta = f.metadata() or {}
        if meta.get("moekit.format") != FORMAT:
            raise ValueError(f"{os.fspath(path)} is not a moekit quantized-experts file "
                             f"(metadata moekit.format={meta.get('moekit.format')!r}, expected {FORMAT!r})")
        if meta.get("moekit.version") != FORMAT_VERSION:
            raise ValueError(f"{os.fspath(path)} has format version {meta.get('moekit.version')!r}; "
                             f"this moekit reads version {FORMAT_VERSION!r}")
        quant = meta.get(f"{prefix}quant")
        if quant is None:
            found = sorted(k[:-len("quant")] for k in meta if k.endswith("quant"))
            raise ValueError(f"{os.fspath(path)} holds no layer with prefix {prefix!r} (prefixes: {found})")
        get_scheme(quant)
        keys = set(f.keys())
        tensors = {k[len(prefix):]: f.get_tensor(k) for k in keys if k.startswith(prefix)}
    for name in ("w13", "w2"):
        if name not in tensors:
            raise ValueError(f"{os.fspath(path)} lacks tensor {prefix + name!r}")
    scales = {k[len("scales."):]: v for k, v in tensors.items() if k.startswith("scales.")}
    dev = torch.device(device) if device is not None else torch.device("cpu")
    w = ExpertWeights(
        tensors["w13"].to(dev), tensors["w2"].to(dev),
        None if "b13" not in tensors else tensors["b13"].to(dev),
        None if "b2" not in tensors else tensors["b2"].to(dev),
        scales={k: v.to(dev) for k, v in scales.items()}, quant=quant,
    )
    _check_layout(w, f"{os.fspath(path)} prefix {prefix!r}")
    return w


def _getter(source: Source) -> Tuple[Callable[[str], Optional[torch.Tensor]], List[str]]:
    """(key -> tensor or None if absent, every key) over a dict, a safetensors file, a folder or a list of files."""
    if isinstance(source, Mapping):
        return source.get, list(source.keys())
    _, safe_open = _safetensors()
    if isinstance(source, (str, os.PathLike)):
        p = os.fspath(source)
        if os.path.isdir(p):
            files = sorted(os.path.join(p, n) for n in os.listdir(p) if n.endswith(".safetensors"))
            if not files:
                raise ValueError(f"{p} holds no .safetensors files")
        elif os.path.isfile(p):
            files = [p]
        else:
            raise ValueError(f"source {p!r} is neither a file nor a folder")
    else:
        files = [os.fspath(s) for s in source]
    where: Dict[str, str] = {}
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as f:
            for k in f.keys():
                where[k] = file

    def get(key: str) -> Optional[torch.Tensor]:
        if key not in where:
            return None
        with safe_open(where[key], framework="pt", device="cpu") as f:
            return f.get_tensor(key)

    return get, list(where)


def load_deepseek_fp8(source: Source, prefix: str, num_experts: int, device=None) -> ExpertWeights:
    """Stack a DeepSeek-V3 style fp8 block-quantized MoE layer into "fp8_w8a8_block128" ExpertWeights.

    Args:
        source: {name: tensor}, a .safetensors file, a folder of them, or a list of files.
        prefix: the experts' name prefix, e.g. "model.layers.3.mlp.experts".
        num_experts: E; experts 0..E-1 must all be present, and no other.
        device: where to put the result (default CPU).
    Returns:
        ExpertWeights: w13 [E, 2I, H] and w2 [E, H, I] float8_e4m3fn, scales w13_scale
        [E, 2I/128, H/128] and w2_scale [E, H/128, I/128] fp32.
    """
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts must be an int >= 1, got {num_experts!r}")
    get, keys = _getter(source)
    ids = (k[len(prefix) + 1:].split(".", 1)[0] for k in keys if k.startswith(prefix + "."))
    held = sorted({int(e) for e in ids if e.isdigit()})  # the expert ids under prefix
    if held and held[-1] >= num_experts:
        raise ValueError(f"the checkpoint holds {len(held)} experts under {prefix!r} (ids up to {held[-1]}), "
                         f"but num_experts={num_experts}; pass the layer's expert count (none is dropped)")
    w13, w2, s13, s2 = [], [], [], []
    for e in range(num_experts):
        parts = {}
        for proj in ("gate_proj", "up_proj", "down_proj"):
            for suffix in ("weight", "weight_scale_inv"):
                key = f"{prefix}.{e}.{proj}.{suffix}"
                t = get(key)
                if t is None:
                    raise ValueError(f"checkpoint lacks {key!r} (expert {e} of num_experts={num_experts})")
                if suffix == "weight" and t.dtype != torch.float8_e4m3fn:
                    raise TypeError(f"{key} must be float8_e4m3fn, got {t.dtype}")
                if suffix == "weight_scale_inv" and not t.is_floating_point():
                    raise TypeError(f"{key} must be a float tensor, got {t.dtype}")
                if suffix == "weight_scale_inv" and not bool(torch.isfinite(t).all()):
                    raise ValueError(f"{key} holds non-finite values (inf or NaN)")
                parts[proj, suffix] = t
        gate, up, down = (parts[p, "weight"] for p in ("gate_proj", "up_proj", "down_proj"))
        I, H = gate.shape
        if tuple(up.shape) != (I, H) or tuple(down.shape) != (H, I):
            raise ValueError(f"expert {e}: gate_proj [I, H], up_proj [I, H] and down_proj [H, I] must agree, got "
                             f"{tuple(gate.shape)}, {tuple(up.shape)}, {tuple(down.shape)}")
        if I % 128 or H % 128:
            raise ValueError(f"expert {e}: fp8_w8a8_block128 needs H and I to be multiples of 128 "
                             f"(gate and up blocks are stacked), got H={H}, I={I}")
        for proj, shape in (("gate_proj", (I // 128, H // 128)), ("up_proj", (I // 128, H // 128)),
                            ("down_proj", (H // 128, I // 128))):
            got = tuple(parts[proj, "weight_scale_inv"].shape)
            if got != shape:
                raise ValueError(f"{prefix}.{e}.{proj}.weight_scale_inv must be {list(shape)} (one per 128x128 "
                                 f"block), got {list(got)}")
        w13.append(torch.cat((gate, up)))
        w2.append(down)
        s13.append(torch.cat((parts["gate_proj", "weight_scale_inv"], parts["up_proj", "weight_scale_inv"])).float())
        s2.append(parts["down_proj", "weight_scale_inv"].float())
        if len({tuple(w.shape) for w in w13}) != 1:
            raise ValueError(f"expert {e} has shape {tuple(w13[-1].shape)} for gate|up, expert 0 {tuple(w13[0].shape)}")
    dev = torch.device(device) if device is not None else torch.device("cpu")
    w = ExpertWeights(torch.stack(w13).to(dev), torch.stack(w2).to(dev),
                      scales={"w13_scale": torch.stack(s13).to(dev), "w2_scale": torch.stack(s2).to(dev)},
                      quant="fp8_w8a8_block128")
    _check_layout(w, f"prefix {prefix!r}")
    return w

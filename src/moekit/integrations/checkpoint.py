"""Loading safetensors checkpoints into FusedMoE's canonical layout.

A checkpoint is one `.safetensors` file, or a folder holding `model.safetensors` or a
sharded `model.safetensors.index.json`. One MoE block's tensors sit under a prefix (for
example "model.layers.3.mlp.") in one of two layouts, named as in transformers:

    per expert (legacy)  experts.{e}.gate_proj|up_proj|down_proj.weight  (Mixtral: w1|w3|w2)
                         [I, H], [I, H], [H, I]
    stacked (5.x)        experts.gate_up_proj [E, 2I, H], experts.down_proj [E, H, I]
                         transposed ([E, H, 2I], [E, I, H]) and/or gate/up interleaved (gpt-oss),
                         experts.gate_up_proj_bias [E, 2I], experts.down_proj_bias [E, H]

beside the router ({router}.weight [E, H], {router}.bias [E],
{router}.e_score_correction_bias [E]) and shared experts ({shared}.gate_proj|up_proj|down_proj.weight,
{shared_gate}.weight [1, H]). Everything is checked against the layer's shapes from the file
headers before a byte is copied: a missing, unexpected or mis-shaped tensor raises
CheckpointError naming the key and the expected shape, and nothing is loaded. Tensors are
converted to the canonical layout once, here, and copied into the layer's parameters; a
quantized layer (FusedMoE(quant=...)) takes its float experts, in either layout, stacked
through FusedMoE.load_weights, which quantizes them on load.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn
from safetensors import safe_open

from ..activations import is_gated
from ..experts.base import ExpertWeights

__all__ = [
    "CheckpointError",
    "SafetensorsCheckpoint",
    "MoEKeys",
    "canonical_layout",
    "deinterleave_gate_up",
    "interleave_gate_up",
    "load_fused_moe",
    "load_model_checkpoint",
]

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
LEGACY_EXPERT_NAMES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))
_MAX_LISTED = 20
_FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")  # float8 needs scales: not loaded as plain floats


class CheckpointError(ValueError):
    """A checkpoint that does not fit the model: each line names a key and what was expected."""


def canonical_layout(up: torch.Tensor, down: torch.Tensor, up_bias: Optional[torch.Tensor] = None,
                     down_bias: Optional[torch.Tensor] = None, *, transposed: bool = False,
                     interleaved: bool = False) -> ExpertWeights:
    """Stacked expert tensors -> canonical layout (views when nothing moves).

    Args:
        up: gate_up_proj [E, 2I, H] ([E, H, 2I] transposed), or up_proj [E, I, H] for non-gated experts.
        down: down_proj [E, H, I] ([E, I, H] transposed).
        up_bias: [E, 2I] or None.  down_bias: [E, H] or None.
        transposed: weights stored as [in, out] per expert.
        interleaved: gate and up alternate along 2I (gate even, up odd), as in gpt-oss.
    Returns:
        ExpertWeights(w13 [E, 2I, H], w2 [E, H, I], b13 [E, 2I], b2 [E, H]), contiguous copies
        whenever the layout changed.
    """
    w13 = up.transpose(1, 2) if transposed else up  # [E, 2I, H]
    w2 = down.transpose(1, 2) if transposed else down  # [E, H, I]
    b13 = up_bias
    if interleaved:
        w13 = deinterleave_gate_up(w13)
        if up_bias is not None:
            b13 = deinterleave_gate_up(up_bias)
    if transposed:
        w13, w2 = w13.contiguous(), w2.contiguous()
    return ExpertWeights(w13, w2, b13, down_bias)


def deinterleave_gate_up(t: torch.Tensor) -> torch.Tensor:
    """Gate and up alternating along dim 1 (gate even, up odd) -> gate rows, then up rows.

    Args:
        t: [E, 2I, ...] (w13 [E, 2I, H] or b13 [E, 2I]).
    """
    return torch.cat((t[:, 0::2], t[:, 1::2]), dim=1)


def interleave_gate_up(t: torch.Tensor) -> torch.Tensor:
    """Inverse of deinterleave_gate_up: [E, 2I, ...] gate rows then up rows -> alternating."""
    gate, up = t.chunk(2, dim=1)  # [E, I, ...] each
    return torch.stack((gate, up), dim=2).flatten(1, 2)


def _shape(s: Sequence[int]) -> str:
    return "[" + ", ".join(str(int(d)) for d in s) + "]"


class SafetensorsCheckpoint:
    """Read-only access to a safetensors checkpoint by tensor name (headers read once).

    Args:
        path: a .safetensors file, a model.safetensors.index.json, or a folder with either.
        rename: stored name -> the name the tensor is read by (e.g. a family's original
            checkpoint names to transformers' module names), or None.
    """

    def __init__(self, path: Union[str, Path], rename: Optional[Callable[[str], str]] = None) -> None:
        self.path = Path(path)
        self._handles: Dict[Path, object] = {}
        self._where: Dict[str, Path] = {}
        self._stored: Dict[str, str] = {}  # read name -> stored name, where they differ
        for file, expected in self._files().items():
            keys = set(self._handle(file).keys())
            if expected is not None:
                stray = sorted(keys - expected)
                if stray:
                    raise CheckpointError(f"{file}: tensor {stray[0]!r} is in the shard but not in the index json")
                absent = sorted(expected - keys)
                if absent:
                    raise CheckpointError(f"{file}: the index json lists tensor {absent[0]!r} but the shard lacks it")
            for stored in sorted(keys):
                key = stored if rename is None else rename(stored)
                if key in self._where:
                    raise CheckpointError(f"tensor {key!r} appears twice: as {self._stored.get(key, key)!r} in "
                                          f"{self._where[key]} and as {stored!r} in {file}")
                self._where[key] = file
                if key != stored:
                    self._stored[key] = stored
        self._keys = sorted(self._where)

    def _files(self) -> Dict[Path, Optional[set]]:
        """file -> the keys the index assigns to it (None for an unsharded checkpoint)."""
        p = self.path
        if p.is_dir():
            if (p / INDEX_NAME).is_file():
                p = p / INDEX_NAME
            elif (p / SINGLE_NAME).is_file():
                p = p / SINGLE_NAME
            else:
                found = sorted(p.glob("*.safetensors"))
                if len(found) != 1:
                    raise CheckpointError(
                        f"{self.path}: expected {SINGLE_NAME}, {INDEX_NAME} or a single *.safetensors file, "
                        f"found {[f.name for f in found]}")
                p = found[0]
        if not p.is_file():
            raise CheckpointError(f"{p}: no such checkpoint file or folder")
        if not p.name.endswith(".json"):
            return {p: None}
        try:
            weight_map = json.loads(p.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as err:
            raise CheckpointError(f"{p}: not a safetensors index (needs a 'weight_map' object): {err}") from None
        files: Dict[Path, set] = {}
        for key, name in weight_map.items():
            files.setdefault(p.parent / name, set()).add(key)
        return files

    def _handle(self, file: Path):
        if file not in self._handles:
            if not file.is_file():
                raise CheckpointError(f"{file}: shard named in the index json does not exist")
            try:
                self._handles[file] = safe_open(str(file), framework="pt", device="cpu")
            except Exception as err:  # safetensors raises its own error type for a damaged file
                raise CheckpointError(f"{file}: not a readable safetensors file ({err})") from None
        return self._handles[file]

    def keys(self) -> List[str]:
        return self._keys

    def __contains__(self, key: str) -> bool:
        return key in self._where

    def shape(self, key: str) -> Tuple[int, ...]:
        return tuple(self._handle(self._where[key]).get_slice(self._stored.get(key, key)).get_shape())

    def dtype(self, key: str) -> str:
        """The stored dtype as safetensors names it ("BF16", "F32", "I64", ...)."""
        return self._handle(self._where[key]).get_slice(self._stored.get(key, key)).get_dtype()

    def get(self, key: str) -> torch.Tensor:
        if key not in self._where:
            raise CheckpointError(f"{self.path}: no tensor named {key!r}")
        try:
            return self._handle(self._where[key]).get_tensor(self._stored.get(key, key))
        except Exception as err:
            raise CheckpointError(f"{self._where[key]}: tensor {key!r} cannot be read ({err})") from None


@dataclass(frozen=True)
class MoEKeys:
    """Where one MoE block's tensors live in a checkpoint (transformers' names).

    Fields:
        prefixes: candidate block prefixes, each ending in "." (e.g. "model.layers.0.mlp.",
            "model.layers.0.block_sparse_moe."); exactly one may hold tensors.
        router: the router's name ("gate", "router").  experts: the experts' name.
        correction_bias: the selection bias's name (None: "{router}.e_score_correction_bias").
        correction_bias_2d: that bias is stored as [1, E] rather than [E].
        shared: the shared-expert MLP's name, or None.  shared_gate: the Linear(H, 1) scaling
            the shared output through a sigmoid, or None.
        transposed / interleaved: layout of the stacked experts.gate_up_proj / down_proj.
    """

    prefixes: Tuple[str, ...]
    router: str = "gate"
    correction_bias: Optional[str] = None
    correction_bias_2d: bool = False
    experts: str = "experts"
    shared: Optional[str] = None
    shared_gate: Optional[str] = None
    transposed: bool = False
    interleaved: bool = False


# A load plan: key -> (expected shape, writer or None, whether a float dtype is expected).
# Writers copy into the model's tensors; None marks expert tensors converted together.
_Plan = Dict[str, Tuple[Tuple[int, ...], Optional[Callable[[torch.Tensor], None]], bool]]
# A group of expert tensors read together: (their keys, tensors by key -> canonical ExpertWeights).
_Group = Tuple[List[str], Callable[[Dict[str, torch.Tensor]], ExpertWeights]]


def _entry(shape, dst: torch.Tensor):
    return tuple(shape), (lambda src: dst.copy_(src)), dst.is_floating_point()


def _block_prefix(ckpt: SafetensorsCheckpoint, keys: MoEKeys, example: str, example_shape) -> str:
    present = [p for p in keys.prefixes if any(k.startswith(p) for k in ckpt.keys())]
    if len(present) > 1:
        raise CheckpointError(f"tensors for one MoE block under several prefixes {present}; expected one of them")
    if not present:
        raise CheckpointError(
            f"missing tensor {keys.prefixes[0] + example!r} (expected shape {_shape(example_shape)}); "
            f"no tensor starts with any of {list(keys.prefixes)}")
    return present[0]


def _float_shapes(layer) -> Tuple[int, int, int, int]:
    """(E, rows, H, I) of the experts the layer holds, as float tensors: rows = 2I (gated) or I.

    Quantized storage packs its last dim (int4: H/2), so its float shapes come from shape13/shape2.
    """
    ex = layer.experts
    E, rows, H = ex.w13.shape if layer.quant is None else ex.shape13
    I = (ex.w2.shape if layer.quant is None else ex.shape2)[2]
    return E, rows, H, I


def _per_expert_stack(parts: Dict[str, List[Tuple[str, ...]]]):
    """Per-expert tensors -> canonical ExpertWeights stacked over E.

    Args:
        parts: "w13", "w2" (and "b13", "b2" with biases) -> per expert e, the keys whose
            tensors are concatenated into row block e (w13: gate then up, or up alone).
    """
    def stack(tensors: Dict[str, torch.Tensor]) -> ExpertWeights:
        out = {name: torch.stack([torch.cat([tensors[k] for k in ks]) for ks in per_expert])
               for name, per_expert in parts.items()}  # w13 [E, 2I or I, H], w2 [E, H, I], b13, b2
        return ExpertWeights(out["w13"], out["w2"], out.get("b13"), out.get("b2"))
    return stack


def _expert_plan(layer, ckpt, p: str, keys: MoEKeys, plan: _Plan, groups: List[_Group]) -> None:
    ex = layer.experts
    E, rows, H, I = _float_shapes(layer)
    gated = is_gated(layer.activation)
    has_bias = ex.b13 is not None
    up_name = "gate_up_proj" if gated else "up_proj"
    base = f"{p}{keys.experts}."
    if base + up_name in ckpt:  # stacked layout
        t = keys.transposed
        up_shape, down_shape = ((E, H, rows), (E, I, H)) if t else ((E, rows, H), (E, H, I))
        names = [(base + up_name, up_shape), (base + "down_proj", down_shape)]
        if has_bias:
            names += [(base + up_name + "_bias", (E, rows)), (base + "down_proj_bias", (E, H))]
        for key, shape in names:
            plan[key] = (shape, None, True)  # converted together below
        order = [key for key, _ in names]
        groups.append((order, lambda tensors: canonical_layout(
            *[tensors[k] for k in order], transposed=keys.transposed, interleaved=keys.interleaved)))
        return
    packed = [k for k in ckpt.keys() if k.startswith(base) and k.endswith(("_blocks", "_scales"))]
    if packed:
        raise CheckpointError(
            f"tensor {packed[0]!r}: quantized experts (blocks/scales, e.g. MXFP4) are not supported; "
            f"expected {base + up_name!r} in a float dtype")
    legacy = next((n for n in LEGACY_EXPERT_NAMES if f"{base}0.{n[2]}.weight" in ckpt), LEGACY_EXPERT_NAMES[0])
    g, u, d = legacy
    if layer.quant is not None:
        # Quantized storage cannot take one expert's float rows: stack all experts in float
        # and quantize on load (the same numbers as loading the stacked layout).
        ups = (g, u) if gated else (u,)
        parts = {"w13": [tuple(f"{base}{e}.{n}.weight" for n in ups) for e in range(E)],
                 "w2": [(f"{base}{e}.{d}.weight",) for e in range(E)]}
        shapes = {"w13": (I, H), "w2": (H, I)}
        if has_bias:
            parts.update(b13=[tuple(f"{base}{e}.{n}.bias" for n in ups) for e in range(E)],
                         b2=[(f"{base}{e}.{d}.bias",) for e in range(E)])
            shapes.update(b13=(I,), b2=(H,))
        for name, per_expert in parts.items():
            for key in (k for ks in per_expert for k in ks):
                plan[key] = (shapes[name], None, True)  # converted together below
        groups.append(([k for per_expert in parts.values() for ks in per_expert for k in ks],
                       _per_expert_stack(parts)))
        return
    for e in range(E):
        if gated:
            plan[f"{base}{e}.{g}.weight"] = _entry((I, H), ex.w13.data[e, :I])
            plan[f"{base}{e}.{u}.weight"] = _entry((I, H), ex.w13.data[e, I:])
        else:
            plan[f"{base}{e}.{u}.weight"] = _entry((I, H), ex.w13.data[e])
        plan[f"{base}{e}.{d}.weight"] = _entry((H, I), ex.w2.data[e])
        if has_bias:
            if gated:
                plan[f"{base}{e}.{g}.bias"] = _entry((I,), ex.b13.data[e, :I])
                plan[f"{base}{e}.{u}.bias"] = _entry((I,), ex.b13.data[e, I:])
            else:
                plan[f"{base}{e}.{u}.bias"] = _entry((I,), ex.b13.data[e])
            plan[f"{base}{e}.{d}.bias"] = _entry((H,), ex.b2.data[e])


def _moe_plan(layer, ckpt: SafetensorsCheckpoint, keys: MoEKeys):
    """Plan the load of one FusedMoE; returns (prefix, plan, expert groups loaded through load_weights)."""
    E, H = layer.num_experts, layer.hidden_size
    router_w = f"{keys.router}.weight"
    p = _block_prefix(ckpt, keys, router_w if layer.gate is not None else f"{keys.experts}.0.gate_proj.weight",
                      (E, H) if layer.gate is not None else (layer.intermediate_size, H))
    plan: _Plan = {}
    groups: List[_Group] = []
    if layer.gate is not None:
        plan[p + router_w] = _entry((E, H), layer.gate.weight.data)
        if layer.gate.bias is not None:
            plan[f"{p}{keys.router}.bias"] = _entry((E,), layer.gate.bias.data)
    if layer.e_score_correction_bias is not None:
        bias = layer.e_score_correction_bias
        plan[p + (keys.correction_bias or f"{keys.router}.e_score_correction_bias")] = _entry(
            (1, E), bias.view(1, E)) if keys.correction_bias_2d else _entry((E,), bias)
    _expert_plan(layer, ckpt, p, keys, plan, groups)
    if layer.shared is not None:
        if keys.shared is None:
            raise CheckpointError(f"the layer has shared experts but MoEKeys.shared names none (block {p!r})")
        sh = layer.shared
        I_s = sh.down.shape[1]
        s = f"{p}{keys.shared}."
        if is_gated(sh.activation):
            plan[s + "gate_proj.weight"] = _entry((I_s, H), sh.gate_up.data[:I_s])
            plan[s + "up_proj.weight"] = _entry((I_s, H), sh.gate_up.data[I_s:])
        else:
            plan[s + "up_proj.weight"] = _entry((I_s, H), sh.gate_up.data)
        plan[s + "down_proj.weight"] = _entry((H, I_s), sh.down.data)
        if sh.gate is not None:
            if keys.shared_gate is None:
                raise CheckpointError(
                    f"the layer's shared experts are gated but MoEKeys.shared_gate names none (block {p!r})")
            plan[f"{p}{keys.shared_gate}.weight"] = _entry((1, H), sh.gate.data)
    return p, plan, groups


def _check(ckpt: SafetensorsCheckpoint, plan: _Plan, problems: List[str]) -> None:
    for key, (shape, _, floating) in plan.items():
        if key not in ckpt:
            problems.append(f"missing tensor {key!r} (expected shape {_shape(shape)})")
            continue
        got = ckpt.shape(key)
        if tuple(got) != tuple(shape):
            problems.append(f"tensor {key!r} has shape {_shape(got)}, expected {_shape(shape)}")
        elif (ckpt.dtype(key) in _FLOAT_DTYPES) != floating:
            want = "a float dtype (F64/F32/F16/BF16)" if floating else "an integer or bool dtype"
            problems.append(f"tensor {key!r} has dtype {ckpt.dtype(key)}, expected {want}")


def _raise(ckpt: SafetensorsCheckpoint, problems: List[str]) -> None:
    if problems:
        more = len(problems) - _MAX_LISTED
        lines = problems[:_MAX_LISTED] + ([f"... and {more} more"] if more > 0 else [])
        raise CheckpointError(f"checkpoint {ckpt.path} does not fit the model:\n  " + "\n  ".join(lines))


def _open(checkpoint) -> SafetensorsCheckpoint:
    return checkpoint if isinstance(checkpoint, SafetensorsCheckpoint) else SafetensorsCheckpoint(checkpoint)


@torch.no_grad()
def load_fused_moe(layer: nn.Module, checkpoint, keys: MoEKeys) -> List[str]:
    """Load one FusedMoE's router, experts and shared experts from a checkpoint.

    Args:
        layer: a moekit.FusedMoE.
        checkpoint: a SafetensorsCheckpoint or a path (see SafetensorsCheckpoint).
        keys: where the block's tensors live (MoEKeys).
    Returns:
        The checkpoint keys consumed. Every key under the block's prefix must be consumed.
    """
    return load_model_checkpoint(None, checkpoint, {"": (layer, keys)}, strict=False)


@torch.no_grad()
def load_model_checkpoint(model: Optional[nn.Module], checkpoint, moe_layers: Dict[str, Tuple[nn.Module, MoEKeys]],
                          *, strict: bool = True) -> List[str]:
    """Load a whole model: its FusedMoE layers through MoEKeys, every other tensor by its name.

    Args:
        model: the nn.Module, or None to load only `moe_layers`.
        checkpoint: a SafetensorsCheckpoint or a path.
        moe_layers: module name in `model` -> (FusedMoE, MoEKeys). Parameters under these
            names are loaded through the MoE plan, not by name.
        strict: a checkpoint tensor the model does not use is an error (tensors under an MoE
            block's prefix are always checked).
    Returns:
        The checkpoint keys consumed.
    """
    _refuse_meta(model, moe_layers)
    ckpt = _open(checkpoint)
    problems: List[str] = []
    plan: _Plan = {}
    expert_groups: List[Tuple[nn.Module, _Group]] = []
    for _, (layer, keys) in moe_layers.items():
        try:
            p, moe_plan, groups = _moe_plan(layer, ckpt, keys)
        except CheckpointError as err:
            problems.append(str(err))
            continue
        for key in ckpt.keys():
            if key.startswith(p) and key not in moe_plan:
                problems.append(f"unexpected tensor {key!r} under MoE block {p[:-1]!r}")
        plan.update(moe_plan)
        expert_groups += [(layer, group) for group in groups]
    if model is not None:
        _named_plan(model, ckpt, [n for n in moe_layers if n], plan)
    _check(ckpt, plan, problems)
    if strict:
        problems += [f"unexpected tensor {k!r} (the model has no parameter or buffer of that name)"
                     for k in ckpt.keys() if k not in plan]
    _raise(ckpt, problems)
    for key, (_, write, _) in plan.items():
        if write is not None:
            write(ckpt.get(key))
    for layer, (names, convert) in expert_groups:
        w = convert({n: ckpt.get(n) for n in names})
        layer.load_weights(w.w13, w.w2, w.b13, w.b2)  # quantizes on load for a quantized layer
    return sorted(plan)


def _refuse_meta(model: Optional[nn.Module], moe_layers: Dict[str, Tuple[nn.Module, MoEKeys]]) -> None:
    """A load copies into the existing tensors, and a copy into a meta tensor writes nothing."""
    modules = [("", model)] if model is not None else [(name, layer) for name, (layer, _) in moe_layers.items()]
    for prefix, module in modules:
        for name, t in itertools.chain(module.named_parameters(), module.named_buffers()):
            if t.is_meta:
                full = f"{prefix}.{name}" if prefix else name
                raise CheckpointError(
                    f"{full} is on the meta device, where loading writes nothing; materialize the model first "
                    "(e.g. model.to_empty(device='cpu'), then load)")


def _named_plan(model: nn.Module, ckpt: SafetensorsCheckpoint, moe_names: Iterable[str], plan: _Plan) -> None:
    """Add every parameter and persistent buffer outside the MoE layers, by name; tied tensors
    (same storage) are satisfied by any one of their names."""
    skip = tuple(n + "." for n in moe_names)
    groups: Dict[Tuple, List[Tuple[str, torch.Tensor]]] = {}
    for name, t in model.state_dict(keep_vars=True).items():
        if name.startswith(skip):
            continue
        groups.setdefault((t.data_ptr(), tuple(t.shape), t.dtype) if t.numel() else (name,), []).append((name, t))
    for names in groups.values():
        present = [(n, t) for n, t in names if n in ckpt]
        for n, t in present or names[:1]:
            plan[n] = _entry(tuple(t.shape), t.data)

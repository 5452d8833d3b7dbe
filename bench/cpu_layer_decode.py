"""A FusedMoE layer's decode step on this CPU against its experts backend alone, same process.

What the layer adds around the experts at decode (one token): the gate's GEMV, the routing
(scores, stable top-k, renormalisation), the oracle's choice, the runner and the casts. Shape
E=64, k=8, H=1024, I=512 (SwiGLU), bf16 activations, a gate owned by the layer; per scheme
(bf16 weights, int8_w8a8, int4_w4a16) the layer call and the backend's `apply` with the same
routing alternate in every round, over enough layer copies that the weights stream from memory;
with bf16 weights, transformers' MixtralSparseMoeBlock (gate, softmax top-k, experts "eager" and
"grouped_mm") on the same tensors too. Reports medians and the layer's overhead (layer - experts).

    python bench/cpu_layer_decode.py --rounds 300 --out bench/results/cpu-layer-decode.json
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time

import torch

import moekit
from moekit import FusedMoE, RoutingConfig, route
from moekit.config import ActivationParams
from moekit.experts.base import BACKENDS

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cpu_quant import write_json  # noqa: E402
from moekit.benchmarks.cpu import cpu_model  # noqa: E402

E, K_TOP, H, I = 64, 8, 1024, 512
SCHEMES = {"bf16": (None, "cpu"), "int8_w8a8": ("int8_w8a8", "cpu_int8"), "int4_w4a16": ("int4_w4a16", "cpu_wo")}


def hf_block(layer: FusedMoE, implementation: str):
    """transformers' MixtralSparseMoeBlock (its gate, softmax top-k routing and experts run through
    `implementation`) on the layer's own bf16 gate and expert tensors, or None without transformers."""
    try:
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    except ImportError:
        return None
    cfg = MixtralConfig(num_local_experts=E, num_experts_per_tok=K_TOP, hidden_size=H, intermediate_size=I,
                        hidden_act="silu")
    cfg._experts_implementation = implementation
    with torch.device("meta"):
        block = MixtralSparseMoeBlock(cfg)
    block.gate.weight = torch.nn.Parameter(layer.gate.weight, requires_grad=False)
    block.experts.gate_up_proj = torch.nn.Parameter(layer.experts.w13, requires_grad=False)
    block.experts.down_proj = torch.nn.Parameter(layer.experts.w2, requires_grad=False)
    return lambda x: block(x[None])[0]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=300)
    p.add_argument("--copies", type=int, default=0, help="layer copies a scheme rotates over (0: >= 3 and 96 MB)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    torch.manual_seed(0)
    params = ActivationParams()
    results = []
    with torch.inference_mode():
        for name, (quant, backend) in SCHEMES.items():
            first = FusedMoE(E, H, I, RoutingConfig(top_k=K_TOP), gate=True, dtype=torch.bfloat16, quant=quant)
            per_layer = sum(t.numel() * t.element_size() for _, t in first.experts.expert_weights().per_expert_tensors())
            n = args.copies or max(3, -(-96 * 2**20 // per_layer))
            layers = [first] + [FusedMoE(E, H, I, RoutingConfig(top_k=K_TOP), gate=True, dtype=torch.bfloat16,
                                         quant=quant) for _ in range(n - 1)]
            be = BACKENDS[backend]

            def experts(m, x):
                w, ids = route(m.gate(x), m.routing)  # (untimed: made before the call below)
                weights = m.experts.expert_weights()
                return lambda: be.apply(x, weights, w, ids, activation="silu", activation_params=params,
                                        apply_router_weight_on_input=False, expert_map=None)

            calls = {"layer": lambda m, x: (lambda: m(x)), "experts": experts}
            if quant is None:  # transformers' MoE block on the same bf16 tensors
                for impl in ("eager", "grouped_mm"):
                    blocks = {id(m): hf_block(m, impl) for m in layers}
                    if None not in blocks.values():
                        calls[f"hf_block_{impl}"] = lambda m, x, blocks=blocks: (lambda: blocks[id(m)](x))
            times = {c: [] for c in calls}
            names = list(calls)
            for r in range(args.rounds + 5):
                x = torch.randn(1, H).bfloat16()
                order = names[r % len(names):] + names[:r % len(names)]  # each leads equally often
                for j, c in enumerate(order):
                    fn = calls[c](layers[(len(names) * r + j) % n], x)  # each call the next copy
                    t0 = time.perf_counter()
                    fn()
                    if r >= 5:
                        times[c].append(time.perf_counter() - t0)
            med = {c: statistics.median(ts) * 1e6 for c, ts in times.items()}
            row = {"scheme": name, "backend": backend, "layer_copies": n, "layer_us": round(med["layer"], 1),
                   "experts_us": round(med["experts"], 1), "overhead_us": round(med["layer"] - med["experts"], 1),
                   "layer_p25_p75_us": [round(v * 1e6, 1) for v in statistics.quantiles(times["layer"], n=4)[::2]]}
            row.update({f"{c}_us": round(v, 1) for c, v in med.items() if c.startswith("hf_")})
            results.append(row)
            print(f"{name:11s} " + "  ".join(f"{c} {v:7.1f} us" for c, v in med.items()), flush=True)
    doc = {
        "benchmark": "cpu_layer_decode",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": "python " + " ".join([os.path.relpath(sys.argv[0])] + (argv if argv is not None else sys.argv[1:])),
        "cpu": cpu_model(), "threads": torch.get_num_threads(), "torch": torch.__version__,
        "moekit": moekit.__version__, "python": platform.python_version(),
        "shape": {"E": E, "k": K_TOP, "H": H, "I": I, "activation": "silu", "x": "bf16", "gate": "owned, bf16"},
        "rounds": args.rounds,
        "method": "per round, on a new token: the layer call (its gate and routing included), the backend's apply with "
                  "the routing of the same token, and (bf16) transformers' MixtralSparseMoeBlock on the same tensors "
                  "through its eager and grouped_mm experts, each on the next layer copy in turn (weights cold), "
                  "the order rotated by one each round; medians",
        "results": results,
    }
    write_json(args.out, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())

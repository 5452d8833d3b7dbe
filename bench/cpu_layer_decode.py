"""A FusedMoE layer's decode step on this CPU against its experts backend alone, same process.

What the layer adds around the experts at decode (one token): the gate's GEMV, the routing
(scores, stable top-k, renormalisation), the oracle's choice, the runner and the casts. Shape
E=64, k=8, H=1024, I=512 (SwiGLU), bf16 activations, a gate owned by the layer; per scheme
(bf16 weights, int8_w8a8, int4_w4a16) the layer call and the backend's `apply` on the same
weights with the same routing alternate in every round, over enough layer copies that the
weights stream from memory. Reports medians and the layer's overhead (layer - experts).

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
from cpu_quant import cpu_name, write_json  # noqa: E402

E, K_TOP, H, I = 64, 8, 1024, 512
SCHEMES = {"bf16": (None, "cpu"), "int8_w8a8": ("int8_w8a8", "cpu_int8"), "int4_w4a16": ("int4_w4a16", "cpu_wo")}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=300)
    p.add_argument("--copies", type=int, default=0, help="layer copies a scheme rotates over (0: > 96 MB of weights)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    torch.manual_seed(0)
    params = ActivationParams()
    results = []
    with torch.inference_mode():
        for name, (quant, backend) in SCHEMES.items():
            first = FusedMoE(E, H, I, RoutingConfig(top_k=K_TOP), gate=True, dtype=torch.bfloat16, quant=quant)
            per_layer = sum(t.numel() * t.element_size() for _, t in first.experts.expert_weights().per_expert_tensors())
            n = args.copies or 2 * max(2, -(-48 * 2**20 // per_layer))  # even: both calls cycle over all
            layers = [first] + [FusedMoE(E, H, I, RoutingConfig(top_k=K_TOP), gate=True, dtype=torch.bfloat16,
                                         quant=quant) for _ in range(n - 1)]
            be = BACKENDS[backend]
            t_layer, t_experts = [], []
            for r in range(args.rounds + 5):
                a, b = layers[2 * r % n], layers[(2 * r + 1) % n]  # a cold copy for each call
                x = torch.randn(1, H).bfloat16()
                w, ids = route(b.gate(x), b.routing)
                weights = b.experts.expert_weights()

                def experts():
                    be.apply(x, weights, w, ids, activation="silu", activation_params=params,
                             apply_router_weight_on_input=False, expert_map=None)

                order = ((lambda: a(x), t_layer), (experts, t_experts))
                for fn, ts in (order if r % 2 else order[::-1]):
                    t0 = time.perf_counter()
                    fn()
                    if r >= 5:
                        ts.append(time.perf_counter() - t0)
            lay, exp = statistics.median(t_layer) * 1e6, statistics.median(t_experts) * 1e6
            row = {"scheme": name, "backend": backend, "layer_copies": n, "layer_us": round(lay, 1),
                   "experts_us": round(exp, 1), "overhead_us": round(lay - exp, 1),
                   "layer_p25_p75_us": [round(v * 1e6, 1) for v in statistics.quantiles(t_layer, n=4)[::2]]}
            results.append(row)
            print(f"{name:11s} layer {lay:7.1f} us  experts {exp:7.1f} us  overhead {lay - exp:6.1f} us", flush=True)
    doc = {
        "benchmark": "cpu_layer_decode",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": "python " + " ".join([os.path.relpath(sys.argv[0])] + (argv if argv is not None else sys.argv[1:])),
        "cpu": cpu_name(), "threads": torch.get_num_threads(), "torch": torch.__version__,
        "moekit": moekit.__version__, "python": platform.python_version(),
        "shape": {"E": E, "k": K_TOP, "H": H, "I": I, "activation": "silu", "x": "bf16", "gate": "owned, bf16"},
        "rounds": args.rounds,
        "method": "per round the layer call (its gate and routing included) on one copy and the backend's apply on the "
                  "next copy's weights with that copy's routing of the same token, alternating which goes first; medians",
        "results": results,
    }
    write_json(args.out, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Eager FusedMoE calls with and without eager_graphs on one GPU (host time included).

    PYTHONPATH=src python bench/eager_graphs_h200.py [--out FILE]

For each PERF.md shape that fits (Qwen3-30B-A3B, OLMoE, gpt-oss-20b; bf16, Triton experts) and
T in {1, 16, 128} tokens: the mean time per call of back-to-back eager calls (what a model that
calls the layer eagerly sees, launch costs included), with eager_graphs = 0 and = 8, and the
layer captured in a CUDA graph by hand (the floor of the replay path). Fresh inputs per call.
"""

import argparse
import copy
import datetime
import json
import os

import torch

from moekit import FusedMoE, RoutingConfig
from moekit.benchmarks.gpu import host_time_us
from moekit.graphs import EagerGraphs

SHAPES = {"qwen3-30b-a3b": (128, 8, 2048, 768), "olmoe-1b-7b": (64, 8, 2048, 1024), "gpt-oss-20b": (32, 4, 2880, 2880)}




def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "eager-graphs.json"))
    args = p.parse_args()
    rows = []
    for name, (E, k, H, I) in SHAPES.items():
        layer = FusedMoE(E, H, I, RoutingConfig(top_k=k), dtype=torch.bfloat16, device="cuda")
        graphed = copy.deepcopy(layer)
        graphed._graphs = EagerGraphs(8)
        for T in (1, 16, 128):
            inputs = [(torch.randn(T, H, device="cuda").bfloat16(), torch.randn(T, E, device="cuda")) for _ in range(50)]
            with torch.no_grad():
                eager = host_time_us(layer, inputs)
                replayed = host_time_us(graphed, inputs)
                same = torch.equal(graphed(*inputs[0]), layer(*inputs[0]))
                sx, sl = torch.empty_like(inputs[0][0]), torch.empty_like(inputs[0][1])
                sx.copy_(inputs[0][0]), sl.copy_(inputs[0][1])
                layer(sx, sl)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    layer(sx, sl)
                torch.cuda.synchronize()
                graph = host_time_us(lambda x, lg: g.replay(), inputs)
            rows.append(dict(shape=name, T=T, eager_us=eager, eager_graphs_us=replayed, cuda_graph_replay_us=graph,
                             speedup=eager / replayed, bitwise_equal=same))
            print(f"{name:14s} T={T:4d} eager {eager:8.1f} us | eager_graphs=8 {replayed:8.1f} us "
                  f"(x{eager / replayed:.1f}) | graph replay {graph:7.1f} us | equal {same}", flush=True)
    out = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               command="PYTHONPATH=src python bench/eager_graphs_h200.py", device=torch.cuda.get_device_name(),
               torch=torch.__version__, note="mean per call of 50 back-to-back eager calls, best of 3, host time "
                                              "included; graph replay: the same layer captured by hand", rows=rows)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print("wrote", args.out)


if __name__ == "__main__":
    main()

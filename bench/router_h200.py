"""The one-launch Triton router against the torch router on one GPU.

    PYTHONPATH=src python bench/router_h200.py [--out FILE]

For the routing of PERF.md's five models at T in {1, 16, 256, 4096, 16384} tokens:
- eager: the mean time per call of 200 back-to-back calls, host time included, as route()
  runs them with the NaN check on (the kernel: one launch and a read of its NaN flag; before
  it: torch.isnan(...).any() then the torch router) and with it off (MOEKIT_CHECK_IDS=0);
- graph: GPU time per call of 20 calls captured in one CUDA graph, the median of 20 replays
  (moekit.benchmarks.gpu.graph_time_us; no check inside a capture).
Every kernel result is compared with the torch router's first (same ids, weights within 1e-6).
"""

import argparse
import datetime
import json
import os

import torch

from moekit import RoutingConfig
from moekit.benchmarks.gpu import graph_time_us, host_time_us
from moekit.kernels.triton_router import triton_route
from moekit.routing.router import check_router_logits, route_torch

ROUTING = {  # model: (E, config kwargs, correction bias)
    "mixtral-8x7b": (8, dict(top_k=2), False),
    "qwen3-30b-a3b": (128, dict(top_k=8), False),
    "olmoe-1b-7b": (64, dict(top_k=8, renormalize=False), False),
    "gpt-oss-20b": (32, dict(top_k=4, order="topk_then_softmax"), False),
    "deepseek-v3": (256, dict(top_k=8, scoring="sigmoid", num_expert_group=8, topk_group=4,
                              routed_scaling_factor=2.5), True),
}


def eager_us(fn, calls=200):
    """Host microseconds per call of fn() over `calls` back-to-back calls, the best of three."""
    return host_time_us(fn, [()] * calls, reps=3, warm=5)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "router.json"))
    args = p.parse_args()
    rows = []
    for model, (E, kw, has_bias) in ROUTING.items():
        cfg = RoutingConfig(**kw)
        bias = torch.randn(E, device="cuda") * 0.05 if has_bias else None
        for T in (1, 16, 256, 4096, 16384):
            z = torch.randn(T, E, device="cuda", dtype=torch.bfloat16)
            w, ids, _ = triton_route(z, cfg, bias, check_nan=False)
            w_ref, ids_ref = route_torch(z, cfg, bias)
            same_ids = torch.equal(ids, ids_ref)
            max_rel = ((w - w_ref).abs() / w_ref.abs().clamp_min(1e-30)).max().item() if T else 0.0

            def kernel_checked():
                w, ids, flag = triton_route(z, cfg, bias, check_nan=True)
                if bool(flag):
                    raise ValueError("NaN")

            def torch_checked():
                check_router_logits(z)
                route_torch(z, cfg, bias)

            row = dict(model=model, T=T, same_ids=same_ids, max_rel_weight_diff=max_rel,
                       eager_kernel_us=eager_us(kernel_checked), eager_torch_us=eager_us(torch_checked),
                       eager_kernel_nocheck_us=eager_us(lambda: triton_route(z, cfg, bias, check_nan=False)),
                       eager_torch_nocheck_us=eager_us(lambda: route_torch(z, cfg, bias)),
                       graph_kernel_us=graph_time_us(lambda: triton_route(z, cfg, bias, check_nan=False), [()] * 20, 20),
                       graph_torch_us=graph_time_us(lambda: route_torch(z, cfg, bias), [()] * 20, 20))
            rows.append(row)
            print(f"{model:14s} T={T:6d} ids equal {same_ids} w rel {max_rel:.1e} | eager {row['eager_kernel_us']:7.1f} "
                  f"vs {row['eager_torch_us']:7.1f} us (no check {row['eager_kernel_nocheck_us']:6.1f} vs "
                  f"{row['eager_torch_nocheck_us']:6.1f}) | graph {row['graph_kernel_us']:6.2f} vs "
                  f"{row['graph_torch_us']:6.2f} us", flush=True)
    out = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               command="PYTHONPATH=src python bench/router_h200.py", device=torch.cuda.get_device_name(),
               torch=torch.__version__, note=__doc__.split("\n\n", 2)[2].strip(), rows=rows)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print("wrote", args.out)


if __name__ == "__main__":
    main()

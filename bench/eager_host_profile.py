"""Where an eager FusedMoE call spends its host time (no CUDA graphs).

    PYTHONPATH=src python bench/eager_host_profile.py [--device cuda] [--out DIR]

For a few decode points (T tokens, Triton experts on CUDA, the oracle's pick elsewhere): the
mean time per call of back-to-back eager calls, with the NaN check of the router logits on and
off; the host time of one bare launch of a trivial torch op and of a trivial Triton kernel (the
floors a launch costs on this host); then, over the same calls, torch.profiler's CPU time per op
and cProfile's time per Python function. Writes eager-host.json and one text file of tables per
point to --out.
"""

import argparse
import cProfile
import datetime
import io
import json
import os
import pstats

import torch

from moekit import FusedMoE, RoutingConfig
from moekit.benchmarks.gpu import host_time_us
from moekit.config import settings

POINTS = [  # name, E, k, H, I, T, quant, routing kwargs
    ("qwen3-30b-a3b", 128, 8, 2048, 768, 1, None, {}),
    ("qwen3-30b-a3b", 128, 8, 2048, 768, 16, None, {}),
    ("qwen3-30b-a3b-fp8", 128, 8, 2048, 768, 1, "fp8_w8a8", {}),
    ("deepseek-v3", 256, 8, 7168, 2048, 1, None,
     dict(scoring="sigmoid", num_expert_group=8, topk_group=4, routed_scaling_factor=2.5)),
]


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def per_call_us(fn, inputs, device, reps=7):
    return host_time_us(fn, inputs, reps=reps, device=device)


def launch_floors(device):
    """Host microseconds of one tiny torch op and of one tiny Triton launch (with 20 arguments)."""
    out = {}
    x = torch.zeros(16, device=device)
    out["torch_add_us"] = per_call_us(lambda: x.add_(1), [()] * 200, device)
    if device.type == "cuda":
        import triton  # noqa: PLC0415
        import triton.language as tl  # noqa: PLC0415

        @triton.jit
        def tiny(p, a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15, a16, a17,
                 B: tl.constexpr):
            tl.store(p + tl.arange(0, B), tl.arange(0, B).to(tl.float32))

        args = [x] + [7] * 18
        out["triton_launch_20_args_us"] = per_call_us(lambda: tiny[(1,)](*args, B=16), [()] * 200, device)
    return out


def profile_tables(fn, inputs, device):
    """torch.profiler's CPU op table and cProfile's function table over the calls."""
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        for args in inputs:
            fn(*args)
        sync(device)
    ops = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=60)
    pr = cProfile.Profile()
    pr.enable()
    for args in inputs:
        fn(*args)
    sync(device)
    pr.disable()
    s = io.StringIO()
    st = pstats.Stats(pr, stream=s)
    st.sort_stats("tottime").print_stats(45)
    st.sort_stats("cumulative").print_stats(45)
    return ops, s.getvalue()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--calls", type=int, default=100)
    p.add_argument("--points", nargs="*", default=None, help="names of POINTS to run (default all)")
    args = p.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    backend = "triton" if device.type == "cuda" else "auto"
    rows = []
    floors = launch_floors(device)
    print("launch floors", floors, flush=True)
    for name, E, k, H, I, T, quant, rkw in POINTS:
        if args.points and name not in args.points:
            continue
        layer = FusedMoE(E, H, I, RoutingConfig(top_k=k, **rkw), dtype=dtype, device=device, backend=backend,
                         quant=quant)
        if quant is not None:
            g = torch.Generator(device="cpu").manual_seed(0)
            layer.load_weights(torch.randn(E, 2 * I, H, generator=g).to(dtype).to(device) * H ** -0.5,
                               torch.randn(E, H, I, generator=g).to(dtype).to(device) * I ** -0.5)
        inputs = [(torch.randn(T, H, device=device).to(dtype), torch.randn(T, E, device=device))
                  for _ in range(args.calls)]
        row = dict(point=name, T=T)
        with torch.no_grad():
            for check in (True, False):
                object.__setattr__(settings, "check_ids", check)  # frozen: read once at import
                row["eager_us_check" if check else "eager_us_nocheck"] = per_call_us(layer, inputs, device)
            object.__setattr__(settings, "check_ids", True)
            ops, funcs = profile_tables(layer, inputs, device)
        rows.append(row)
        print(row, flush=True)
        with open(os.path.join(args.out, f"eager-host-{name}-T{T}.txt"), "w") as f:
            f.write(f"{row}\n\n{ops}\n\n{funcs}")
    out = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               command="PYTHONPATH=src python bench/eager_host_profile.py", torch=torch.__version__,
               device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
               note="mean per call of back-to-back eager calls, best of 7 rounds, host time included",
               launch_floors=floors, rows=rows)
    with open(os.path.join(args.out, "eager-host.json"), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()

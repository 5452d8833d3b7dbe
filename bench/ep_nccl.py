"""Expert-parallel dispatch + combine against raw all_to_all_single of the same bytes.

    PYTHONPATH=src torchrun --nproc-per-node 2 bench/ep_nccl.py --out bench/results/ep_nccl_2xh200.json --profile

For each shape (DeepSeek-V3: E=256, k=8, H=7168; Qwen3-30B-A3B: E=128, k=8, H=2048) and
tokens per rank (1, 16, 128, 1024, 4096), with uniform random routing and bf16 tokens:

- all_to_all (dynamic), once per --kernels variant ("triton" and "torch" on CUDA): dispatch
  + combine, against two raw all_to_all_single calls with the same split sizes and bytes
  (packed rows out, fp32 partial outputs back): fraction_of_raw = raw time / our time. Also
  against the raw pair preceded by the count exchange and host read that any dynamic path
  pays (raw_sync_us, fraction_of_raw_sync): what is left is the packing and summing.
  With --configs, the Triton path again under other tile settings (EpKernelConfig) at
  --config-min-tokens tokens and more.
- static_all_to_all (capacity = tokens per rank), per kernels variant: dispatch + combine
  eagerly and replayed from a CUDA graph (the decode path), against the two raw equal-split calls.
- p2p_all_to_all (CUDA; capacity = tokens per rank, through peer-mapped memory): eagerly and
  from a CUDA graph, against the raw pair with the dynamic path's split sizes (the routed
  bytes: fraction_of_raw) and against the raw equal-split pair (fraction_of_raw_static).
- allgather_reducescatter: dispatch + combine against a raw all-gather + reduce-scatter.
- a whole decode step of FusedMoE with each capacity dispatcher (router, dispatch, experts,
  combine; --layer-tokens per rank), eagerly and replayed from a CUDA graph.
- --profile: torch.profiler over 10 dispatch + combine calls of the dynamic path (default
  kernels) for --profile-shape at --profile-tokens; rank 0 prints the top ops by device and
  by CPU time, the JSON keeps them under "profiles", --trace-dir gets Chrome traces.

The experts are replaced by a stand-in that keeps the data honest: y = x * (sum of the
routing weights of this rank's experts), so combine must return x * sum(weights); the
largest relative error of that check is recorded for every row. Times are the slowest
rank's mean over --iters calls (median of --reps repeats), after --warmup calls.
Runs on CPU with gloo too (--device cpu --shapes tiny) to test the script itself.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time

import torch
import torch.distributed as dist

from moekit import FusedMoE, RoutingConfig
from moekit.parallel import (AllGatherReduceScatterDispatcher, AllToAllDispatcher, P2PAllToAllDispatcher,
                             ParallelConfig, StaticAllToAllDispatcher)
from moekit.parallel.ep_common import RowLayout, all_gather_single, reduce_scatter_single
from moekit.parallel.peer_memory import strategies_in_use

SHAPES = {
    "deepseek-v3": dict(E=256, k=8, H=7168, I=2048),
    "qwen3-30b-a3b": dict(E=128, k=8, H=2048, I=768),
    "tiny": dict(E=8, k=2, H=16, I=8),
}

# EpKernelConfig fields of the tile variants --configs can add (the Triton path only)
CONFIGS = {
    "default": {},
    "wide": dict(plan_block=2048, plan_warps=8, pack_block=4096, pack_warps=8, combine_block=2048, combine_warps=8),
    "narrow": dict(plan_block=512, pack_block=512, pack_warps=2, combine_block=512, combine_warps=2),
}


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "ep_nccl.json"),
                   help="JSON file written by rank 0 (default $OUT/ep_nccl.json)")
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    p.add_argument("--shapes", nargs="+", default=["deepseek-v3", "qwen3-30b-a3b"], choices=sorted(SHAPES))
    p.add_argument("--tokens", nargs="+", type=int, default=[1, 16, 128, 1024, 4096])
    p.add_argument("--layer-tokens", nargs="*", type=int, default=[1, 16], help="decode steps of the whole layer")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--no-graph", action="store_true", help="skip the CUDA graph timing")
    p.add_argument("--kernels", nargs="+", choices=["triton", "torch"],
                   help="kernel variants of the all_to_all dispatchers (default: triton, torch on CUDA; torch on CPU)")
    p.add_argument("--configs", nargs="*", default=["wide", "narrow"], choices=sorted(CONFIGS),
                   help="extra Triton tile configs of the dynamic path")
    p.add_argument("--config-min-tokens", type=int, default=1024)
    p.add_argument("--profile", action="store_true", help="profile dispatch + combine of the dynamic path")
    p.add_argument("--profile-shape", default="qwen3-30b-a3b", choices=sorted(SHAPES))
    p.add_argument("--profile-tokens", nargs="+", type=int, default=[1, 1024])
    p.add_argument("--profile-rows", type=int, default=8, help="ops printed per profile table")
    p.add_argument("--trace-dir", help="write rank 0's Chrome traces of the profiled calls here")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


class Clock:
    """Mean seconds per call of fn over `iters` calls, median of `reps`, slowest rank."""

    def __init__(self, device, iters, warmup, reps):
        self.device, self.iters, self.warmup, self.reps = device, iters, warmup, reps

    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def __call__(self, fn) -> float:
        for _ in range(self.warmup):
            fn()
        samples = []
        for _ in range(self.reps):
            dist.barrier()
            self._sync()
            if self.device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(self.iters):
                    fn()
                end.record()
                end.synchronize()
                samples.append(start.elapsed_time(end) / 1e3 / self.iters)
            else:
                t0 = time.perf_counter()
                for _ in range(self.iters):
                    fn()
                samples.append((time.perf_counter() - t0) / self.iters)
        t = torch.tensor([statistics.median(samples)], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())


def stand_in_experts(d, k):
    """y [N, H] fp32 = x * (sum of the weights of this rank's experts); padding rows give 0."""
    local = (d.expert_map.long()[d.topk_ids.long()] >= 0).float()  # [N, k]
    return d.x.float() * (d.topk_weights.float() * local).sum(dim=1, keepdim=True)


def check(out, x, w) -> float:
    """Relative error of combine's result against x * sum(w) (what the stand-in implies)."""
    expected = x.float() * w.sum(dim=1, keepdim=True)
    if expected.numel() == 0:
        return 0.0
    err = float((out - expected).norm() / expected.norm())
    t = torch.tensor([err], dtype=torch.float64, device=x.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def kernel_config(name):
    """The EpKernelConfig of a CONFIGS entry (imports Triton)."""
    from moekit.parallel.ep_kernels import EpKernelConfig  # noqa: PLC0415 (CUDA only)

    return EpKernelConfig(**CONFIGS[name])


def bench_shape(shape_name, shape, T, clock, device, args, group_size, rank, use_graph, kernels):
    E, k, H = shape["E"], shape["k"], shape["H"]
    g = torch.Generator(device="cpu").manual_seed(args.seed + 7919 * rank + T)
    x = torch.randn(T, H, generator=g).to(device, torch.bfloat16)
    ids = torch.rand(T, E, generator=g).topk(k, dim=1).indices.to(device, torch.int32)  # uniform, distinct
    w = torch.rand(T, k, generator=g).to(device)
    rows = []
    base = dict(shape=shape_name, E=E, k=k, H=H, tokens_per_rank=T)
    layout = RowLayout(H, x.dtype, k)
    ep = ParallelConfig.expert_parallel(dispatcher="all_to_all")
    static = ParallelConfig.expert_parallel(dispatcher="static_all_to_all", max_tokens_per_rank=T)

    def run_once(disp):
        """dispatch + stand-in experts + combine once: (timed call, y, check error, dispatched, combined)."""
        d = disp.dispatch(x, w, ids)
        y = stand_in_experts(d, k)
        out = disp.combine(y, d)
        return (lambda: disp.combine(y, disp.dispatch(x, w, ids))), y, check(out, x, w), d, out

    def same_as(ref, d, out) -> bool:
        """Whether every rank's dispatched rows and combined output equal the torch path's, bit for bit."""
        mine = (d.x, d.topk_weights, d.topk_ids, out)
        same = all(b is None or (a.shape == b.shape and torch.equal(a, b)) for a, b in zip(mine, ref))
        t = torch.tensor([0 if same else 1], device=device)
        dist.all_reduce(t)
        return int(t.item()) == 0

    def variant(make, row_base, ref, graph):
        """Rows of one dispatcher variant; an error (a kernel that fails to build, say) becomes a row."""
        try:
            disp = make()
            ours, y, err, d, out = run_once(disp)
            row = dict(row_base, mode="eager", check_rel_err=err, bitwise_equal_torch=same_as(ref, d, out))
            t_ours = clock(ours)
            # again after the timed calls (dispatchers that capture graphs on repeated calls replay them now)
            _, _, err_again, d_again, out_again = run_once(disp)
            row.update(check_rel_err=max(err, err_again),
                       bitwise_equal_torch=row["bitwise_equal_torch"] and same_as(ref, d_again, out_again))
            row.update(us=t_ours * 1e6, fraction_of_raw=row_base["raw_us"] / (t_ours * 1e6),
                       GBps=row_base["bytes_per_rank"] / t_ours / 1e9)
            if "raw_sync_us" in row_base:
                row["fraction_of_raw_sync"] = row_base["raw_sync_us"] / (t_ours * 1e6)
            return [row] + ([graph_row(disp, x, w, ids, y, clock, row_base, ref[3])] if graph else [])
        except Exception as exc:  # noqa: BLE001 (both ranks fail alike; the other variants still run)
            return [dict(row_base, mode="eager", error=f"{type(exc).__name__}: {exc}"[:400])]

    # dynamic all_to_all vs raw all_to_all_single with the same splits (and after a count exchange)
    _, y, _, d, out = run_once(AllToAllDispatcher(ep, E, k, kernels="torch"))
    ref = (d.x, d.topk_weights, d.topk_ids, out)
    send, recv = d.handle.send_counts, d.handle.recv_counts
    out_rows = torch.empty((sum(send), layout.row_bytes), dtype=torch.uint8, device=device)
    in_rows = torch.empty((sum(recv), layout.row_bytes), dtype=torch.uint8, device=device)
    back_out = torch.empty((sum(send), H), dtype=torch.float32, device=device)
    counts_out = torch.ones(2 * group_size, dtype=torch.int32, device=device)
    counts_in = torch.empty_like(counts_out)

    def raw():
        dist.all_to_all_single(in_rows, out_rows, recv, send)
        dist.all_to_all_single(back_out, y, send, recv)

    def raw_sync():
        dist.all_to_all_single(counts_in, counts_out)
        counts_in.tolist()
        raw()

    t_raw, t_raw_sync = clock(raw), clock(raw_sync)
    nbytes = sum(send) * layout.row_bytes + sum(recv) * H * 4
    t_raw_routed, nbytes_routed = t_raw, nbytes
    for kern in kernels:
        configs = ["default"]
        if kern == "triton" and T >= args.config_min_tokens:
            configs += [c for c in args.configs if c != "default"]
        for cfg in configs:
            row_base = dict(base, dispatcher="all_to_all", kernels=kern, config=cfg, raw_us=t_raw * 1e6,
                            raw_sync_us=t_raw_sync * 1e6, bytes_per_rank=nbytes)
            rows += variant(lambda: AllToAllDispatcher(ep, E, k, kernels=kern, kernel_config=None if kern == "torch"
                                                       else kernel_config(cfg)), row_base, ref, False)

    # static (capacity = T): eager and CUDA graph, against the raw equal-split pair
    _, _, _, d, out = run_once(StaticAllToAllDispatcher(static, E, k, kernels="torch"))
    ref = (d.x, d.topk_weights, d.topk_ids, out)
    n = group_size * T
    rows_a = torch.empty((n, layout.row_bytes), dtype=torch.uint8, device=device)
    rows_b = torch.empty_like(rows_a)
    back = torch.empty((n, H), dtype=torch.float32, device=device)
    y_static = torch.randn(n, H, device=device)

    def raw_static():
        dist.all_to_all_single(rows_b, rows_a)
        dist.all_to_all_single(back, y_static)

    t_raw = clock(raw_static)
    nbytes = n * (layout.row_bytes + H * 4)
    for kern in kernels:
        row_base = dict(base, dispatcher="static_all_to_all", kernels=kern, config="default", raw_us=t_raw * 1e6,
                        bytes_per_rank=nbytes)
        rows += variant(lambda: StaticAllToAllDispatcher(static, E, k, kernels=kern), row_base, ref, use_graph)

    # p2p (capacity = T) through peer-mapped memory: only routed rows cross the links, so its raw
    # is the dynamic path's (same routed bytes); the equal-split raw is kept beside it. The x bytes
    # of its padding rows are stale rather than zero, so only weights, ids and output are compared.
    if device.type == "cuda":
        p2p = ParallelConfig.expert_parallel(dispatcher="p2p_all_to_all", max_tokens_per_rank=T)
        row_base = dict(base, dispatcher="p2p_all_to_all", kernels="triton", config="default",
                        raw_us=t_raw_routed * 1e6, raw_static_us=t_raw * 1e6, bytes_per_rank=nbytes_routed)
        for r in variant(lambda: P2PAllToAllDispatcher(p2p, E, k), row_base, (None,) + ref[1:], use_graph):
            if "us" in r:
                r["fraction_of_raw_static"] = r["raw_static_us"] / r["us"]
            rows.append(r)

    # allgather + reduce-scatter vs the raw pair
    disp = AllGatherReduceScatterDispatcher(ParallelConfig.expert_parallel(dispatcher="allgather_reducescatter"), E, k)
    ours, y, err, d, _ = run_once(disp)
    T_max = d.handle.block_tokens
    block = torch.empty((T_max, layout.row_bytes), dtype=torch.uint8, device=device)
    gathered = torch.empty((group_size * T_max, layout.row_bytes), dtype=torch.uint8, device=device)
    scattered = torch.empty((T_max, H), dtype=torch.float32, device=device)

    def raw_ag():
        all_gather_single(gathered, block)
        reduce_scatter_single(scattered, y)

    t_ours, t_raw = clock(ours), clock(raw_ag)
    nbytes = group_size * T_max * (layout.row_bytes + H * 4)
    rows.append(dict(base, dispatcher="allgather_reducescatter", kernels="torch", config="default", mode="eager",
                     us=t_ours * 1e6, raw_us=t_raw * 1e6, fraction_of_raw=t_raw / t_ours, bytes_per_rank=nbytes,
                     GBps=nbytes / t_ours / 1e9, check_rel_err=err))
    return rows


def graph_row(disp, x, w, ids, y, clock, static_base, ref_out, per_graph=10):
    """dispatch + combine captured `per_graph` times in one CUDA graph, timed per call on replay;
    the replayed output is compared bit for bit with ref_out (the torch path's, eager)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            disp.combine(y, disp.dispatch(x, w, ids))
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [disp.combine(y, disp.dispatch(x, w, ids)) for _ in range(per_graph)]
    graph.replay()
    err = check(outs[-1], x, w)
    diff = torch.tensor([0 if torch.equal(outs[-1], ref_out) else 1], device=x.device)
    dist.all_reduce(diff)
    t = clock(graph.replay) / per_graph
    return dict(static_base, mode="cuda_graph", us=t * 1e6, fraction_of_raw=static_base["raw_us"] / (t * 1e6),
                GBps=static_base["bytes_per_rank"] / t / 1e9, check_rel_err=err, bitwise_equal_torch=not diff.item())


def layer_rows(shape_name, shape, T, clock, device, args, use_graph, dispatcher="static_all_to_all"):
    """One FusedMoE decode step (a capacity dispatcher, capacity T), eager and as a CUDA graph replay."""
    E, k, H, I = shape["E"], shape["k"], shape["H"], shape["I"]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    parallel = ParallelConfig.expert_parallel(dispatcher=dispatcher, max_tokens_per_rank=T)
    layer = FusedMoE(E, H, I, RoutingConfig(top_k=k), dtype=dtype, device=device, parallel=parallel)
    g = torch.Generator(device="cpu").manual_seed(args.seed + T)
    x = torch.randn(T, H, generator=g).to(device, dtype)
    logits = torch.randn(T, E, generator=g).to(device)
    base = dict(shape=shape_name, E=E, k=k, H=H, I=I, tokens_per_rank=T, dispatcher=dispatcher,
                backend=layer.runner.backend)
    with torch.no_grad():
        out = layer(x, logits)
        rows = [dict(base, mode="layer_eager", us=clock(lambda: layer(x, logits)) * 1e6,
                     finite=bool(torch.isfinite(out).all()))]
        if use_graph:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(3):
                    layer(x, logits)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                captured = layer(x, logits)
            graph.replay()
            same = bool(torch.equal(captured, layer(x, logits)))
            rows.append(dict(base, mode="layer_cuda_graph", us=clock(graph.replay) * 1e6,
                             finite=bool(torch.isfinite(captured).all()), replay_equals_eager=same))
    return rows


def _device_time(e) -> float:
    """Device time of a profiler average, us (the attribute was renamed across torch releases)."""
    for name in ("device_time_total", "cuda_time_total"):
        if hasattr(e, name):
            return float(getattr(e, name))
    return 0.0


def profile_rows(shape_name, shape, T, device, args, rank, calls=10):
    """torch.profiler over `calls` dispatch + combine calls of the dynamic path (default kernels)."""
    from torch.autograd import DeviceType  # noqa: PLC0415
    from torch.profiler import ProfilerActivity, profile, record_function  # noqa: PLC0415

    E, k, H = shape["E"], shape["k"], shape["H"]
    g = torch.Generator(device="cpu").manual_seed(args.seed + 7919 * rank + T)
    x = torch.randn(T, H, generator=g).to(device, torch.bfloat16)
    ids = torch.rand(T, E, generator=g).topk(k, dim=1).indices.to(device, torch.int32)
    w = torch.rand(T, k, generator=g).to(device)
    disp = AllToAllDispatcher(ParallelConfig.expert_parallel(dispatcher="all_to_all"), E, k)
    d = disp.dispatch(x, w, ids)
    y = stand_in_experts(d, k)
    for _ in range(3):
        disp.combine(y, disp.dispatch(x, w, ids))
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
    dist.barrier()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for _ in range(calls):
            with record_function("ep.dispatch"):
                dd = disp.dispatch(x, w, ids)
            with record_function("ep.combine"):
                disp.combine(y, dd)
        if cuda:
            torch.cuda.synchronize(device)
        wall = (time.perf_counter() - t0) / calls
    if args.trace_dir and rank == 0:
        os.makedirs(args.trace_dir, exist_ok=True)
        prof.export_chrome_trace(os.path.join(args.trace_dir, f"ep_profile_{shape_name}_T{T}.json"))
    events = prof.key_averages()
    on_device = [e for e in events if e.device_type != DeviceType.CPU]  # kernels and copies
    on_host = [e for e in events if e.device_type == DeviceType.CPU]

    def top(rows, key, time_name):
        ranked = sorted(rows, key=key, reverse=True)[:args.profile_rows]
        return [dict(op=e.key, calls=e.count / calls, us=key(e) / calls, time=time_name) for e in ranked]

    phases = {e.key: e.cpu_time_total / calls for e in on_host if e.key in ("ep.dispatch", "ep.combine")}
    return dict(shape=shape_name, tokens_per_rank=T, calls=calls, wall_us_per_call=wall * 1e6,
                kernels="triton" if disp.triton_for(x) is not None else "torch",
                device_us_per_call=sum(_device_time(e) for e in on_device) / calls, cpu_us_per_call=phases,
                by_device=top(on_device, _device_time, "device"),
                by_cpu=top(on_host, lambda e: e.self_cpu_time_total, "self cpu"),
                table=events.table(sort_by="self_cuda_time_total" if cuda else "self_cpu_time_total", row_limit=30))


SHORT = {"deepseek-v3": "dsv3", "qwen3-30b-a3b": "qwen3", "all_to_all": "a2a", "static_all_to_all": "static",
         "p2p_all_to_all": "p2p",
         "allgather_reducescatter": "ag_rs"}
HEADER = ("shape T kernels[/config] dispatcher mode | our us | raw us (% of raw) | raw+count exchange us (%) | "
          "check rel err")


def print_row(r) -> None:
    variant = r["kernels"] if r["config"] == "default" else f"{r['kernels']}/{r['config']}"
    shape, dispatcher = SHORT.get(r["shape"], r["shape"]), SHORT[r["dispatcher"]]
    line = f"{shape:5s} {r['tokens_per_rank']:5d} {variant:13s} {dispatcher:6s} "
    if "error" in r:
        print(line + f"FAILED: {r['error'][:200]}", flush=True)
        return
    line += f"{r['mode'][:5]:5s} | {r['us']:7.1f} | {r['raw_us']:6.1f} {100 * r['fraction_of_raw']:4.0f}%"
    if "raw_sync_us" in r:
        line += f" | {r['raw_sync_us']:6.1f} {100 * r['fraction_of_raw_sync']:4.0f}%"
    if "raw_static_us" in r:
        line += f" | equal-split raw {r['raw_static_us']:6.1f} {100 * r['fraction_of_raw_static']:4.0f}%"
    same = {True: "", False: " NOT BITWISE EQUAL TO THE TORCH PATH"}[r.get("bitwise_equal_torch", True)]
    print(line + f" | {r['check_rel_err']:.0e}{same}", flush=True)


def print_profile(p) -> None:
    print(f"profile {p['shape']} T={p['tokens_per_rank']} kernels={p['kernels']}: {p['wall_us_per_call']:.0f} us/call "
          f"under the profiler, device {p['device_us_per_call']:.0f} us/call, CPU per call "
          + " ".join(f"{k} {v:.0f} us" for k, v in p["cpu_us_per_call"].items()), flush=True)
    for title, rows in (("kernels by device time", p["by_device"]), ("ops by self CPU time", p["by_cpu"])):
        if rows:
            print(f"  {title} (us per call): " + "; ".join(
                f"{r['op'][:40]} x{r['calls']:g} {r['us']:.1f}" for r in rows), flush=True)


def main(argv=None) -> int:
    args = parse(argv)
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if not dist.is_initialized():
        dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    if use_cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank % torch.cuda.device_count())))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    kernels = args.kernels or (["triton", "torch"] if use_cuda else ["torch"])
    clock = Clock(device, args.iters, args.warmup, args.reps)
    use_graph = use_cuda and not args.no_graph
    results, profiles = [], []
    t_start = time.perf_counter()
    if rank == 0:
        print(HEADER, flush=True)
    for name in args.shapes:
        for T in args.tokens:
            rows = bench_shape(name, SHAPES[name], T, clock, device, args, size, rank, use_graph, kernels)
            results.extend(rows)
            if rank == 0:
                for r in rows:
                    print_row(r)
    layer_dispatchers = ["static_all_to_all"] + (["p2p_all_to_all"] if use_cuda else [])
    for name in args.shapes:
        for T in args.layer_tokens:
            for disp_name in layer_dispatchers:
                try:
                    rows = layer_rows(name, SHAPES[name], T, clock, device, args, use_graph, disp_name)
                except Exception as exc:  # noqa: BLE001 (the layer's experts backend is not what this script times)
                    rows = [dict(shape=name, tokens_per_rank=T, dispatcher=disp_name, mode="layer",
                                 error=f"{type(exc).__name__}: {exc}"[:400])]
                results.extend(rows)
                if rank == 0:
                    for r in rows:
                        what = (f"{r['mode']:16s} {r['us']:7.1f} us (experts {r['backend']})" if "error" not in r
                                else f"FAILED: {r['error'][:200]}")
                        print(f"{SHORT.get(name, name):5s} {T:5d} {SHORT[disp_name]:6s} FusedMoE decode step {what}",
                              flush=True)
    if args.profile:
        for T in args.profile_tokens:
            profiles.append(profile_rows(args.profile_shape, SHAPES[args.profile_shape], T, device, args, rank))
            if rank == 0:
                print_profile(profiles[-1])
    if rank == 0:
        meta = dict(
            date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            command=" ".join(["torchrun", f"--nproc-per-node {size}"] + sys.argv),
            device=torch.cuda.get_device_name(device) if use_cuda else platform.processor() or platform.machine(),
            backend=dist.get_backend(), world_size=size, torch=torch.__version__,
            triton=_triton_version(), nccl=".".join(map(str, torch.cuda.nccl.version())) if use_cuda else None,
            wall_s=time.perf_counter() - t_start,
            p2p_peer_memory=strategies_in_use(),
            note="times are the slowest rank's; fraction_of_raw = raw time / our time for the same bytes "
                 "(p2p_all_to_all: the routed bytes, as the dynamic path's raw); fraction_of_raw_sync: the raw pair "
                 "after a count exchange and host read; fraction_of_raw_static: p2p against the equal-split raw",
        )
        out = dict(meta, results=results)
        if profiles:
            out["profiles"] = profiles
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
        print(f"wrote {args.out} ({meta['wall_s']:.0f} s)", flush=True)
    dist.barrier()
    return 0


def _triton_version():
    try:
        import triton  # noqa: PLC0415
    except ImportError:
        return None
    return triton.__version__


if __name__ == "__main__":
    code = main()
    dist.destroy_process_group()
    sys.exit(code)

"""Expert-parallel dispatch + combine against raw all_to_all_single of the same bytes.

    torchrun --nproc-per-node 2 bench/ep_nccl.py --out bench/results/ep_nccl_2xh200.json

For each shape (DeepSeek-V3: E=256, k=8, H=7168; Qwen3-30B-A3B: E=128, k=8, H=2048) and
tokens per rank (1, 16, 128, 1024, 4096), with uniform random routing and bf16 tokens:

- all_to_all (dynamic): dispatch + combine, against two raw all_to_all_single calls with
  the same split sizes and bytes (packed rows out, fp32 partial outputs back). The
  fraction of raw bandwidth is raw time / our time.
- static_all_to_all (capacity = tokens per rank): dispatch + combine eagerly and replayed
  from a CUDA graph (the decode path), against the two raw equal-split calls.
- allgather_reducescatter: dispatch + combine against a raw all-gather + reduce-scatter.
- a whole decode step of FusedMoE with the static dispatcher (router, dispatch, experts,
  combine; --layer-tokens per rank), eagerly and replayed from a CUDA graph.

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
from moekit.parallel import ParallelConfig, build_dispatcher
from moekit.parallel.ep_common import RowLayout, all_gather_single, reduce_scatter_single

SHAPES = {
    "deepseek-v3": dict(E=256, k=8, H=7168, I=2048),
    "qwen3-30b-a3b": dict(E=128, k=8, H=2048, I=768),
    "tiny": dict(E=8, k=2, H=16, I=8),
}


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="JSON file written by rank 0")
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    p.add_argument("--shapes", nargs="+", default=["deepseek-v3", "qwen3-30b-a3b"], choices=sorted(SHAPES))
    p.add_argument("--tokens", nargs="+", type=int, default=[1, 16, 128, 1024, 4096])
    p.add_argument("--layer-tokens", nargs="*", type=int, default=[1, 16], help="decode steps of the whole layer")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--no-graph", action="store_true", help="skip the CUDA graph timing")
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


def bench_shape(shape_name, shape, T, clock, device, args, group_size, rank, use_graph):
    E, k, H = shape["E"], shape["k"], shape["H"]
    g = torch.Generator(device="cpu").manual_seed(args.seed + 7919 * rank + T)
    x = torch.randn(T, H, generator=g).to(device, torch.bfloat16)
    ids = torch.rand(T, E, generator=g).topk(k, dim=1).indices.to(device, torch.int32)  # uniform, distinct
    w = torch.rand(T, k, generator=g).to(device)
    rows = []
    base = dict(shape=shape_name, E=E, k=k, H=H, tokens_per_rank=T)

    # dynamic all_to_all vs raw all_to_all_single with the same splits
    disp = build_dispatcher(ParallelConfig.expert_parallel(dispatcher="all_to_all"), E, k)
    d = disp.dispatch(x, w, ids)
    y = stand_in_experts(d, k)
    err = check(disp.combine(y, d), x, w)
    send, recv = d.handle.send_counts, d.handle.recv_counts
    layout = RowLayout(H, x.dtype, k)
    out_rows = torch.empty((sum(send), layout.row_bytes), dtype=torch.uint8, device=device)
    in_rows = torch.empty((sum(recv), layout.row_bytes), dtype=torch.uint8, device=device)
    back_out = torch.empty((sum(send), H), dtype=torch.float32, device=device)

    def ours():
        dd = disp.dispatch(x, w, ids)
        disp.combine(y, dd)

    def raw():
        dist.all_to_all_single(in_rows, out_rows, recv, send)
        dist.all_to_all_single(back_out, y, send, recv)

    t_ours, t_raw = clock(ours), clock(raw)
    nbytes = sum(send) * layout.row_bytes + sum(recv) * H * 4
    rows.append(dict(base, dispatcher="all_to_all", mode="eager", us=t_ours * 1e6, raw_us=t_raw * 1e6,
                     fraction_of_raw=t_raw / t_ours, bytes_per_rank=nbytes, GBps=nbytes / t_ours / 1e9,
                     check_rel_err=err))

    # static (capacity = T): eager and CUDA graph
    disp = build_dispatcher(ParallelConfig.expert_parallel(dispatcher="static_all_to_all", max_tokens_per_rank=T), E, k)
    d = disp.dispatch(x, w, ids)
    y = stand_in_experts(d, k)
    err = check(disp.combine(y, d), x, w)
    layout = RowLayout(H, x.dtype, k)
    n = group_size * T
    rows_a = torch.empty((n, layout.row_bytes), dtype=torch.uint8, device=device)
    rows_b = torch.empty_like(rows_a)
    back = torch.empty((n, H), dtype=torch.float32, device=device)

    def ours_static():
        dd = disp.dispatch(x, w, ids)
        disp.combine(y, dd)

    def raw_static():
        dist.all_to_all_single(rows_b, rows_a)
        dist.all_to_all_single(back, y)

    t_ours, t_raw = clock(ours_static), clock(raw_static)
    nbytes = n * (layout.row_bytes + H * 4)
    static_base = dict(base, dispatcher="static_all_to_all", raw_us=t_raw * 1e6, bytes_per_rank=nbytes)
    rows.append(dict(static_base, mode="eager", us=t_ours * 1e6, fraction_of_raw=t_raw / t_ours,
                     GBps=nbytes / t_ours / 1e9, check_rel_err=err))
    if use_graph:
        rows.append(graph_row(disp, x, w, ids, y, clock, static_base))

    # allgather + reduce-scatter vs the raw pair
    disp = build_dispatcher(ParallelConfig.expert_parallel(dispatcher="allgather_reducescatter"), E, k)
    d = disp.dispatch(x, w, ids)
    y = stand_in_experts(d, k)
    err = check(disp.combine(y, d), x, w)
    T_max = d.handle.block_tokens
    layout = RowLayout(H, x.dtype, k)
    block = torch.empty((T_max, layout.row_bytes), dtype=torch.uint8, device=device)
    gathered = torch.empty((group_size * T_max, layout.row_bytes), dtype=torch.uint8, device=device)
    scattered = torch.empty((T_max, H), dtype=torch.float32, device=device)

    def ours_ag():
        dd = disp.dispatch(x, w, ids)
        disp.combine(y, dd)

    def raw_ag():
        all_gather_single(gathered, block)
        reduce_scatter_single(scattered, y)

    t_ours, t_raw = clock(ours_ag), clock(raw_ag)
    nbytes = group_size * T_max * (layout.row_bytes + H * 4)
    rows.append(dict(base, dispatcher="allgather_reducescatter", mode="eager", us=t_ours * 1e6, raw_us=t_raw * 1e6,
                     fraction_of_raw=t_raw / t_ours, bytes_per_rank=nbytes, GBps=nbytes / t_ours / 1e9,
                     check_rel_err=err))
    return rows


def graph_row(disp, x, w, ids, y, clock, static_base, per_graph=10):
    """dispatch + combine captured `per_graph` times in one CUDA graph, timed per call on replay."""
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
    t = clock(graph.replay) / per_graph
    return dict(static_base, mode="cuda_graph", us=t * 1e6, fraction_of_raw=static_base["raw_us"] / (t * 1e6),
                GBps=static_base["bytes_per_rank"] / t / 1e9, check_rel_err=err)


def layer_rows(shape_name, shape, T, clock, device, args, use_graph):
    """One FusedMoE decode step (static dispatcher, capacity T), eager and as a CUDA graph replay."""
    E, k, H, I = shape["E"], shape["k"], shape["H"], shape["I"]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    parallel = ParallelConfig.expert_parallel(dispatcher="static_all_to_all", max_tokens_per_rank=T)
    layer = FusedMoE(E, H, I, RoutingConfig(top_k=k), dtype=dtype, device=device, parallel=parallel)
    g = torch.Generator(device="cpu").manual_seed(args.seed + T)
    x = torch.randn(T, H, generator=g).to(device, dtype)
    logits = torch.randn(T, E, generator=g).to(device)
    base = dict(shape=shape_name, E=E, k=k, H=H, I=I, tokens_per_rank=T, dispatcher="static_all_to_all",
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
    clock = Clock(device, args.iters, args.warmup, args.reps)
    use_graph = use_cuda and not args.no_graph
    results = []
    for name in args.shapes:
        for T in args.tokens:
            results.extend(bench_shape(name, SHAPES[name], T, clock, device, args, size, rank, use_graph))
            if rank == 0:
                for r in results[-(4 if use_graph else 3):]:
                    print(f"{name:14s} T={T:5d} {r['dispatcher']:24s} {r['mode']:10s} {r['us']:10.1f} us "
                          f"raw {r['raw_us']:10.1f} us  {100 * r['fraction_of_raw']:5.1f}% of raw  "
                          f"check {r['check_rel_err']:.1e}", flush=True)
    for name in args.shapes:
        for T in args.layer_tokens:
            results.extend(layer_rows(name, SHAPES[name], T, clock, device, args, use_graph))
            if rank == 0:
                for r in results[-(2 if use_graph else 1):]:
                    print(f"{name:14s} T={T:5d} FusedMoE decode step  {r['mode']:18s} {r['us']:10.1f} us "
                          f"(experts backend {r['backend']})", flush=True)
    if rank == 0:
        meta = dict(
            date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            command=" ".join(["torchrun", f"--nproc-per-node {size}"] + sys.argv),
            device=torch.cuda.get_device_name(device) if use_cuda else platform.processor() or platform.machine(),
            backend=dist.get_backend(), world_size=size, torch=torch.__version__,
            nccl=".".join(map(str, torch.cuda.nccl.version())) if use_cuda else None,
            note="times are the slowest rank's; fraction_of_raw = raw time / our time for the same bytes",
        )
        with open(args.out, "w") as f:
            json.dump(dict(meta, results=results), f, indent=1)
    dist.barrier()
    return 0


if __name__ == "__main__":
    code = main()
    dist.destroy_process_group()
    sys.exit(code)

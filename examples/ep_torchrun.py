"""Expert parallelism under torchrun: every rank checks its output against the single-process layer.

    torchrun --nproc-per-node 2 examples/ep_torchrun.py
    torchrun --nproc-per-node 4 examples/ep_torchrun.py --experts 64 --top-k 6 --tokens 256 --dtype bfloat16

Each rank builds the same full weights and all ranks' tokens (uneven batches: rank r gets
about tokens * (r + 1) / P of them, the last rank none with --empty-rank), runs the
single-process layer on all tokens, then for each dispatcher an expert-parallel layer on
its own tokens, and compares its slice (relative error within moekit's tolerance for the
dtype). Rank 0 prints the worst error over ranks and the slowest rank's time per forward.
CUDA with NCCL when GPUs are visible, else CPU with gloo. Exit status 1 on any mismatch.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist

from moekit import FusedMoE, RoutingConfig, SharedExpertsConfig
from moekit.experts.reference import TOLERANCE
from moekit.parallel import ParallelConfig
from moekit.parallel.config import CAPACITY_DISPATCHERS

DISPATCHERS = ("all_to_all", "allgather_reducescatter", "static_all_to_all", "p2p_all_to_all")
CPU_DISPATCHERS = DISPATCHERS[:3]  # p2p_all_to_all maps GPU memory


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--intermediate", type=int, default=128)
    p.add_argument("--shared", type=int, default=128, help="shared expert intermediate size (0: none)")
    p.add_argument("--tokens", type=int, default=64, help="tokens of the last rank (others get fewer)")
    p.add_argument("--empty-rank", action="store_true", help="the last rank passes no tokens")
    p.add_argument("--placement", default="linear", choices=["linear", "round_robin"])
    p.add_argument("--dispatchers", nargs="+", choices=DISPATCHERS,
                   help="default: all of them on CUDA with every rank on one host, all but p2p_all_to_all otherwise")
    p.add_argument("--peer-memory", default="auto", choices=["auto", "symmetric", "ipc"],
                   help="how p2p_all_to_all maps the peers' memory")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--corrupt-rank", type=int, default=None,
                   help="perturb this rank's expert weights, to see the check fail")
    return p.parse_args(argv)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_forward(layer, x, logits, iters, device) -> float:
    """Seconds per forward of the slowest rank (median over iters)."""
    times = []
    for _ in range(iters):
        dist.barrier()
        _sync(device)
        t0 = time.perf_counter()
        layer(x, logits)
        _sync(device)
        times.append(time.perf_counter() - t0)
    t = torch.tensor([sorted(times)[len(times) // 2]], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def main(argv=None) -> int:
    args = parse(argv)
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend)
    rank, size = dist.get_rank(), dist.get_world_size()
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank % torch.cuda.device_count())))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if args.dispatchers and "p2p_all_to_all" in args.dispatchers and device.type != "cuda":
        if rank == 0:
            print("ep_torchrun.py: error: --dispatchers p2p_all_to_all maps GPU memory: it needs CUDA GPUs on one "
                  f"host; on CPU choose among {list(CPU_DISPATCHERS)}", file=sys.stderr)
        dist.destroy_process_group()
        return 2
    dtype = getattr(torch, args.dtype)
    E, k, H, I = args.experts, args.top_k, args.hidden, args.intermediate
    Ts = [args.tokens * (r + 1) // size for r in range(size)]
    if args.empty_rank:
        Ts[-1] = 0
    start = sum(Ts[:rank])
    mine = slice(start, start + Ts[rank])

    g = torch.Generator().manual_seed(args.seed)  # identical on every rank
    w13 = (torch.randn(E, 2 * I, H, generator=g) * H ** -0.5).to(device, dtype)
    w2 = (torch.randn(E, H, I, generator=g) * I ** -0.5).to(device, dtype)
    x = torch.randn(sum(Ts), H, generator=g).to(device, dtype)
    logits = torch.randn(sum(Ts), E, generator=g).to(device)
    routing = RoutingConfig(top_k=k)
    shared = SharedExpertsConfig(args.shared, gated=True) if args.shared else None
    kw = dict(shared_experts=shared, dtype=dtype, device=device)

    single = FusedMoE(E, H, I, routing, **kw)
    single.load_weights(w13, w2)
    with torch.no_grad():
        if shared is not None:
            for p in single.shared.parameters():
                p.copy_((torch.randn(p.shape, generator=g) * 0.1).to(p))
        expected = single(x, logits)[mine]
        t_single = time_forward(single, x, logits, args.iters, device)

    tol = TOLERANCE[dtype]
    rows = []
    any_bad = False
    one_host = int(os.environ.get("LOCAL_WORLD_SIZE", size)) == size  # p2p_all_to_all maps peers on one host
    for name in args.dispatchers or (DISPATCHERS if device.type == "cuda" and one_host else CPU_DISPATCHERS):
        parallel = ParallelConfig.expert_parallel(
            dispatcher=name, placement=args.placement, peer_memory=args.peer_memory,
            max_tokens_per_rank=max(max(Ts), 1) if name in CAPACITY_DISPATCHERS else None)
        layer = FusedMoE(E, H, I, routing, parallel=parallel, **kw)
        layer.load_weights(w13, w2)
        layer.load_state_dict({n: v for n, v in single.state_dict().items() if not n.startswith("experts.")},
                              strict=False)
        if args.corrupt_rank == rank:
            with torch.no_grad():
                layer.experts.w2.mul_(1.5)
        with torch.no_grad():
            err = 0.0
            for _ in range(3):  # repeated calls too (p2p_all_to_all runs, captures, then replays graphs)
                out = layer(x[mine], logits[mine])
                diff = (out.double() - expected.double()).norm()
                ref_norm = expected.double().norm()
                err = max(err, 0.0 if ref_norm == 0 and diff == 0 else float(diff / ref_norm.clamp_min(1e-300)))
                if not torch.isfinite(out).all():
                    err = float("inf")
            t = time_forward(layer, x[mine], logits[mine], args.iters, device)
        err_t = torch.tensor([err], dtype=torch.float64, device=device)
        dist.all_reduce(err_t, op=dist.ReduceOp.MAX)
        worst = float(err_t.item())
        bad = not worst <= tol
        any_bad |= bad
        rows.append((name, worst, t, "MISMATCH" if bad else "match"))

    if rank == 0:
        print(f"{size} ranks ({dist.get_backend()}, {device.type}), E={E} k={k} H={H} I={I} {args.dtype}, "
              f"tokens per rank {Ts}, placement {args.placement}, tolerance {tol:g}")
        print(f"  {'single process (all tokens)':30s} {'':>10s} {t_single * 1e3:9.3f} ms")
        for name, worst, t, verdict in rows:
            print(f"  {name:30s} err {worst:8.2e} {t * 1e3:9.3f} ms  {verdict}")
    dist.barrier()
    dist.destroy_process_group()
    return 1 if any_bad else 0


if __name__ == "__main__":
    sys.exit(main())

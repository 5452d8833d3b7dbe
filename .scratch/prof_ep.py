import os, sys, time, torch, torch.distributed as dist
sys.path.insert(0, "src")
from moekit.parallel import ParallelConfig, build_dispatcher
dist.init_process_group("nccl"); rank = dist.get_rank(); torch.cuda.set_device(rank)
dev = torch.device("cuda", rank)
E, k, H = 256, 8, 7168
for name, T in [("static_all_to_all", 16), ("all_to_all", 1024), ("static_all_to_all", 1024)]:
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(T, H, generator=g).to(dev, torch.bfloat16)
    ids = torch.rand(T, E, generator=g).topk(k, 1).indices.to(dev, torch.int32)
    w = torch.rand(T, k, generator=g).to(dev)
    d = build_dispatcher(ParallelConfig.expert_parallel(dispatcher=name, max_tokens_per_rank=T), E, k)
    dd = d.dispatch(x, w, ids); y = torch.randn(dd.x.shape[0], H, device=dev)
    for _ in range(5): d.combine(y, d.dispatch(x, w, ids))
    torch.cuda.synchronize(); dist.barrier()
    t0 = time.perf_counter()
    for _ in range(20): d.combine(y, d.dispatch(x, w, ids))
    t1 = time.perf_counter(); torch.cuda.synchronize(); t2 = time.perf_counter()
    if rank == 0: print(name, T, f"cpu launch {1e6*(t1-t0)/20:.0f} us/iter, total {1e6*(t2-t0)/20:.0f} us/iter")
    from torch.profiler import profile, ProfilerActivity
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5): d.combine(y, d.dispatch(x, w, ids))
        torch.cuda.synchronize()
    if rank == 0:
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=40))
        print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=12, max_name_column_width=40))
dist.destroy_process_group()

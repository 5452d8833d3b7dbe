"""M = 1 timings of Qwen3-30B-A3B and OLMoE under different GPU histories in one process (fresh weights,
after seconds of large GEMMs, after a 25 GB allocation is freed and the weights reallocated, after
streaming copies), with the SM clock, temperature, power and throttle reasons nvidia-smi reports.

    PYTHONPATH=src python bench/m1_conditions_h200.py
"""
import subprocess, time, torch
from moekit.benchmarks.gpu import graph_time_us, routing_sets, shape_by_name
from moekit.experts.api import fused_experts

def smi():
    q = "clocks.sm,clocks.mem,temperature.gpu,power.draw,clocks_throttle_reasons.active"
    try:
        return subprocess.run(["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
    except Exception as e:
        return str(e)

W = {}
def alloc():
    W.clear()
    for name in ("qwen3-30b-a3b", "olmoe-1b-7b"):
        _, E, k, H, I = shape_by_name(name)
        W[name] = (torch.randn(E, 2 * I, H, device="cuda", dtype=torch.bfloat16) * H ** -0.5,
                   torch.randn(E, H, I, device="cuda", dtype=torch.bfloat16) * I ** -0.5,
                   routing_sets(1, E, k, H, 8, torch.bfloat16, "cuda"))

def t(tag):
    out = []
    for name, (w13, w2, sets) in W.items():
        out.append(round(graph_time_us(lambda a, b, c: fused_experts(a, w13, w2, b, c, backend="triton"), sets, 5), 1))
    print(f"{tag:34s} qwen3/olmoe {out}  | {smi()}", flush=True)


def main():
    alloc(); t("fresh"); t("fresh again")
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16); b = torch.randn_like(a)
    t0 = time.time()
    while time.time() - t0 < 6:
        for _ in range(20):
            a @ b
        torch.cuda.synchronize()
    t("right after 6 s of 8192^3 GEMMs")
    time.sleep(1); t("+1 s")
    time.sleep(8); t("+9 s")
    del a, b
    junk = torch.empty(25 * 2**30, dtype=torch.uint8, device="cuda"); junk.fill_(1); torch.cuda.synchronize()
    del junk; torch.cuda.empty_cache()
    alloc(); t("after 25 GB alloc/free, new weights")
    src = torch.randn(2**29, device="cuda", dtype=torch.bfloat16); dst = torch.empty_like(src)
    t0 = time.time()
    while time.time() - t0 < 6:
        for _ in range(20):
            dst.copy_(src)
        torch.cuda.synchronize()
    t("right after 6 s of 1 GB copies")
    time.sleep(9); t("+9 s")


if __name__ == "__main__":
    main()

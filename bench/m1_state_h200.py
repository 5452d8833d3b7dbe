"""What brings M = 1 back after a large allocation is freed: Qwen3-30B-A3B / OLMoE at M = 1 with
the shipped entries, in one process, after a 25 GB allocation is filled and freed, then
(a) right away, (b) after idle seconds, (c) after reading the weights themselves, (d) without
empty_cache (the weights carved from the cached block), (e) with the 25 GB still held.

    PYTHONPATH=src python bench/m1_state_h200.py [--out FILE]
Run it again with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to see the allocator's part.
"""
import argparse, json, os, sys, time
import torch
from moekit.benchmarks.gpu import graph_time_us
from moekit.experts.api import fused_experts

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from m1_conditions_h200 import W, alloc  # noqa: E402 - the same two weight sets and routings

ROWS = []


def t(tag):
    out = [round(graph_time_us(lambda a, b, c: fused_experts(a, w13, w2, b, c, backend="triton"), sets, 5), 1)
           for w13, w2, sets in W.values()]
    ROWS.append({"phase": tag, "qwen3_us": out[0], "olmoe_us": out[1]})
    print(f"{tag:60s} qwen3/olmoe {out}", flush=True)


def junk(free=True, empty=True):
    j = torch.empty(25 * 2**30, dtype=torch.uint8, device="cuda")
    j.fill_(1)
    torch.cuda.synchronize()
    if not free:
        return j
    del j
    if empty:
        torch.cuda.empty_cache()
    return None


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "m1_state.json"))
    args = p.parse_args()
    alloc(); t("fresh"); t("fresh again")
    junk(); alloc(); t("25 GB freed + empty_cache, weights reallocated")
    t("  same, again at once")
    time.sleep(3); t("  after 3 s idle")
    time.sleep(10); t("  after 13 s idle")
    junk(); alloc()
    t("25 GB freed + empty_cache, reallocated (2nd)")
    for w13, w2, _ in W.values():
        for _ in range(20):
            w13.sum(); w2.sum()
    torch.cuda.synchronize(); t("  after 20 reads of all the weights")
    junk(empty=False); alloc(); t("25 GB freed, no empty_cache (weights from the cached block)")
    torch.cuda.empty_cache()
    held = junk(free=False); alloc(); t("25 GB filled and still held, weights allocated after")
    del held; torch.cuda.empty_cache()
    alloc(); t("weights reallocated after the held block is freed")
    junk(); time.sleep(10); alloc(); t("25 GB freed, 10 s idle, then weights allocated")
    res = {"benchmark": "M=1 after a freed allocation", "device": torch.cuda.get_device_name(),
           "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""), "torch": torch.__version__,
           "timing": "fused_experts(backend='triton'), shipped M=1 entries, CUDA graph of 8 calls with distinct routing, "
                     "median of 5 replays, us per call", "rows": ROWS}
    with open(args.out, "w") as fh:
        json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()

"""A compact JSON of Nsight Compute's raw CSV (bench/ncu_run.sh): per kernel its duration, the
DRAM bytes and rate (against the H200's 4.8 TB/s), how busy memory, L2 and the SMs were, the
launch shape and the warp stall reasons, with the point of ncu_points_h200.py each kernel
belongs to (from the run's log).

    python bench/ncu_summary.py STEM-raw.csv STEM-log.txt --out bench/results/h200-ncu-....json
"""

import argparse
import csv
import json

_METRICS = {
    "us": "gpu__time_duration.sum",
    "dram_read_gb": "dram__bytes_read.sum",
    "dram_write_mb": "dram__bytes_write.sum",
    "mem_pct": "gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed",  # ncu's "Memory Throughput"
    "l2_pct": "lts__throughput.avg.pct_of_peak_sustained_elapsed",
    "l2_hit_pct": "lts__t_sector_hit_rate.pct",
    "sm_pct": "sm__throughput.avg.pct_of_peak_sustained_elapsed",
    "sm_ghz": "gpc__cycles_elapsed.avg.per_second",
    "grid": "launch__grid_size",
    "block": "launch__block_size",
    "registers": "launch__registers_per_thread",
    "smem_kb": "launch__shared_mem_per_block_dynamic",
    "warps_active_pct": "sm__warps_active.avg.pct_of_peak_sustained_active",
}
_STALL = "smsp__average_warps_issue_stalled_"


def _num(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return float("nan")


def points_of(log_path: str) -> list:
    """The point of each profiled kernel, in order: ncu prints a line per kernel it profiles and
    ncu_points_h200.py a line after each point."""
    out, pending = [], 0
    for line in open(log_path):
        if line.startswith("==PROF== Profiling"):
            pending += 1
        elif line.startswith("profiled "):
            out += [line[len("profiled "):].strip()] * pending
            pending = 0
    return out


def summarize(raw_csv: str, log_path: str) -> list:
    rows = list(csv.reader(open(raw_csv)))
    hdr, units, data = rows[0], rows[1], rows[2:]
    col = {h: i for i, h in enumerate(hdr)}
    points = points_of(log_path)
    out = []
    for n, r in enumerate(data):
        row = {"point": points[n] if n < len(points) else None, "kernel": r[col["Kernel Name"]][:80]}
        for key, name in _METRICS.items():
            if name in col:
                v = _num(r[col[name]])
                unit = units[col[name]]
                if key == "dram_read_gb" and unit == "Mbyte":
                    v /= 1e3
                if key == "dram_write_mb" and unit == "Gbyte":
                    v *= 1e3
                row[key] = v
        if row.get("us"):  # GB / us = 1000 TB/s
            moved = row.get("dram_read_gb", 0) + row.get("dram_write_mb", 0) / 1e3
            row["dram_tb_s"] = round(moved / row["us"] * 1e3, 3)
            row["dram_pct_of_4.8_tb_s"] = round(100 * row["dram_tb_s"] / 4.8, 1)
        stalls = {h[len(_STALL):].replace("_per_issue_active.ratio", ""): _num(r[i])
                  for h, i in col.items() if h.startswith(_STALL) and h.endswith("_per_issue_active.ratio")}
        row["stalls_per_issue"] = {k: round(v, 2) for k, v in sorted(stalls.items(), key=lambda kv: -kv[1])[:5]}
        out.append(row)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("raw_csv")
    p.add_argument("log")
    p.add_argument("--out", required=True)
    p.add_argument("--note", default="")
    args = p.parse_args()
    rows = summarize(args.raw_csv, args.log)
    json.dump({"tool": "Nsight Compute 2025.3.1 (--clock-control none; caches flushed between passes)",
               "device": "NVIDIA H200", "software": "torch 2.11, triton 3.6", "note": args.note, "kernels": rows},
              open(args.out, "w"), indent=1)
    for r in rows:
        print(f"{str(r['point'])[:34]:34s} {r['kernel'][:24]:24s} {r.get('us', 0):8.1f} us "
              f"{r.get('dram_tb_s', 0):5.2f} TB/s DRAM {r.get('dram_pct_of_4.8_tb_s', 0):5.1f}% "
              f"L2 {r.get('l2_pct', 0):5.1f}% SM {r.get('sm_pct', 0):5.1f}%")


if __name__ == "__main__":
    main()

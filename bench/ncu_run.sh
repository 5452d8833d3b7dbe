#!/bin/bash
# Nsight Compute over ncu_points_h200.py on the H200 (clocks left alone):
#   bash bench/ncu_run.sh POINTS STEM [more ncu arguments, e.g. -k regex:gemm --section SourceCounters]
# writes $OUT/STEM-raw.csv (every metric, a row per kernel), $OUT/STEM-details.txt (the sections
# and their rules) and $OUT/STEM-log.txt; a 1 GB read by torch is profiled after the points.
set -u
points=$1 stem=$2
shift 2
export PYTHONPATH=$PWD/src PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONUNBUFFERED=1
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
$NCU --clock-control none --profile-from-start off --nvtx \
  --section SpeedOfLight --section MemoryWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables \
  --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats \
  --section ComputeWorkloadAnalysis \
  --metrics dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sector_hit_rate.pct,gpu__time_duration.sum \
  "$@" -o $OUT/$stem -f python bench/ncu_points_h200.py --points "$points" --read-gb 1 > $OUT/$stem-log.txt 2>&1
grep "==PROF==\|profiled\|rror" $OUT/$stem-log.txt | tail -40
$NCU -i $OUT/$stem.ncu-rep --csv --page raw > $OUT/$stem-raw.csv
$NCU -i $OUT/$stem.ncu-rep --page details > $OUT/$stem-details.txt

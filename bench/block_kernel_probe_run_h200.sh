#!/bin/bash
# The block-scaled fp8 GEMMs alone on an H200: times (block_kernel_probe_h200.py) and Nsight
# Compute's sections for each case, with the SASS of NCU_SOURCE's case and its stall samples.
#   bash bench/block_kernel_probe_run_h200.sh  (writes into $OUT)
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
OUT=${OUT:-.}
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.limit --format=csv,noheader
timeout 300 python3 bench/block_kernel_probe_h200.py --rounds 3 --group-m ${GROUP_M_LIST:-8} --stages ${STAGES_LIST:-5} --out $OUT/h200-block-kernel-probe.json
[ -n "${NO_NCU:-}" ] && exit 0
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
timeout ${NCU_TIMEOUT:-200} $NCU --clock-control none --profile-from-start off --nvtx \
  --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
  --section WarpStateStats --section SchedulerStats --section SourceCounters --import-source no \
  -o $OUT/block-probe -f python3 bench/block_kernel_probe_h200.py --ncu --only "${NCU_ONLY:-gemm1 cuda E=1,gemm1 cublas}" \
  > $OUT/block-probe-ncu-log.txt 2>&1
tail -3 $OUT/block-probe-ncu-log.txt
$NCU -i $OUT/block-probe.ncu-rep --page details > $OUT/block-probe-details.txt 2>&1
$NCU -i $OUT/block-probe.ncu-rep --csv --page raw > $OUT/block-probe-raw.csv 2>&1
$NCU -i $OUT/block-probe.ncu-rep --page source --csv --print-source sass > $OUT/block-probe-sass.csv 2>&1
head -c 600 $OUT/block-probe-sass.csv; wc -l $OUT/block-probe-sass.csv

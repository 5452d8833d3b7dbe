#!/usr/bin/env bash
# Several versions of src/ on one H200: processes alternate over the versions each round, each
# profiling the same points with bench/profile_h200.py --graph (time per call in a CUDA graph,
# each kernel's time inside the replays, SM clock and power).
#     bash bench/src_abn_h200.sh LABEL=DIR[,LABEL=DIR...] POINTS [ROUNDS] [TAG]
#     ($OUT receives TAG-LABEL-ROUND.json; DIR holds the moekit package, e.g. src)
set -e
SRCS=$1 POINTS=$2 ROUNDS=${3:-2} TAG=${4:-abn}
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
for r in $(seq 1 "$ROUNDS"); do
  for pair in ${SRCS//,/ }; do
    label=${pair%%=*} dir=${pair#*=}
    PYTHONPATH=$dir python bench/profile_h200.py --graph --points "$POINTS" --out "$OUT/$TAG-$label-$r.json" 2>&1 \
      | grep "^==" | sed "s/^/$label$r /"
  done
done

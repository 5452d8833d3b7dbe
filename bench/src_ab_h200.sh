#!/usr/bin/env bash
# Two versions of src/ A/B on one H200: processes alternate A B A B ..., each profiling the same
# points with bench/profile_h200.py (graph time per call and each kernel's time).
#     bash bench/src_ab_h200.sh A_SRC B_SRC POINTS [ROUNDS] [TAG]   ($OUT receives TAG-{A,B}-{round}.json)
set -e
A_SRC=$1 B_SRC=$2 POINTS=$3 ROUNDS=${4:-2} TAG=${5:-ab}
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
for r in $(seq 1 "$ROUNDS"); do
  for side in A B; do
    if [ "$side" = A ]; then SP=$A_SRC; else SP=$B_SRC; fi
    PYTHONPATH=$SP python bench/profile_h200.py --points "$POINTS" --out "$OUT/$TAG-$side-$r.json" 2>&1 \
      | grep "^==" | sed "s/^/$side$r /"
  done
done

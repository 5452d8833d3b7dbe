#!/usr/bin/env bash
# Mixtral bf16 M = 256: the shipped prefill entry (A) against the same tiles on two warpgroups
# (8 warps) for GEMM1 and / or GEMM2, one or two programs an SM, 64- or 128-column K steps. The
# balance probe found this point's 128-row tiles running at their products' pace on one
# warpgroup (bench/NOTES-triton.md, "Uniform against balanced routing").
#     PYTHONPATH=src bash bench/mixtral256_warps_ab_h200.sh   (result: $OUT/h200-mixtral-256-warps-ab.json)
set -e
A='"BLOCK_SIZE_M": 128, "BLOCK_SIZE_N": 64, "GROUP_SIZE_M": 8'
G2='"BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 64, "GROUP_SIZE_M": 8'
PRE='"tma": 2, "tail": 4, "act_tma": 1, "x_tma": 1, "gu1": 1'
python3 bench/entry_ab_h200.py --point mixtral-8x7b:256 --rounds 3 --out "${OUT:-.}/h200-mixtral-256-warps-ab.json" \
  --entry "{$A, \"BLOCK_SIZE_K\": 64, \"num_warps\": 8, \"num_stages\": 3, \"gemm2\": {$G2, \"num_warps\": 4, \"num_stages\": 3}, \"prefill\": {$PRE, \"programs_per_sm\": 2}}" \
  --entry "{$A, \"BLOCK_SIZE_K\": 64, \"num_warps\": 8, \"num_stages\": 4, \"gemm2\": {$G2, \"num_warps\": 4, \"num_stages\": 3}, \"prefill\": {$PRE, \"programs_per_sm\": 1}}" \
  --entry "{$A, \"BLOCK_SIZE_K\": 64, \"num_warps\": 8, \"num_stages\": 3, \"gemm2\": {$G2, \"num_warps\": 8, \"num_stages\": 3}, \"prefill\": {$PRE, \"programs_per_sm\": 2}}" \
  --entry "{$A, \"BLOCK_SIZE_K\": 64, \"num_warps\": 4, \"num_stages\": 3, \"gemm2\": {$G2, \"num_warps\": 8, \"num_stages\": 3}, \"prefill\": {$PRE, \"programs_per_sm\": 2}}" \
  --entry "{$A, \"BLOCK_SIZE_K\": 128, \"num_warps\": 8, \"num_stages\": 2, \"gemm2\": {$G2, \"num_warps\": 4, \"num_stages\": 3}, \"prefill\": {$PRE, \"programs_per_sm\": 2}}"

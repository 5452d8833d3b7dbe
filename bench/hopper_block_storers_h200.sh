#!/bin/bash
# One H200 call for a change to the CUDA block-fp8 kernels: a smoke call (a hang shows within a
# minute), their GPU tests, then versions of the source against each other at DeepSeek-V3
# M = 16384 (bench/src_abn_h200.sh: processes alternate; graph time and each kernel's time in
# the replays).
#   SRCS=old=DIR,new=src bash bench/hopper_block_storers_h200.sh   ($OUT: tests.txt, storers-LABEL-N.json)
export PYTHONPATH=$PWD/src
OUT=${OUT:-.}
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.limit --format=csv,noheader
timeout 120 python3 -c "
import torch
from moekit.kernels import hopper_block
print(hopper_block.status(), flush=True)
from moekit.benchmarks.gpu import quantized_weights, routing_sets, _quant_call
from moekit.kernels.quant_tuning import QuantKnobs
wts = quantized_weights('fp8_w8a8_block128', 8, 512, 256, False, 'cuda')
x, w, ids = routing_sets(600, 8, 2, 512, 1, torch.bfloat16, 'cuda')[0]
a = _quant_call(wts, x, w, ids, knobs=QuantKnobs(gluon=128, cublas1='off', cuda='on'))
torch.cuda.synchronize()
print('smoke ok', torch.isfinite(a).all().item())
" || { echo "smoke failed"; exit 1; }
(cd tests && timeout ${TEST_TIMEOUT:-240} python3 -m pytest -m gpu kernels/test_hopper_block_gpu.py -q -n 4 \
    > $OUT/tests.txt 2>&1; tail -3 $OUT/tests.txt)
timeout ${AB_TIMEOUT:-300} bash bench/src_abn_h200.sh "$SRCS" "${POINTS:-deepseek-v3:fp8_w8a8_block128:16384}" \
    ${ROUNDS:-2} storers

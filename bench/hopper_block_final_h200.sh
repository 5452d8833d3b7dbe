#!/bin/bash
# One H200 call for the CUDA block-fp8 kernels: a smoke call, the A/B against the Gluon kernels
# (graphs and eager, every variant, the bf16 kernel), then the quantized GPU suites.
#   bash bench/hopper_block_final_h200.sh   (writes $OUT/h200-hopper-block-ab.json, $OUT/tests.txt)
export PYTHONPATH=$PWD/src
OUT=${OUT:-.}
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader
timeout 90 python3 -c "
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
timeout ${AB_TIMEOUT:-300} python3 bench/hopper_block_ab_h200.py --point deepseek-v3:16384 --point deepseek-v3:4096 \
    --point qwen3-30b-a3b:16384 --point mixtral-8x7b:4096 --bf16 --eager --rounds 3 --out $OUT/h200-hopper-block-ab.json
(cd tests && timeout ${TEST_TIMEOUT:-200} python3 -m pytest -m gpu kernels/test_hopper_block_gpu.py \
    kernels/test_gluon_block_gpu.py kernels/test_triton_quant_gpu.py kernels/test_triton_quant_knobs_gpu.py \
    -q -n 4 > $OUT/tests.txt 2>&1; tail -5 $OUT/tests.txt)

#!/bin/bash
# The CUDA block-fp8 kernels on an H200: build, a smoke call, the GPU tests, the A/B against Gluon.
#   bash bench/hopper_block_run_h200.sh   (writes $OUT/h200-hopper-block-ab.json)
export PYTHONPATH=$PWD/src
OUT=${OUT:-.}
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader
timeout 120 python3 - <<'PY'
import time, torch
from moekit.kernels import hopper_block
t = time.time(); print(hopper_block.status(), f"{time.time() - t:.1f} s", flush=True)
from moekit.benchmarks.gpu import quantized_weights, routing_sets, _quant_call
from moekit.kernels.quant_tuning import QuantKnobs
wts = quantized_weights("fp8_w8a8_block128", 8, 512, 256, False, "cuda")
x, w, ids = routing_sets(600, 8, 2, 512, 1, torch.bfloat16, "cuda")[0]
a = _quant_call(wts, x, w, ids, knobs=QuantKnobs(gluon=128, cublas1="off", cuda="on"))
b = _quant_call(wts, x, w, ids, knobs=QuantKnobs(gluon=128, cublas1="off", cuda="off"))
torch.cuda.synchronize()
print("smoke: rel err vs gluon", ((a.float() - b.float()).norm() / b.float().norm()).item(), "bits", torch.equal(a, b))
PY
[ $? -eq 0 ] || { echo "smoke failed"; exit 1; }
(cd tests && timeout 240 python3 -m pytest -m gpu kernels/test_hopper_block_gpu.py -q -x -n 4 > $OUT/tests.txt 2>&1; tail -5 $OUT/tests.txt)
timeout ${AB_TIMEOUT:-300} python3 bench/hopper_block_ab_h200.py --point deepseek-v3:16384 --point deepseek-v3:4096 \
    --point qwen3-30b-a3b:16384 --point mixtral-8x7b:4096 --bf16 --rounds 3 ${AB_ARGS:-} --out $OUT/h200-hopper-block-ab.json

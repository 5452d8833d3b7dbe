#!/bin/bash
# One H200 call for the 16-bit CUDA experts kernels: a smoke call against the fp32 reference, the
# A/B against the shipped Triton call (graphs, item widths), then the CUDA kernels' GPU tests.
#   bash bench/hopper_dense_run_h200.sh   (writes $OUT/h200-hopper-dense-ab.json, $OUT/tests.txt)
export PYTHONPATH=$PWD/src
OUT=${OUT:-.}
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader
timeout 120 python3 -c "
import torch
from moekit.kernels import hopper_block
from moekit.experts.base import ExpertWeights
from moekit.experts.reference import reference_experts
print(hopper_block.status(), flush=True)
g = torch.Generator(device='cuda'); g.manual_seed(0)
for T in (700, 5):
    E, k, H, I = 32, 8, 1024, 768
    w13 = (torch.randn(E, 2 * I, H, device='cuda', generator=g) * H ** -0.5).bfloat16()
    w2 = (torch.randn(E, H, I, device='cuda', generator=g) * I ** -0.5).bfloat16()
    ids = torch.rand(T, E, device='cuda', generator=g).topk(k, dim=1).indices.int()
    w = torch.rand(T, k, device='cuda', generator=g)
    x = torch.randn(T, H, device='cuda', generator=g).bfloat16()
    out = hopper_block.dense_experts(x, w13, w2, w, ids)
    ref = reference_experts(x, ExpertWeights(w13, w2), w, ids)
    print('smoke', T, ((out.float() - ref).norm() / ref.norm()).item(), flush=True)
" || { echo "smoke failed"; exit 1; }
timeout ${AB_TIMEOUT:-330} python3 bench/hopper_dense_ab_h200.py --point qwen3-30b-a3b:4096 --point mixtral-8x7b:256 \
    --point deepseek-v3:4096 --point qwen3-30b-a3b:16384 --point mixtral-8x7b:4096 --point olmoe-1b-7b:4096 \
    --rounds 3 --out $OUT/h200-hopper-dense-ab.json
(cd tests && timeout ${TEST_TIMEOUT:-150} python3 -m pytest -m gpu kernels/test_hopper_dense_gpu.py \
    kernels/test_hopper_block_gpu.py kernels/test_gluon_block_gpu.py -q -n 4 -x > $OUT/tests.txt 2>&1; tail -15 $OUT/tests.txt)

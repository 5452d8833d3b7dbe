#!/usr/bin/env bash
# The fp8 cast A/B on one H200: A puts values on the e4m3 grid before the cast (the interpreter's
# path, forced in a copy of src/), B lets the GPU's cast round; four processes, A B A B, each
# profiling the points below (bench/profile_h200.py). Results: bench/results/h200-fp8-cast-ab.json.
#     bash bench/fp8_cast_ab_h200.sh      ($OUT receives cast-{A,B}-{1,2}.json)
set -e
export PYTHONPATH=$PWD/src PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
rm -rf /tmp/srcA && cp -r src /tmp/srcA
sed -i 's/^INTERPRETED: tl.constexpr = tl.constexpr(_interpreted())/INTERPRETED: tl.constexpr = tl.constexpr(True)/' /tmp/srcA/moekit/kernels/triton_quant_rows.py
grep -c "tl.constexpr(True)" /tmp/srcA/moekit/kernels/triton_quant_rows.py
P=qwen3-30b-a3b:fp8_w8a8:16384:static,qwen3-30b-a3b:fp8_w8a8:4096:static,qwen3-30b-a3b:fp8_w8a8:1024:static,qwen3-30b-a3b:fp8_w8a8:256:static,qwen3-30b-a3b:fp8_w8a8:16:static,mixtral-8x7b:fp8_w8a8:256:static,mixtral-8x7b:fp8_w8a8:4096:static,qwen3-30b-a3b:fp8_w8a8:16384,deepseek-v3:fp8_w8a8_block128:4096
for r in 1 2; do
  for side in A B; do
    if [ $side = A ]; then SP=/tmp/srcA; else SP=$PWD/src; fi
    PYTHONPATH=$SP python bench/profile_h200.py --points $P --out $OUT/cast-$side-$r.json 2>&1 | grep "^==" | sed "s/^/$side$r /"
  done
done
python -m pytest -m gpu -q -x tests/kernels/test_triton_quant_gpu.py 2>&1 | tail -3

#!/usr/bin/env bash
# The fp8 cast A/B on one H200: A puts values on the e4m3 grid before the cast (the interpreter's
# path, forced in a copy of src/), B lets the GPU's cast round; four processes, A B A B, each
# profiling the points below. Results: bench/results/h200-fp8-cast-ab.json.
#     bash bench/fp8_cast_ab_h200.sh      ($OUT receives cast-{A,B}-{1,2}.json)
set -e
rm -rf /tmp/srcA && cp -r src /tmp/srcA
# A: to_quant takes its interpreter branch (the grid rounding) on the GPU too.
sed -i 's/^    elif INTERPRETED:$/    elif True:/' /tmp/srcA/moekit/kernels/triton_quant_rows.py
grep -q "^    elif True:$" /tmp/srcA/moekit/kernels/triton_quant_rows.py
P=qwen3-30b-a3b:fp8_w8a8:16384:static,qwen3-30b-a3b:fp8_w8a8:4096:static,qwen3-30b-a3b:fp8_w8a8:1024:static,qwen3-30b-a3b:fp8_w8a8:256:static,qwen3-30b-a3b:fp8_w8a8:16:static,mixtral-8x7b:fp8_w8a8:256:static,mixtral-8x7b:fp8_w8a8:4096:static,qwen3-30b-a3b:fp8_w8a8:16384,deepseek-v3:fp8_w8a8_block128:4096
bash bench/src_ab_h200.sh /tmp/srcA "$PWD/src" "$P" 2 cast
python -m pytest -m gpu -q -x tests/kernels/test_triton_quant_gpu.py 2>&1 | tail -3

# Session A, run 2: the fused kernels against the reference at the shapes users run (every format, batch 1/16/64 x
# 4k/32k, Llama-3-8B heads, bf16), with the centered planes; the same at 16 and 64 x 32k with each tile's p.v summed
# apart (TILE_ACCUMULATE); the kernel table of the formats whose products changed, beside bf16 SDPA.
set -o pipefail
. results/eval__h200__decode-protocol__20261202/setup.sh
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_decode.py -k "user_shapes or magic or fp16_products" -s -W ignore 2>&1 | grep -E "^batch|passed|failed|Error|assert" | tee $OUT/a2_precision.log
HF_KVCACHE_TILE_ACCUMULATE=1 timeout 120 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_decode.py -k "user_shapes and 32k and (16x or 64x)" -s -W ignore 2>&1 | grep -E "^batch|passed|failed|Error" | tee $OUT/a2_precision_tile_accumulate.log
timeout 150 python3 -m hf_kvcache.cli bench --parts kernel --batches 1,16,64 --contexts 32768 --methods fp8-e4m3,int8,int4-g128,rotated-4,int4-g64 --json $OUT/a2_kernel.json 2>&1 | grep -v -i "warn\|^$\|^  " | tee $OUT/a2_kernel.log

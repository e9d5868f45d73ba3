# GPU run 4 (2026-12-04): every preset eager at batch 16 x 32k against DynamicCache in one run (issue 28's table),
# KVQuant dequantizing in fp16; printed row by row, the JSON at the end.
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1
timeout 580 hf-kvcache bench --parts e2e --decode-batches 16 --e2e-modes eager --new-tokens 32 --prefill-chunk 0 \
  --decode-methods kvquant-4,kvquant-3,fp8-e4m3,int8,int4-g128,turboquant-4,kivi-2,turboquant-3.5,kivi-4,turboquant-3,int4-g32,int2-g32,rotated-4,fp8-e5m2,exact \
  --json $OUT/run4_b16.json 2>&1 | grep -v "warn(" | tee $OUT/run4_b16.log

# GPU run 2 (2026-12-04): kvquant-4 / kvquant-3 eager at batch 16 x 32k against DynamicCache (issue 28's table),
# with the fp16 dequantization.
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1
timeout 560 hf-kvcache bench --parts e2e --decode-batches 16 --e2e-modes eager --new-tokens 32 --prefill-chunk 0 \
  --decode-methods kvquant-4,kvquant-3,fp8-e4m3 --json $OUT/run2_b16.json 2>&1 | grep -v "warn(" | tee $OUT/run2_b16.log

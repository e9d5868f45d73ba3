# GPU run 4 (2026-12-04): batch 64 x 32k eager, every call's prompt prefilled by generate in chunks of 2048 tokens
# (an unchunked prefill of 64 x 32k does not fit), against DynamicCache in the same run.
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1
timeout 540 hf-kvcache bench --parts e2e --decode-batches 64 --e2e-modes eager --new-tokens 32 --prefill-chunk 2048 \
  --prefill-chunk-all --decode-methods fp8-e4m3,int4-g128,kvquant-4 --json $OUT/run4_b64.json 2>&1 \
  | grep -v "warn(" | tee $OUT/run4_b64.log

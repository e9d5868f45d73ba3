# GPU run 14 (issue 28, 2026-12-03, a third session): batch 64 x 32k eager, every call's prompt prefilled by generate
# in chunks of 2048 tokens (an unchunked prefill of 64 x 32k does not fit).
set -o pipefail
export PYTHONUNBUFFERED=1
D=results/bench__h200__e2e-bimodal__20261203
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1
timeout 560 hf-kvcache bench --parts e2e --decode-batches 64 --e2e-modes eager --new-tokens 32 --prefill-chunk 2048 \
  --prefill-chunk-all --decode-methods fp8-e4m3,int8,int4-g128,turboquant-4,kivi-2 --json $OUT/run14_b64.json 2>&1 \
  | grep -v "warn(" | tee $OUT/run14_b64.log

# GPU run 13 (issue 28, 2026-12-03, a third session): the eager step's spread between calls (diag_bimodal.py), then
# every preset eager at batch 16 x 32k against DynamicCache in one run, with the host time of a layer step now the
# least of 5 rounds of 20 steps.
set -o pipefail
export PYTHONUNBUFFERED=1
D=results/bench__h200__e2e-bimodal__20261203
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1
timeout 200 python3 $D/diag_bimodal.py 16:dynamic,fp8-e4m3 1:dynamic,fp8-e4m3,int4-g32,turboquant-3.5 3 2>&1 \
  | grep -v "warn(" | tee $OUT/run13_bimodal.log
timeout 370 hf-kvcache bench --parts e2e --decode-batches 16 --e2e-modes eager --new-tokens 32 --prefill-chunk 0 \
  --decode-methods fp8-e4m3,int8,int4-g128,turboquant-4,kivi-2,turboquant-3.5,kivi-4,turboquant-3,int4-g32,int2-g32,rotated-4,fp8-e5m2,exact,kvquant-4 \
  --json $OUT/run13_b16.json 2>&1 | grep -v "warn(" | tee $OUT/run13_b16.log

# GPU run 9 (issue 28, 2026-12-03): eager `generate` for the presets runs 4 and 6 did not measure: batch 1 x 32k
# (profile_generate.py, the specs interleaved, best of three) and batch 16 x 32k (the bench's e2e part, eager, no
# chunked call: step times and first calls only).
set -o pipefail
export PYTHONUNBUFFERED=1
D=results/bench__h200__e2e-eager-graphs__20261203
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1
timeout 150 python3 $D/profile_generate.py dynamic,kivi-4,turboquant-3.5,turboquant-3,int4-g32,int2-g32,fp8-e5m2,exact,rotated-4,kvquant-4 1 \
  2>&1 | grep -E "b1: step|rror" | tee $OUT/run9_b1.log
timeout 400 hf-kvcache bench --parts e2e --decode-batches 16 --e2e-modes eager --new-tokens 32 --prefill-chunk 0 \
  --decode-methods kivi-2,turboquant-3.5,kivi-4,turboquant-3,int4-g32,int2-g32,rotated-4,kvquant-4,fp8-e5m2,exact \
  --json $OUT/run9_b16.json 2>&1 | grep -v -i "warn" | grep -E "^(batch|\{|==)|rror|memory" | tee $OUT/run9_b16.log

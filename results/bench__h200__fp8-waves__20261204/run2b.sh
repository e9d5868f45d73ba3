# GPU run 2b (issue 28, 2026-12-04, a later session): compiled batch 16 and 1 x 32k for fp8-e4m3, int8, int4-g128
# against DynamicCache eager and transformers' StaticCache compiled, after the decode mask and the mask row a tile
# ahead; then where the compiled fp8-e4m3 step goes on the host (step_parts.py).
set -o pipefail
export PYTHONUNBUFFERED=1
D=results/bench__h200__fp8-waves__20261204
F="^(batch|\{|==)|rror|memory"
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1
timeout 400 hf-kvcache bench --parts e2e --decode-batches 16,1 --e2e-modes compiled --new-tokens 32 --prefill-chunk 0 \
  --decode-methods fp8-e4m3,int8,int4-g128 --json $OUT/run2_compiled.json 2>&1 | grep -E "$F" | tee $OUT/run2_compiled.log
timeout 150 python3 $D/step_parts.py fp8-e4m3:16 2>&1 | grep -v "__guards\|warn" | tee $OUT/run2_parts.log

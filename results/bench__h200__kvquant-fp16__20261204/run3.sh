# GPU run 3 (2026-12-04): 3-bit codes read as aligned 32-bit words (a funnel shift a group): KVQuant's CUDA tests,
# the sweep's register-lookup rows, kvquant-3 / kvquant-4 eager at batch 16 x 32k against DynamicCache.
set -o pipefail
export PYTHONUNBUFFERED=1
D=results/bench__h200__kvquant-fp16__20261204
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_nuq.py 2>&1 | tail -2 | tee $OUT/run3_tests.log
timeout 200 python3 $D/sweep.py "registers, fp16 dequant" "registers, fp32 dequant" 2>&1 | grep -v "warn(" \
  | tee $OUT/run3_sweep.log
timeout 230 hf-kvcache bench --parts e2e --decode-batches 16 --e2e-modes eager --new-tokens 32 --prefill-chunk 0 \
  --decode-methods kvquant-3,kvquant-4 --json $OUT/run3_b16.json 2>&1 | grep -v "warn(" | tee $OUT/run3_b16.log

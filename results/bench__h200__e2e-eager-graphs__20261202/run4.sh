# GPU run 4 (issue 28): `hf-kvcache bench --parts e2e` eager at batch 16 x 32k (run 3's eager part stopped at
# turboquant-3's chunked prefill: a Triton compile error of that kernel variant, see BENCHMARKS.md).
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1
timeout 330 hf-kvcache bench --parts e2e --decode-batches 16 --e2e-modes eager --new-tokens 32 --prefill-chunk 2048 \
  --decode-methods fp8-e4m3,int8,int4-g128,turboquant-4,kivi-2 \
  --json $OUT/run4_eager.json 2>&1 | grep -v Warning | tee $OUT/run4_eager.log

# GPU run 3 (issue 28): `hf-kvcache bench --parts e2e` (model.generate as users call it, 8-layer Llama-3-8B shape,
# random bf16 weights, a 32k random prompt): (A) eager, batch 1 and 16, DynamicCache and 8 presets built without
# max_cache_len, with the prefill_chunk_size=2048 call for peak memory; (B) compiled at batch 1 (max_cache_len,
# generate's compile) against transformers' StaticCache compiled. Each part prints its DynamicCache row.
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1
timeout 330 hf-kvcache bench --parts e2e --decode-batches 1,16 --e2e-modes eager --new-tokens 32 --prefill-chunk 2048 \
  --decode-methods fp8-e4m3,int8,int4-g128,turboquant-4,kivi-2,turboquant-3,int4-g32,kivi-4 \
  --json $OUT/run3_eager.json 2>&1 | grep -v Warning | tee $OUT/run3_eager.log
timeout 200 hf-kvcache bench --parts e2e --decode-batches 1 --e2e-modes compiled --new-tokens 32 --prefill-chunk 0 \
  --decode-methods fp8-e4m3,int8 --json $OUT/run3_compiled.json 2>&1 | grep -v Warning | tee $OUT/run3_compiled.log

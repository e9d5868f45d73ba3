# GPU run 7 (issue 28, 2026-12-03): `hf-kvcache bench --parts e2e` (model.generate as users call it, 8-layer Llama-3-8B
# shape, random bf16 weights, 32k random prompt, 32 new tokens): (A) eager at batch 16 for the presets run 4 did not
# reach, with the prefill_chunk_size=2048 call; (B) compiled (max_cache_len, generate's compile) at batch 1 and 16
# against transformers' StaticCache compiled; then the in-place storage test on CUDA (the pending token stored first).
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1
timeout 160 hf-kvcache bench --parts e2e --decode-batches 16 --e2e-modes eager --new-tokens 32 --prefill-chunk 2048 \
  --decode-methods kivi-2,turboquant-3,kivi-4 \
  --json $OUT/run7_eager.json 2>&1 | grep -v -i "warn" | grep -E "^(batch|\{|==)|rror" | tee $OUT/run7_eager.log
timeout 210 hf-kvcache bench --parts e2e --decode-batches 16,1 --e2e-modes compiled --new-tokens 32 --prefill-chunk 0 \
  --decode-methods fp8-e4m3,int4-g128 --json $OUT/run7_compiled.json 2>&1 | grep -E "^(batch|\{|==)|rror" | tee $OUT/run7_compiled.log
timeout 60 python3 -m pytest -q -p no:cacheprovider --tb=line -W ignore tests/kernels/test_pack.py -k in_place 2>&1 | tail -3

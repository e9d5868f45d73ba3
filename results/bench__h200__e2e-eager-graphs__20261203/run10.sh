# GPU run 10 (issue 28, 2026-12-03), after the mask function leaves plain causal prefill chunks out and a long write
# grows the capacity to what it needs (+64 tokens): (A) eager batch 16 x 32k with the prefill_chunk_size=2048 call
# (its peak); (B) compiled at batch 16 and 1 for fp8-e4m3, int8, int4-g128 against DynamicCache and transformers'
# StaticCache in one run. A second call was planned (eager batch 1 for more presets, the kernels' chunk tests on CUDA,
# what is live at the chunked peak now) and not made: run 11 replaced it.
set -o pipefail
export PYTHONUNBUFFERED=1
D=results/bench__h200__e2e-eager-graphs__20261203
F="^(batch|\{|==)|rror|memory"
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1
timeout 110 hf-kvcache bench --parts e2e --decode-batches 16 --e2e-modes eager --new-tokens 32 --prefill-chunk 2048 \
  --decode-methods fp8-e4m3 --json $OUT/run10_chunked.json 2>&1 | grep -E "$F" | tee $OUT/run10_chunked.log
timeout 290 hf-kvcache bench --parts e2e --decode-batches 16,1 --e2e-modes compiled --new-tokens 32 --prefill-chunk 0 \
  --decode-methods fp8-e4m3,int8,int4-g128 --json $OUT/run10_compiled.json 2>&1 | grep -E "$F" | tee $OUT/run10_compiled.log

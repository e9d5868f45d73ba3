# GPU run 10, second call (issue 28, 2026-12-03), after the mask function leaves plain causal prefill chunks out and a long write
# grows the capacity to what it needs (+64 tokens): (A) eager batch 16 x 32k with the prefill_chunk_size=2048 call
# (its peak); (B) compiled at batch 16 and 1 for fp8-e4m3, int8, int4-g128 against DynamicCache and transformers'
# StaticCache in one run; (C) eager batch 1 x 32k for the presets not measured there yet; (D) the fused kernels' chunk
# tests on CUDA (no mask: causal by position; a padding mask); (E) what is live at the chunked peak now.
set -o pipefail
export PYTHONUNBUFFERED=1
D=results/bench__h200__e2e-eager-graphs__20261203
F="^(batch|\{|==)|rror|memory"
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1
timeout 170 python3 $D/b1_presets.py dynamic,kivi-4,turboquant-3.5,turboquant-3,int4-g32,int2-g32,fp8-e5m2,exact,rotated-4,kvquant-4 \
  2>&1 | grep -E "^(warm|round)|rror" | tee $OUT/run10_b1.log
timeout 90 python3 -m pytest -q -p no:cacheprovider --tb=short -W ignore tests/kernels/test_decode.py \
  -k "without_a_mask_is_causal or padding_mask" 2>&1 | tail -4 | tee $OUT/run10_tests.log
timeout 70 python3 $D/mem_peak.py fp8-e4m3 16 2048 2>&1 | grep -v -i "warn" | tee $OUT/run10_mem.log

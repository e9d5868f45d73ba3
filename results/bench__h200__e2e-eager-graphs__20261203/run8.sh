# GPU run 8 (issue 28, 2026-12-03): where a decode step goes, eager and compiled (prof_decode.py); what is live at the
# peak of a chunked prefill (mem_peak.py); the fused kernels against the reference at the shapes users run.
set -o pipefail
export PYTHONUNBUFFERED=1
D=results/bench__h200__e2e-eager-graphs__20261203
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1
timeout 230 python3 $D/prof_decode.py fp8-e4m3:compiled:16 fp8-e4m3:compiled:1 fp8-e4m3:eager:16 turboquant-4:eager:16 \
  2>&1 | grep -v -i "warn" | tee $OUT/run8_prof.log
timeout 110 python3 $D/mem_peak.py fp8-e4m3 16 2048 2>&1 | grep -v -i "warn" | tee $OUT/run8_mem.log
timeout 200 python3 -m pytest -q -p no:cacheprovider --tb=short -W ignore -s -m cuda tests/kernels/test_decode.py \
  -k user_shapes 2>&1 | grep -E "^batch|passed|failed|Error|assert" | tee $OUT/run8_decode.log

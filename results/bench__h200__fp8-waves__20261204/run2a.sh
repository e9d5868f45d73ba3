# GPU run 2a (issue 28, 2026-12-04, a later session): a decode step's mask row loaded a tile ahead (sweep_mask.py);
# the kernels' CUDA tests with decode masks; compiled generate against eager with the decode mask built by
# `attention._decode_mask` (left-padded batches).
set -o pipefail
export PYTHONUNBUFFERED=1
D=results/bench__h200__fp8-waves__20261204
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1
timeout 150 python3 $D/sweep_mask.py 2>&1 | grep -v "warn" | tee $OUT/run2_mask.log
timeout 170 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_decode.py tests/kernels/test_turbo.py \
  -k "padding_mask or decode_step_matches or user_shapes" 2>&1 | grep -E "passed|failed|Error|assert" \
  | tee $OUT/run2_kernel_tests.log
timeout 240 python3 -m pytest -q -p no:cacheprovider -m cuda tests/test_pinned_capacity.py \
  -k "(captured and llama) or (generate_compiles and (fp8-e4m3 or int4-g32 or turboquant-3-kernel))" 2>&1 \
  | grep -E "passed|failed|Error|assert" | tee $OUT/run2_pinned_tests.log

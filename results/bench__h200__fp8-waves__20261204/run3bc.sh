# GPU runs 3b and 3c (issue 28, 2026-12-04, a later session): run 3's kernel-test call ran past its 150 s limit on a
# fresh machine (Triton compiling) and printed nothing; these two calls, made on the warm machine right after, replace
# it (the user-shapes tests of run 2a's call, past its 170 s limit too, were not run again).
set -o pipefail
F="PASSED|FAILED|passed|failed|rror"
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1
timeout 280 python3 -m pytest -q -rA -p no:cacheprovider tests/kernels/test_decode.py tests/kernels/test_turbo.py \
  -k "padding_mask" 2>&1 | grep -E "$F" | tee $OUT/run3b_kernel_tests.log
timeout 230 python3 -m pytest -q -rA -p no:cacheprovider tests/kernels/test_decode.py tests/kernels/test_turbo.py \
  -k "decode_step_matches or bfloat16" 2>&1 | grep -E "$F" | tee $OUT/run3c_kernel_tests.log

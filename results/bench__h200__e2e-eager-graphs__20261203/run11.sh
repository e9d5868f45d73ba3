# GPU run 11 (issue 28, 2026-12-03): run 10's eager fp8-e4m3 step at batch 16 was 11.66 ms (7.11 in run 4): the
# growth rules side by side (diag_growth.py), the chunked peak and eager batch 1 x 32k for more presets under the
# verdict, then the kernels' chunk tests on CUDA. Run 10's planned second call was not made: this replaced it.
set -o pipefail
export PYTHONUNBUFFERED=1
D=results/bench__h200__e2e-eager-graphs__20261203
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1
timeout 330 python3 $D/diag_growth.py new,round,old dynamic,kivi-4,turboquant-3.5,turboquant-3,int4-g32,int2-g32,exact,rotated-4,kvquant-4 \
  2>&1 | grep -E "^(b1|b16|verdict|warm|round|  warning)|rror" | tee $OUT/run11.log
timeout 45 python3 -m pytest -q -p no:cacheprovider --tb=short -W ignore tests/kernels/test_decode.py \
  -k "without_a_mask_is_causal or padding_mask" 2>&1 | tail -3 | tee $OUT/run11_tests.log

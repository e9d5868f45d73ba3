# GPU run 1 (2026-12-04): KVQuant's codebook lookup in registers. The CUDA tests of its kernels, then the sweep.
set -o pipefail
export PYTHONUNBUFFERED=1
D=results/bench__h200__kvquant-lookup__20261204
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
[ -n "$SKIP_TESTS" ] || timeout 200 python3 -m pytest -q -p no:cacheprovider -x tests/kernels/test_nuq.py 2>&1 | tail -15 | tee $OUT/run1_tests.log
timeout 360 python3 $D/sweep.py 2>&1 | grep -v "warn(" | tee $OUT/run1_sweep.log

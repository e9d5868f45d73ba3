# GPU run 2 (2026-12-04): the CUDA tests of KVQuant's kernels after the slot change (an empty slot's channel is -1),
# the sweep's default variants again.
set -o pipefail
export PYTHONUNBUFFERED=1
D=results/bench__h200__kvquant-lookup__20261204
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_nuq.py 2>&1 | tail -4 | tee $OUT/run2_tests.log
timeout 200 python3 $D/sweep.py selects registers 2>&1 | grep -v "warn(" | tee $OUT/run2_sweep.log

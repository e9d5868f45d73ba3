# GPU run 1 (2026-12-04): KVQuant's kernel dequantizing in fp16 (TUNING["nuq_fp16"]): its CUDA tests and the kernel
# sweep.
set -o pipefail
export PYTHONUNBUFFERED=1
D=results/bench__h200__kvquant-fp16__20261204
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_nuq.py 2>&1 | tail -6 | tee $OUT/run1_tests.log
timeout 360 python3 $D/sweep.py 2>&1 | grep -v "warn(" | tee $OUT/run1_sweep.log

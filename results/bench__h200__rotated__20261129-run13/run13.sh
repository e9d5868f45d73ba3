#!/bin/bash
# RotatedCache on the GPU: tests, kernel grid beside the unrotated formats, end to end.
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1 || echo "install failed"
timeout 90 python3 -m pytest -x -q -p no:cacheprovider tests/kernels/test_hadamard.py tests/methods/test_rotated.py 2>&1 | tail -4 | tee $OUT/tests_rotated.txt
timeout 50 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py -k "rotated" 2>&1 | tail -3 | tee $OUT/tests_cuda.txt
timeout 120 hf-kvcache bench --parts kernel --batches 1,16,64 --contexts 32768 --methods int4-g128,rotated-4,int2-g32:group_size=None,rotated-2 --json $OUT/kernel.json 2>&1 | grep -v Warn | tee $OUT/kernel.log
timeout 150 hf-kvcache bench --parts e2e --e2e-batch 16 --e2e-context 32768 --e2e-layers 8 --new-tokens 32 --methods int4-g128,rotated-4 --json $OUT/e2e.json 2>&1 | grep -v Warn | tee $OUT/e2e.log

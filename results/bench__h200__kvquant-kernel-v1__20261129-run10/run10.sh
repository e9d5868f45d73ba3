#!/bin/bash
# KVQuant kernels on the GPU: tests, sweep, kernel grid beside the other formats, capacity, end to end.
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1 || echo "install failed"
timeout 150 python3 -m pytest -x -q -p no:cacheprovider tests/kernels/test_nuq.py tests/methods/test_kvquant.py 2>&1 | tail -6 | tee $OUT/tests_nuq.log
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_decode.py 2>&1 | tail -3 | tee $OUT/tests_decode.log
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py -k "kvquant" 2>&1 | tail -3 | tee $OUT/tests_cuda.log
timeout 100 hf-kvcache bench --parts sweep --methods kvquant-3 --json $OUT/sweep.json 2>&1 | grep -v Warn | tee $OUT/sweep.log
timeout 150 hf-kvcache bench --parts kernel,capacity --batches 1,16,64 --contexts 4096,32768 --methods int4-g128,kivi-2,kvquant-3,kvquant-4,kvquant-2 --json $OUT/kernel.json 2>&1 | grep -v Warn | tee $OUT/kernel.log
timeout 170 hf-kvcache bench --parts e2e --e2e-batch 16 --e2e-context 32768 --e2e-layers 8 --new-tokens 32 --methods int4-g128,kvquant-3 --json $OUT/e2e.json 2>&1 | grep -v Warn | tee $OUT/e2e.log

#!/bin/bash
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1 || echo "install failed"
timeout 100 python3 -m pytest -x -q -p no:cacheprovider tests/kernels/test_nuq.py 2>&1 | tail -3 | tee $OUT/tests_nuq.txt
timeout 150 python3 .devrun/exp_nuq.py 2>&1 | grep -v Warn | tee $OUT/exp_nuq.log
source /tmp/best_nuq.sh; echo "kernel grid with $HF_KVCACHE_NUQ_BLOCK_N / $HF_KVCACHE_NUM_WARPS"
timeout 120 hf-kvcache bench --parts kernel --batches 1,16,64 --contexts 4096,32768 --methods kvquant-3,kvquant-2,kvquant-4 --json $OUT/kernel.json 2>&1 | grep -v Warn | tee $OUT/kernel.log
timeout 150 hf-kvcache bench --parts e2e --e2e-batch 16 --e2e-context 32768 --e2e-layers 8 --new-tokens 32 --methods kvquant-3 --json $OUT/e2e.json 2>&1 | grep -v Warn | tee $OUT/e2e.log

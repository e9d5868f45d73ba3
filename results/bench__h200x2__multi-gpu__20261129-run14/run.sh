#!/bin/bash
# Multi-GPU, second call: the 2-GPU tests, then the multi-GPU bench (8B shape, 32 layers, 16 x 32k) on part of the methods.
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1 || echo "install failed"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_multi_gpu.py 2>&1 | tail -8 | tee $OUT/tests_multi_gpu.txt
timeout 400 hf-kvcache bench --multi-gpu --methods ${METHODS:-int4-g128,fp8-e4m3,kivi-2} --json $OUT/multi_gpu.json 2>&1 | grep -v Warn | tail -40 | tee $OUT/multi_gpu.log

#!/bin/bash
# Multi-GPU, third call: the failing 2-GPU tests with tracebacks, then the bench on the other methods.
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1 || echo "install failed"
timeout 110 python3 -m pytest -x -q -p no:cacheprovider --tb=short tests/test_multi_gpu.py -k "kvquant or rotated or places" 2>&1 | grep -v Warn | tail -40 | tee $OUT/tests_multi_gpu.txt
timeout 380 hf-kvcache bench --multi-gpu --methods int8,rotated-4,kvquant-3 --json $OUT/multi_gpu.json 2>&1 | grep -v Warn | tail -40 | tee $OUT/multi_gpu.log

#!/bin/bash
# Issue 8's GPU run, last part: the pack kernels against the exact-division reference, and the two rotated cases left.
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1 || echo "install failed"
shard() { name=$1; gpu=$2; shift 2; s=$(date +%s); CUDA_VISIBLE_DEVICES=$gpu timeout 200 python3 -m pytest -q -p no:cacheprovider --tb=short -m "not slow" "$@" > $OUT/$name.log 2>&1; echo "== $name rc=$? $(( $(date +%s) - s ))s: $(tail -1 $OUT/$name.log)"; }
shard pack 0 tests/kernels/test_pack.py &
shard cuda_last 1 tests/test_cuda.py -k "rotated-4-qwen3" &
wait
for f in $OUT/*.log; do grep -E "^(FAILED|ERROR|E )" $f | head -20; done

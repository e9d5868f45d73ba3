#!/bin/bash
# The rest of issue 8's GPU run, in parallel shards (one pytest each).
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1 || echo "install failed"
shard() { name=$1; gpu=$2; shift 2; s=$(date +%s); CUDA_VISIBLE_DEVICES=$gpu timeout 330 python3 -m pytest -q -p no:cacheprovider --tb=short -m "not slow" --junitxml=$OUT/$name.xml "$@" > $OUT/$name.log 2>&1; echo "== $name rc=$? $(( $(date +%s) - s ))s: $(tail -1 $OUT/$name.log)"; }
shard cuda_tail 0 tests/test_cuda.py -k "kvquant or rotated" &
shard k_decode 1 tests/kernels/test_decode.py tests/kernels/test_hadamard.py &
shard k_integration 0 tests/kernels/test_integration.py &
shard k_pack 1 tests/kernels/test_nuq.py tests/kernels/test_pack.py &
wait
for f in $OUT/*.log; do grep -E "^(FAILED|ERROR)" $f | head -20; done

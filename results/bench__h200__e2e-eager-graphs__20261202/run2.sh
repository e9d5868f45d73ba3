# GPU run 2 (issue 28): the CUDA suites the one storage touches, in parallel shards on the one GPU: eager steps
# replayed from CUDA graphs against launched kernels and the reference (tests/test_cuda_graphs.py), every cache in
# bf16 on every tiny config (tests/test_cuda.py), the static-layout kernels and the integration tests.
set -o pipefail
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1
shard() { name=$1; shift; s=$(date +%s); timeout 420 python3 -m pytest -q -p no:cacheprovider --tb=short -W ignore "$@" > /tmp/$name.log 2>&1; echo "== $name rc=$? $(( $(date +%s) - s ))s: $(tail -1 /tmp/$name.log)"; }
shard g_fp8 tests/test_cuda_graphs.py -k "fp8 or exact" &
shard g_int tests/test_cuda_graphs.py -k "int8 or int4 or int2" &
shard g_kivi tests/test_cuda_graphs.py -k "kivi" &
shard g_rest tests/test_cuda_graphs.py -k "kvquant or rotated or turboquant or beam or bf16" &
shard cuda_a tests/test_cuda.py -k "fp8 or int8 or int4" &
shard cuda_b tests/test_cuda.py -k "not (fp8 or int8 or int4)" &
shard kern tests/kernels/test_static.py tests/kernels/test_integration.py tests/kernels/test_turbo.py tests/kernels/test_nuq.py &
shard pinned tests/test_pinned_capacity.py -m cuda -k "default_model_shape or (captured and llama)" &
wait
for f in /tmp/g_*.log /tmp/cuda_*.log /tmp/kern.log /tmp/pinned.log; do grep -E "^(FAILED|ERROR)|Error|assert" $f | head -12; done
cat /tmp/g_*.log /tmp/cuda_*.log /tmp/kern.log /tmp/pinned.log > $OUT/run2_cuda_tests.log

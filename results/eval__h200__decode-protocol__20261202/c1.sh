# Session C, run 1 (no model needed): the first half of the default model's file to /root/m for run 2, then the CUDA
# suites this changes touch, in parallel shards on the one GPU: the kernels (decode at the shapes users run,
# integration, pack / NUQ / TurboQuant), generate on bf16 for every method and architecture, and the static form.
set -o pipefail
mkdir -p /root/m && cp .gpu-model-1/* /root/m/ && ls /root/m
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1
python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)"
shard() { name=$1; shift; s=$(date +%s); timeout 500 python3 -m pytest -q -p no:cacheprovider --tb=short -W ignore "$@" > /tmp/$name.log 2>&1; echo "== $name rc=$? $(( $(date +%s) - s ))s: $(tail -1 /tmp/$name.log)"; }
shard k_decode tests/kernels/test_decode.py -s &
shard k_integration tests/kernels/test_integration.py &
shard k_rest tests/kernels --ignore=tests/kernels/test_decode.py --ignore=tests/kernels/test_integration.py &
shard cuda_a tests/test_cuda.py -k "fp8 or int8" &
shard cuda_b tests/test_cuda.py -k "int4 or int2 or kivi" &
shard cuda_c tests/test_cuda.py -k "kvquant or rotated or turboquant" &
shard static tests/test_static.py -m "cuda and not slow" &
wait
for f in /tmp/k_*.log /tmp/cuda_*.log /tmp/static.log; do grep -E "^(FAILED|ERROR)|^batch" $f | head -40; done
cat /tmp/k_*.log /tmp/cuda_*.log /tmp/static.log > $OUT/c1_cuda_tests.log

# GPU run 5 (issue 28, 2026-12-03): where the eager decode step's time goes at batch 1 x 32k (profile_step.py), then
# the CUDA-graph tests (tests/test_cuda_graphs.py) in four shards on the one GPU.
set -o pipefail
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
d=results/bench__h200__e2e-eager-graphs__20261203
timeout 230 python3 $d/profile_step.py dynamic,fp8-e4m3,int8,int4-g128,turboquant-4,kivi-2 1 2>&1 | grep -v "warn(" | tee $OUT/run5_profile.log
shard() { name=$1; shift; s=$(date +%s); timeout 300 python3 -m pytest -q -p no:cacheprovider --tb=short -W ignore "$@" > /tmp/$name.log 2>&1; echo "== $name rc=$? $(( $(date +%s) - s ))s: $(tail -1 /tmp/$name.log)"; }
shard g_fp8 tests/test_cuda_graphs.py -k "fp8 or exact or bf16" &
shard g_int tests/test_cuda_graphs.py -k "int8 or int4 or int2" &
shard g_kivi tests/test_cuda_graphs.py -k "kivi" &
shard g_rest tests/test_cuda_graphs.py -k "kvquant or rotated or turboquant or beam" &
wait
for f in /tmp/g_*.log; do grep -E "^(FAILED|ERROR)|Error|assert" $f | head -12; done
cat /tmp/g_*.log > $OUT/run5_cuda_graphs.log

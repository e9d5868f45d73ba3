# GPU run 6 (issue 28, 2026-12-03): generate's eager decode step at batch 1 x 32k under cProfile and the sync checker
# (profile_generate.py), then the pinned-capacity CUDA tests and the kernel tests in shards on the one GPU.
set -o pipefail
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1
d=results/bench__h200__e2e-eager-graphs__20261203
timeout 170 python3 $d/profile_generate.py dynamic,fp8-e4m3,int8,int4-g128,turboquant-4,kivi-2 1 2>&1 | grep -v "warn(" | tee $OUT/run6_profile.log
shard() { name=$1; shift; s=$(date +%s); timeout 330 python3 -m pytest -q -p no:cacheprovider --tb=short -W ignore "$@" > /tmp/$name.log 2>&1; echo "== $name rc=$? $(( $(date +%s) - s ))s: $(tail -1 /tmp/$name.log)"; }
shard pin_a tests/test_pinned_capacity.py -m cuda -k "fp8 or int8 or int4 or exact" &
shard pin_b tests/test_pinned_capacity.py -m cuda -k "not (fp8 or int8 or int4 or exact)" &
shard kern tests/kernels/test_static.py tests/kernels/test_integration.py tests/kernels/test_turbo.py tests/kernels/test_nuq.py tests/kernels/test_pack.py &
wait
for f in /tmp/pin_*.log /tmp/kern.log; do grep -E "^(FAILED|ERROR)|Error|assert" $f | head -12; done
cat /tmp/pin_*.log /tmp/kern.log > $OUT/run6_tests.log

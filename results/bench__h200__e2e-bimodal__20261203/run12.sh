# GPU run 12 (issue 28, 2026-12-03, a third session): the CUDA suites after the previous session's changes (the mask
# function, 64-token capacities, static marks) and this one's (a decode step's query and K/V copied into its graph's
# buffers in one launch): nine shards on the one GPU at once (their timings mean nothing).
set -o pipefail
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
shard() { name=$1; shift; s=$(date +%s); timeout 470 python3 -m pytest -q -p no:cacheprovider --tb=short -W ignore "$@" > /tmp/$name.log 2>&1; echo "== $name rc=$? $(( $(date +%s) - s ))s: $(tail -1 /tmp/$name.log)"; }
shard g_fp8 tests/test_cuda_graphs.py -k "fp8 or exact or bf16" &
shard g_int tests/test_cuda_graphs.py -k "int8 or int4 or int2" &
shard g_kivi tests/test_cuda_graphs.py -k "kivi" &
shard g_rest tests/test_cuda_graphs.py -k "kvquant or rotated or turboquant or beam" &
shard p_gen tests/test_pinned_capacity.py -m cuda -k "generate_compiles" &
shard p_dflt tests/test_pinned_capacity.py -m cuda -k "default_model" &
shard p_cap1 tests/test_pinned_capacity.py -m cuda -k "captured and (llama or mqa)" &
shard p_cap2 tests/test_pinned_capacity.py -m cuda -k "captured and (gemma or qwen3)" &
shard k_dec tests/kernels/test_decode.py -k "without_a_mask_is_causal or padding_mask" &
wait
for f in /tmp/g_*.log /tmp/p_*.log /tmp/k_*.log; do grep -E "^(FAILED|ERROR)|Error|assert" $f | head -12; done
cat /tmp/g_*.log /tmp/p_*.log /tmp/k_*.log > $OUT/run12_tests.log

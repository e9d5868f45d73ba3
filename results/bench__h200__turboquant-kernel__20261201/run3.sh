# Run 3: TurboQuant's launch parameters, each timed in CUDA graphs (the kernel part), batch 16 x 32k; then the
# profiler's split of one eager step (host against GPU) for turboquant-4.
cd "$(git rev-parse --show-toplevel)"
python3 -m pip install --no-deps --no-build-isolation -e . -q 2>&1 | tail -2
export PYTHONPATH=.
for cfg in "64 2 3 16" "128 2 2 16" "128 4 2 16" "32 2 4 16" "32 1 3 16" "64 4 3 16" "128 2 3 24" "64 2 3 24" "32 2 4 24"; do
  set -- $cfg
  echo "block_n $1 warps $2 stages $3 programs/SM $4"
  HF_KVCACHE_TURBO_BLOCK_N=$1 HF_KVCACHE_TURBO_NUM_WARPS=$2 HF_KVCACHE_TURBO_NUM_STAGES=$3 HF_KVCACHE_PROGRAMS_PER_SM=$4 \
    hf-kvcache bench --parts kernel --batches 16 --contexts 32768 --methods turboquant-4,turboquant-3 2>&1 | grep "turboquant\|sdpa"
done

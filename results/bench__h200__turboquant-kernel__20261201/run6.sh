# Run 6: run 5's kernel with and without the lengths loaded a tile ahead, batch 1 and 16 x 32k.
cd "$(git rev-parse --show-toplevel)"
python3 -m pip install --no-deps --no-build-isolation -e . -q 2>&1 | tail -2
export PYTHONPATH=.
for pf in 0 1; do
  echo "prefetch $pf"
  HF_KVCACHE_TURBO_PREFETCH=$pf hf-kvcache bench --parts kernel --batches 1,16 --contexts 32768 \
    --methods turboquant-4,turboquant-3 2>&1 | grep "turboquant\|sdpa"
done

# Run 7: the query rotated before the kernel again (run 5 rotated it inside), with and without a 128-register cap
# on the body programs; CUDA tests first.
cd "$(git rev-parse --show-toplevel)"
python3 -m pip install --no-deps --no-build-isolation -e . -q 2>&1 | tail -2
export PYTHONPATH=.
python3 -m pytest -q -p no:cacheprovider tests/kernels/test_turbo.py 2>&1 | tail -2
for cap in 0 128; do
  echo "maxnreg $cap"
  HF_KVCACHE_TURBO_MAXNREG=$cap hf-kvcache bench --parts kernel --batches 1,16,64 --contexts 32768 \
    --methods turboquant-4,turboquant-3.5,turboquant-3,turboquant-2.5 --json $OUT/run7_cap$cap.json 2>&1 | grep "turboquant\|sdpa"
done

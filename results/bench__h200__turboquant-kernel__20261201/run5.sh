# Run 5: lengths loaded a tile ahead, the query's rotation in the kernel and the output's in the combine (no rotation
# outside the kernels): CUDA tests, then the table.
cd "$(git rev-parse --show-toplevel)"
python3 -m pip install --no-deps --no-build-isolation -e . -q 2>&1 | tail -2
export PYTHONPATH=.
python3 -m pytest -q -p no:cacheprovider tests/kernels/test_turbo.py 2>&1 | tail -4
hf-kvcache bench --parts kernel --batches 1,16,64 --contexts 32768 \
  --methods turboquant-4,turboquant-3.5,turboquant-3,turboquant-2.5,int4-g128,fp8-e4m3 --json $OUT/run5_kernel.json 2>&1 | grep -v Warn | tail -24

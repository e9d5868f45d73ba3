# Run 8: the tail's weighted sum kept in the model's frame and added after the combine rotates the body's (run 7's
# tail rotated it with an fp32 product in the kernel, ~60 us a program); CUDA tests, then the table.
cd "$(git rev-parse --show-toplevel)"
python3 -m pip install --no-deps --no-build-isolation -e . -q 2>&1 | tail -2
export PYTHONPATH=.
python3 -m pytest -q -p no:cacheprovider tests/kernels/test_turbo.py 2>&1 | tail -2
hf-kvcache bench --parts kernel --batches 1,16,64 --contexts 32768 \
  --methods turboquant-4,turboquant-3.5,turboquant-3,turboquant-2.5,int4-g128,fp8-e4m3 --json $OUT/run8_kernel.json 2>&1 | grep "turboquant\|sdpa\|int4\|fp8\|copy"

# Run 4: the code as committed (128-token tiles, 4 warps, 2 stages): CUDA tests of both kernels, then the table.
cd "$(git rev-parse --show-toplevel)"
python3 -m pip install --no-deps --no-build-isolation -e . -q 2>&1 | tail -2
export PYTHONPATH=.
python3 -m pytest -q -p no:cacheprovider tests/kernels/test_turbo.py tests/kernels/test_decode.py tests/methods/test_turboquant.py 2>&1 | tail -4
hf-kvcache bench --parts kernel --batches 1,16,64 --contexts 32768 \
  --methods turboquant-4,turboquant-3.5,turboquant-3,turboquant-2.5,int4-g128,fp8-e4m3 --json $OUT/run4_kernel.json 2>&1 | grep -v Warn | tail -24

# Run 1: TurboQuant's kernel on the H200: CUDA tests, then the kernel bench (register lookup), then the load lookup.
cd "$(git rev-parse --show-toplevel)"
python3 -m pip install --no-deps --no-build-isolation -e . -q 2>&1 | tail -2
export PYTHONPATH=.
python3 -m pytest -q -p no:cacheprovider tests/kernels/test_turbo.py -x 2>&1 | tail -25
hf-kvcache bench --parts kernel --batches 1,16,64 --contexts 32768 \
  --methods turboquant-4,turboquant-3.5,turboquant-3,turboquant-2.5,int4-g128,fp8-e4m3 --json $OUT/run1_kernel.json 2>&1 | grep -v Warn | tail -30
HF_KVCACHE_TURBO_LOOKUP=load hf-kvcache bench --parts kernel --batches 16 --contexts 32768 \
  --methods turboquant-4,turboquant-3 2>&1 | grep -v Warn | tail -4

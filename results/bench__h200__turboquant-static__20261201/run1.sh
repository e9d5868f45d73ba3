# Run 1: TurboQuant's static kernel and the frame as (R, order) on CUDA: the kernel tests (the last session's review
# commits were checked under the interpreter only), generation through the kernels, the compiled static form
# (captured and Inductor), then the kernel table against run 8 of the fourth session.
cd "$(git rev-parse --show-toplevel)"
export PYTHONUNBUFFERED=1 PYTHONPATH=.
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
timeout 170 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_turbo.py tests/kernels/test_decode.py -W ignore 2>&1 | tail -3
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_integration.py -k "turboquant and not default" -W ignore 2>&1 | tail -3
timeout 200 python3 -m pytest -v -p no:cacheprovider tests/test_static.py -m cuda -k "turboquant-3-kernel or (default_model_shape and turboquant)" -W ignore 2>&1 | grep -E "PASSED|FAILED|ERROR|^E  .{0,200}" | cut -c1-250 | tail -30
timeout 100 hf-kvcache bench --parts kernel --batches 1,16 --contexts 32768 --methods turboquant-4,turboquant-3,int4-g128 --json $OUT/run1_kernel.json 2>&1 | grep "turboquant\|sdpa\|int4\|copy"

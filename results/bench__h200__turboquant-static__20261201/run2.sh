# Run 2: the decode-step table, batch 16 x 32k: TurboQuant eager (dynamic) and compiled (static, its kernel through
# the operator), beside DynamicCache, transformers' StaticCache compiled and our exact cache compiled; then the
# kernel tests whose summary run 1's output cut, and the default model's shape compiled (run 1's time limit).
cd "$(git rev-parse --show-toplevel)"
export PYTHONUNBUFFERED=1 PYTHONPATH=.
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
timeout 360 python3 -m hf_kvcache.cli bench --parts decode --decode-batches 16 --decode-methods turboquant-3,turboquant-4 --json $OUT/run2_decode.json 2>&1 | grep -v -i "warn\|originates\|use_kernels\|triton_available\|^$\|^  " | tee $OUT/run2_decode.log
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_turbo.py tests/kernels/test_decode.py -W ignore 2>&1 | tail -3 | tee $OUT/run2_tests.log
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_static.py -m cuda -k "default_model_shape and turboquant" -W ignore 2>&1 | tail -3 | tee -a $OUT/run2_tests.log

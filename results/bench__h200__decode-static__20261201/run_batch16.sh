export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
timeout 260 python3 -m hf_kvcache.cli bench --parts decode --decode-batches 16 --decode-methods fp8-e4m3,int8,int4-g128,kivi-2 --json $OUT/decode16.json 2>&1 | grep -v -i "warn\|originates\|use_kernels\|triton_available\|^$\|^  " | tee $OUT/bench16.log
timeout 290 python3 -m pytest -v -p no:cacheprovider tests/test_static.py -m cuda -W ignore -o log_level=ERROR 2>&1 | grep -E "PASSED|FAILED|ERROR|^E  .{0,200}" | cut -c1-250 | tee $OUT/cuda_tests.log | tail -60

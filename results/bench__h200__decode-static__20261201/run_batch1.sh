export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
timeout 330 python3 -m pytest -q -p no:cacheprovider tests/test_static.py -m cuda -x -W ignore 2>&1 | tail -15 | tee $OUT/cuda_tests.log
timeout 250 python3 -m hf_kvcache.cli bench --parts decode --decode-batches 1 --decode-methods fp8-e4m3,int8,int4-g128,kivi-2 --json $OUT/decode1.json 2>&1 | grep -v -i "warn\|originates\|use_kernels\|triton_available\|^$\|^  " | tee $OUT/bench1.log

export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
TORCH_LOGS=perf_hints timeout 560 python3 gpu/run2.py 2>&1 | grep -v -i "warn\|originates\|use_kernels\|triton_available\|^$" | tee $OUT/run2.log | grep -v "^--\|^Name\|Self CPU" | cut -c1-200 | grep -i -v "dynamo detected" > $OUT/short.log; cat $OUT/short.log | tail -150

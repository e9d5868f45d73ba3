# Session C, run 4 (a fresh machine, after the fixes of commit "Reference attention ... float64"): the two static
# tests that failed in run 3, alone.
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=8; python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1
timeout 150 python3 -m pytest -q -p no:cacheprovider --tb=line -W ignore tests/test_static.py -m cuda -k "captured and turboquant-3.5" 2>&1 | tail -4
timeout 150 python3 -m pytest -q -p no:cacheprovider --tb=line -W ignore tests/test_static.py -m cuda -k "generate_compiles and fp8-e4m3" 2>&1 | tail -4

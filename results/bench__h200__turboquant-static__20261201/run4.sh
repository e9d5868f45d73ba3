# Run 4: run 3's failures of the pack test, in full: every one was a zero length, +0 from the kernel's sum and -0
# from PyTorch's (0 times a negative centroid); the test now compares lengths as values (commit of this run).
export PYTHONPATH=.; python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1; timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_pack.py -k turboquant -W ignore 2>&1 | grep -E "^E |Error|passed|failed" | cut -c1-300 | head -40

# Run 9: generation through TurboQuant's kernel against the dense path on every tiny model (CUDA).
cd "$(git rev-parse --show-toplevel)"
python3 -m pip install --no-deps --no-build-isolation -e . -q 2>&1 | tail -2
export PYTHONPATH=.
python3 -m pytest -q -p no:cacheprovider tests/kernels/test_integration.py -k turboquant 2>&1 | tail -4

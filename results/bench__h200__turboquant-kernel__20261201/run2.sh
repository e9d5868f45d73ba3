# Run 2: launch parameters of TurboQuant's kernel (tile tokens, warps, stages) at batch 16 x 32k.
cd "$(git rev-parse --show-toplevel)"
python3 -m pip install --no-deps --no-build-isolation -e . -q 2>&1 | tail -2
export PYTHONPATH=.
hf-kvcache bench --parts sweep --methods turboquant-4,turboquant-3 2>&1 | grep -v Warn | tail -34
for p in 8 24 32; do
  HF_KVCACHE_PROGRAMS_PER_SM=$p hf-kvcache bench --parts kernel --batches 16 --contexts 32768 --methods turboquant-4,turboquant-3 2>&1 | grep turboquant
done

# GPU run 1a (issue 28, 2026-12-04, a later session): the split-K count, stages, warps and tiles of the whole-row
# formats' decode attention at batch 16 (1, 64) x 32k; the host time of one eager layer step of every preset.
set -o pipefail
export PYTHONUNBUFFERED=1
D=results/bench__h200__fp8-waves__20261204
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv
timeout 250 python3 $D/sweep.py fp8-e4m3 int8 int4-g128 2>&1 | grep -v "warn" | tee $OUT/run1_sweep.log
timeout 200 python3 $D/host_steps.py 2>&1 | grep -v "warn" | tee $OUT/run1_host.log

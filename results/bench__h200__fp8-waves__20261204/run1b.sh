# GPU run 1b (issue 28, 2026-12-04, a later session): where a compiled decode step goes on the host (step_parts.py).
set -o pipefail
export PYTHONUNBUFFERED=1
D=results/bench__h200__fp8-waves__20261204
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1
timeout 280 python3 $D/step_parts.py fp8-e4m3:16 fp8-e4m3:1 static:1 2>&1 | grep -v "__guards\|warn" \
  | tee $OUT/run1_parts.log

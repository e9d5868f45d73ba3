# Run 6: where an eager TurboQuant update's host time goes (`host_profile_t3.log`).
export PYTHONPATH=.; python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1; timeout 60 python3 results/bench__h200__turboquant-static__20261201/host_profile.py turboquant-3 2>&1 | tee $OUT/host_profile_t3.log | head -45

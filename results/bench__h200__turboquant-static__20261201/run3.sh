# Run 3: TurboQuant's pack kernel (`pack._pack_turbo`, eager and through the operator when compiled): its codes
# against the reference on CUDA, generation and the compiled static form through both kernels, then the decode-step
# table of run 2 again (eager host time per layer: run 2 measured 6787 us for turboquant-3 with the PyTorch encode).
cd "$(git rev-parse --show-toplevel)"
export PYTHONUNBUFFERED=1 PYTHONPATH=.
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_pack.py tests/kernels/test_turbo.py tests/kernels/test_integration.py -k "turboquant and not default" -W ignore 2>&1 | tail -4 | tee $OUT/run3_tests.log
timeout 90 python3 -m pytest -q -p no:cacheprovider tests/test_static.py -m cuda -k "turboquant-3-kernel and (llama or mqa)" -W ignore 2>&1 | tail -3 | tee -a $OUT/run3_tests.log
timeout 300 python3 -m hf_kvcache.cli bench --parts decode --decode-batches 16 --decode-methods turboquant-3,turboquant-4 --json $OUT/run3_decode.json 2>&1 | grep -v -i "warn\|originates\|use_kernels\|triton_available\|^$\|^  " | tee $OUT/run3_decode.log

# GPU run 3 (issue 28, 2026-12-04, a later session): the CUDA tests of the mask row a tile ahead (kernels, graphed eager
# steps of left-padded batches) and of compiled generate with the decode mask, each failure named.
set -o pipefail
export PYTHONUNBUFFERED=1
F="PASSED|FAILED|passed|failed|rror"
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1
timeout 150 python3 -m pytest -q -rA -p no:cacheprovider tests/kernels/test_decode.py tests/kernels/test_turbo.py \
  -k "padding_mask or decode_step_matches or chunk_of_queries_with" 2>&1 | grep -E "$F" | tee $OUT/run3_kernel_tests.log
timeout 170 python3 -m pytest -q -rA -p no:cacheprovider tests/test_cuda_graphs.py \
  -k "test_graphed_steps_give_the_reference_tokens and llama" 2>&1 | grep -E "$F" | tee $OUT/run3_graph_tests.log
timeout 170 python3 -m pytest -q -rA -p no:cacheprovider -m cuda tests/test_pinned_capacity.py \
  -k "generate_compiles and (fp8-e4m3 or int4-g32)" 2>&1 | grep -E "$F" | tee $OUT/run3_pinned_tests.log

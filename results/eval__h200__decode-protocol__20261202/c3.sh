# Session C, run 3 (typed into the warm minutes after run 2; the same command): what runs 1 could not finish or
# needed the model: the default model through the kernels (integration), and the static form's CUDA tests that
# run 1's shard did not reach (generate compiling the static cache, the default model's shape, captured steps).
. results/eval__h200__decode-protocol__20261202/setup.sh >/dev/null 2>&1; export OMP_NUM_THREADS=3
shard() { name=$1; shift; s=$(date +%s); timeout 470 python3 -m pytest -q -p no:cacheprovider --tb=short -W ignore "$@" > $OUT/c3_$name.log 2>&1; echo "== $name rc=$? $(( $(date +%s) - s ))s: $(tail -1 $OUT/c3_$name.log)"; }
shard integration tests/kernels/test_integration.py -k default_model &
shard compiles tests/test_static.py -m cuda -k generate_compiles &
shard shape tests/test_static.py -m cuda -k default_model_shape &
shard captured tests/test_static.py -m cuda -k "captured and (turboquant or kvquant or rotated or kivi)" &
wait

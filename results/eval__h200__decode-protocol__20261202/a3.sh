# Session A, run 3: the decode protocol at P=6144 (64 windows, 64 decoded tokens, one batch), bf16 through the fused
# kernels: every preset and the variants the presets are chosen from (exact windows, sinks, widths per stream), in
# two evals of the same windows (each with its baseline), so that a time-out loses half.
set -o pipefail
. results/eval__h200__decode-protocol__20261202/setup.sh
timeout 90 python3 -m hf_kvcache.cli calibrate --device cuda --no-progress 2>&1 | tail -1 | tee $OUT/a3_calibrate.log
A="exact fp8-e4m3 fp8-e5m2 int8 int4-g32 int4-g64 int2-g32 int4-g64:residual_length=64
 int4-g64:residual_length=32,sink_tokens=1 kivi-4 kivi-2 kivi-4:residual_length=64 kivi-2:residual_length=64
 kivi-2:residual_length=32 kvquant-4 kvquant-3 kvquant-2 kvquant-4:outlier_fraction=0
 rotated-4 rotated-3 rotated-2 rotated-4:residual_length=64 rotated-3:residual_length=64 rotated-2:residual_length=64
 rotated-2:group_size=32"
B="turboquant-4 turboquant-3.5 turboquant-3 turboquant-2.5 turboquant-4:residual_length=32
 turboquant-4:residual_length=64 turboquant-4:residual_length=64,sink_tokens=1 turboquant-3.5:residual_length=64
 turboquant-3:residual_length=64 turboquant-3:key_bits=3,value_bits=3 turboquant-3:key_bits=3,value_bits=3,residual_length=64
 turboquant-3:key_bits=3,value_bits=2.5 turboquant-3:key_bits=3,value_bits=2.5,residual_length=64
 turboquant-2.5:residual_length=16 turboquant-2.5:residual_length=32 turboquant-2.5:key_bits=3,value_bits=2"
for part in A B; do
  timeout 270 python3 -m hf_kvcache.cli eval --methods ${!part} --prefill 6144 --windows 64 --no-passkey --no-progress \
    --out /tmp/r 2>&1 | grep -v -i "warn\|^$\|^  \|it/s\]" | tee $OUT/a3_sweep_$part.log
  tar czf $OUT/a3_results.tgz -C /tmp/r .
done

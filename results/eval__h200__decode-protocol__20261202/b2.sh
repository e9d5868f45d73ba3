# Session B, run 2: KVQuant's calibration on the GPU host (16k tokens of the dev corpus), then the decode protocol at
# P=6144 (the same 64 windows as run a3) for the families run a3 lost to that calibration's time-out: FP8, INT,
# KIVI, the rotated cache and their window variants; KVQuant apart (its calibration may fail alone).
set -o pipefail
. results/eval__h200__decode-protocol__20261202/setup.sh
timeout 100 python3 -m hf_kvcache.cli calibrate --device cuda --no-progress 2>&1 | grep -v -i "warn\|it/s\]" | tee $OUT/b2_calibrate.log
A="exact fp8-e4m3 fp8-e5m2 int8 int4-g32 int4-g64 int2-g32 int4-g64:residual_length=64
 int4-g64:residual_length=32,sink_tokens=1 kivi-4 kivi-2 kivi-4:residual_length=64 kivi-2:residual_length=64
 kivi-2:residual_length=32 rotated-4 rotated-3 rotated-2 rotated-4:residual_length=64 rotated-3:residual_length=64
 rotated-2:residual_length=64 rotated-2:group_size=32"
K="kvquant-4 kvquant-3 kvquant-2 kvquant-4:outlier_fraction=0"
timeout 260 python3 -m hf_kvcache.cli eval --methods $A --prefill 6144 --windows 64 --no-passkey --no-progress \
  --out /tmp/r 2>&1 | grep -v -i "warn\|^$\|^  \|it/s\]" | tee $OUT/b2_sweep_A.log
tar czf $OUT/b2_results.tgz -C /tmp/r .
timeout 90 python3 -m hf_kvcache.cli eval --methods $K --prefill 6144 --windows 64 --no-passkey --no-progress \
  --out /tmp/r 2>&1 | grep -v -i "warn\|^$\|^  \|it/s\]" | tee $OUT/b2_sweep_K.log
tar czf $OUT/b2_results.tgz -C /tmp/r .

# Session B, run 3: the final presets at P=1024 on the 16 windows of the CPU float32 reference, through the kernels
# (backend triton) and through the PyTorch reference on the GPU (backend torch), bf16; then retrieval (multi-key,
# multi-value, variable tracking at 2k/4k/8k, 50 prompts a cell) for one preset of each family.
set -o pipefail
. results/eval__h200__decode-protocol__20261202/setup.sh
P="exact fp8-e4m3 fp8-e5m2 int8 int4-g32 int4-g64 int2-g32 kivi-4 kivi-2 rotated-4 rotated-3 rotated-2 turboquant-4
 turboquant-3.5 turboquant-3 turboquant-2.75 turboquant-2.5 kvquant-4 kvquant-3 kvquant-2"
ls /root/hfkv/calibration/*.safetensors || P=${P/ kvquant-4 kvquant-3 kvquant-2/}  # run b2's calibration failed
for backend in triton torch; do
  timeout 80 python3 -m hf_kvcache.cli eval --methods $P --prefill 1024 --windows 16 --backend $backend --no-passkey \
    --no-progress --out /tmp/r 2>&1 | grep -v -i "warn\|^$\|^  \|it/s\]" | tee $OUT/b3_p1024_$backend.log
  tar czf $OUT/b3_results.tgz -C /tmp/r .
done
timeout 150 python3 -m hf_kvcache.cli eval --methods fp8-e4m3 int4-g32 kivi-2 rotated-4 turboquant-4 \
  turboquant-2.5 --protocol decode --prefill 16 --decode-tokens 1 --windows 1 --no-passkey --retrieval all \
  --retrieval-batch 50 --no-progress --out /tmp/r 2>&1 | grep -v -i "warn\|^$\|^  \|it/s\]" | tee $OUT/b3_retrieval.log
tar czf $OUT/b3_results.tgz -C /tmp/r .

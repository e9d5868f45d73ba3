#!/usr/bin/env bash
# The next GPU run (issue 52), one `run` call on the device host (torch, transformers and triton are the host's):
#   bash scripts/gpu_next.sh A    checks: FP8 by its bits, fp16 and bf16 at users' shapes, the compiled first call
#   bash scripts/gpu_next.sh B    speed: batch 1 x 32k eager, interleaved repeats, every front preset
#   bash scripts/gpu_next.sh C    speed of transformers' QuantizedCache (quanto) beside the presets of its bytes, batch 1
#                                 and 16 x 32k; carry [".whl"]: `pip download --no-deps --only-binary=:all:
#                                 --python-version 3.12 -d .whl optimum-quanto ninja` here first
#   bash scripts/gpu_next.sh E    batch 1's GPU time (issue 52): the kernels of a step by GPU time beside DynamicCache's
#                                 (scripts/profile_batch1.py), then one layer's read at 1 x 32k over split counts
#   bash scripts/gpu_next.sh F    the compiled step's speed at batch 1 x 32k (fp8-e4m3, turboquant-4 against DynamicCache
#                                 eager and StaticCache compiled) and every TurboQuant preset's chunked prefill, its kernels
#                                 beside DynamicCache's (scripts/profile_batch1.py prefill)
#   bash scripts/gpu_next.sh G    after the batch-1 kernel changes (8 tiles a split, the one-pass combine, narrow rotation
#                                 blocks): CUDA checks, the step's kernels, one layer at 1 and 16 x 32k, then B
#   bash scripts/gpu_next.sh H    one layer at batch 1 and 16 x 32k, the tail dealt to one program against up to 16
#                                 (two rounds each); a graphed step's kernels with its token placed by PyTorch's
#                                 operations and by one launch; then batch 1 over warps, stages and longer splits
#   bash scripts/gpu_next.sh I    TurboQuant's chunked prefill at batch 1 and 16, its rotations by cuBLAS against
#                                 `hadamard._rows_times` (HF_KVCACHE_ROWS_CUBLAS=0)
#   bash scripts/gpu_next.sh J    the least of I: batch 1, turboquant-4 with its rotations by cuBLAS
#   bash scripts/gpu_next.sh D    issue 54: packed pages on CUDA (tests), the serving part of the bench and a profile
#                                 of one format's run (scripts/profile_serving.py); needs
#                                 transformers 5.25: carry [".whl525"], made here (git-ignored) by `pip download
#                                 --no-deps` as for C of transformers==5.25.0 huggingface-hub==2.4.0 kernels==0.19.1
#                                 httpx2==2.17.0 httpcore2==2.17.0 hf-xet==1.8.0 click==8.4.2 regex tomlkit truststore
#                                 idna anyio (the host has transformers 5.17 and huggingface-hub 1.33)
# Logs go to $OUT (or ./gpu-out).
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1 || { tail "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
case "${1:-A}" in
A)
  # one -k a pytest call (a second -k replaces the first); the users' shapes took over 200 s on 2026-12-07
  timeout 60 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_pack.py -k fp8 2>&1 \
    | tee "$OUT/a0_pack.log" | tail -5
  timeout 330 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_decode.py \
    -k "fp8_read_by_its_bits or (user_shapes and (1x32k or 16x32k))" 2>&1 | tee "$OUT/a1_kernels.log" | tail -15
  # 2026-12-07 (H100): the six below passed, TurboQuant's included (results/bench__h100__gpu-next__20261207)
  timeout 330 python3 -m pytest -q -p no:cacheprovider tests/test_pinned_capacity.py \
    -k "users_first_call and (turboquant-4 or turboquant-3-bf16 or turboquant-2.5-bf16 or fp8-e4m3-bf16 or kivi-2-bf16)" \
    2>&1 | tee "$OUT/a2_compiled.log" | tail -15
  ;;
B)
  hf-kvcache bench --parts batch1 --e2e-context 32768 --repeats 7 \
    --decode-methods fp8-e4m3,int8,int4-g32,int4-g128,kivi-4,kivi-2,turboquant-4,turboquant-3 \
    --json "$OUT/b1_batch1.json" 2>&1 | tee "$OUT/b1_batch1.log" | tail -20
  ;;
C)
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
  # hf-fp8 needs transformers 5.24 (the host has 5.17): its speed cell stays empty
  hf-kvcache bench --parts decode --decode-batches 1,16 --e2e-context 32768 --e2e-modes eager \
    --decode-methods hf-quanto-int4,hf-quanto-int2,fp8-e4m3,int4-g64,kivi-4,turboquant-4,kivi-2,turboquant-2.5 \
    --json "$OUT/c1_quantizedcache.json" 2>&1 | tee "$OUT/c1_quantizedcache.log" | tail -25
  ;;
D)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl525/*.whl && export PYTHONPATH=/tmp/site || exit 1
  python3 -c "import transformers; print('transformers', transformers.__version__)" | tee "$OUT/d0_versions.txt"
  timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_paged.py -m cuda 2>&1 | tee "$OUT/d1_paged.log" \
    | tail -8
  timeout 300 hf-kvcache bench --parts serving --serving-requests 96 --serving-prompt 512,1536 \
    --serving-new-tokens 48 --serving-budget-gb 1 --serving-methods fp8-e4m3,turboquant-4,kivi-2 \
    --json "$OUT/d2_serving.json" 2>&1 | tee "$OUT/d2_serving.log" | tail -12
  timeout 100 python3 scripts/profile_serving.py turboquant-4 32 32 2>&1 | tee "$OUT/d3_profile.log" | tail -22
  ;;
E)
  timeout 200 python3 scripts/profile_batch1.py 32768 fp8-e4m3 turboquant-4 kivi-2 int4-g32 2>&1 \
    | tee "$OUT/e1_profile.log" | tail -80
  # split-K at batch 1: 8 kv-heads are 8 programs a split; splits = min(pps x SMs / 8, tiles / min_tiles)
  for knobs in "16 4" "16 2" "16 1" "32 1" "8 8"; do
    set -- $knobs
    HF_KVCACHE_PROGRAMS_PER_SM=$1 HF_KVCACHE_MIN_TILES_PER_SPLIT=$2 timeout 90 hf-kvcache bench --parts kernel \
      --batches 1 --contexts 32768 --methods fp8-e4m3,int4-g32,kivi-2,turboquant-4 \
      --json "$OUT/e2_split_pps$1_mt$2.json" 2>&1 | sed "s/^/pps $1 min_tiles $2: /" | tee -a "$OUT/e2_splits.log" | tail -7
  done
  ;;
F)
  timeout 280 hf-kvcache bench --parts decode --decode-batches 1 --e2e-context 32768 --e2e-modes compiled \
    --decode-methods fp8-e4m3,turboquant-4 --json "$OUT/f1_compiled.json" 2>&1 | tee "$OUT/f1_compiled.log" | tail -8
  timeout 300 hf-kvcache bench --parts prefill --prefill-batches 1,16 \
    --decode-methods turboquant-4,turboquant-3.5,turboquant-3,turboquant-2.75,turboquant-2.5 \
    --json "$OUT/f2_prefill.json" 2>&1 | tee "$OUT/f2_prefill.log" | tail -16
  timeout 150 python3 scripts/profile_batch1.py prefill 32768 turboquant-4 turboquant-3 2>&1 \
    | tee "$OUT/f3_prefill_profile.log" | tail -50
  ;;
G)
  timeout 90 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_hadamard.py tests/kernels/test_decode.py -k "rows_times or combine" 2>&1 \
    | tee "$OUT/g0_tests.log" | tail -4
  timeout 120 python3 scripts/profile_batch1.py 32768 fp8-e4m3 turboquant-4 kivi-2 2>&1 \
    | tee "$OUT/g1_profile.log" | grep -A9 "^=="
  timeout 120 hf-kvcache bench --parts kernel --batches 1,16 --contexts 32768 \
    --methods fp8-e4m3,int4-g32,kivi-2,turboquant-4 --json "$OUT/g2_kernel.json" 2>&1 | tee "$OUT/g2_kernel.log" | tail -12
  bash "$0" B
  ;;
H)
  # the tail dealt to one program (as before 74a09a9) against the default (up to 16), then warps, stages, split length
  timeout 60 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_decode.py tests/kernels/test_turbo.py \
    -k "tail or combine" 2>&1 | tee "$OUT/h0_tests.log" | tail -3
  for tp in 1 16 1 16; do
    HF_KVCACHE_TAIL_PROGRAMS=$tp timeout 100 hf-kvcache bench --parts kernel --batches 1,16 --contexts 32768 \
      --methods fp8-e4m3,int4-g32,kivi-4,kivi-2,turboquant-4,turboquant-3 --json "$OUT/h1_tail$tp.json" 2>&1 \
      | sed "s/^/tail programs $tp: /" | tee -a "$OUT/h1_tail.log" | grep "us  x"
  done
  # a graphed step's token placed by PyTorch's operations (HF_KVCACHE_TOKEN_PLACES=0) against one launch
  for tp in 0 1; do
    HF_KVCACHE_TOKEN_PLACES=$tp timeout 100 python3 scripts/profile_batch1.py 32768 kivi-2 turboquant-4 fp8-e4m3 2>&1 \
      | sed "s/^/token places $tp: /" | tee -a "$OUT/h2_places.log" | grep -A6 "=="
  done
  for knobs in "2 3 8" "4 3 8" "2 2 8" "2 4 8" "2 3 16"; do
    set -- $knobs
    HF_KVCACHE_NUM_WARPS=$1 HF_KVCACHE_NUM_STAGES=$2 HF_KVCACHE_MIN_TILES_PER_SPLIT=$3 timeout 90 hf-kvcache bench \
      --parts kernel --batches 1 --contexts 32768 --methods fp8-e4m3,kivi-2,turboquant-4 2>&1 \
      | sed "s/^/warps $1 stages $2 min_tiles $3: /" | tee -a "$OUT/h3_knobs.log" | grep "us  x"
  done
  ;;
I)
  # TurboQuant's chunked prefill with its rotations through cuBLAS (the default) and through `_rows_times`
  timeout 60 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_hadamard.py -k rows_times 2>&1 \
    | tee "$OUT/i0_tests.log" | tail -2
  for rc in 1 0; do
    HF_KVCACHE_ROWS_CUBLAS=$rc timeout 200 hf-kvcache bench --parts prefill --prefill-batches 1,16 \
      --decode-methods turboquant-4,turboquant-3 --json "$OUT/i1_prefill_cublas$rc.json" 2>&1 \
      | sed "s/^/rows by cuBLAS $rc: /" | tee -a "$OUT/i1_prefill.log" | grep "chunk  2048"
  done
  ;;
J)
  # the least of I, for a short lease: batch 1, turboquant-4, rotations by cuBLAS, DynamicCache in the same call
  timeout 150 hf-kvcache bench --parts prefill --prefill-batches 1 --decode-methods turboquant-4 \
    --json "$OUT/j1_prefill.json" 2>&1 | tee "$OUT/j1_prefill.log" | grep "chunk"
  ;;
esac

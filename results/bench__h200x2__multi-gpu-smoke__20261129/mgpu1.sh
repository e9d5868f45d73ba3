#!/bin/bash
# Multi-GPU, first call: the 2-GPU tests, then a small multi-GPU bench to exercise the whole path.
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1 || echo "install failed"
nvidia-smi --query-gpu=name,memory.total --format=csv; nvidia-smi topo -m | head -5
python3 -c "import torch, transformers, accelerate, triton; print(torch.__version__, transformers.__version__, accelerate.__version__, triton.__version__, torch.cuda.device_count())"
timeout 240 python3 -m pytest -x -q -p no:cacheprovider tests/test_multi_gpu.py 2>&1 | tail -15 | tee $OUT/tests_multi_gpu.txt
timeout 200 hf-kvcache bench --multi-gpu --multi-gpu-layers 4 --e2e-batch 4 --e2e-context 4096 --new-tokens 8 \
  --methods int4-g32,kivi-2,kvquant-3,rotated-4 --json $OUT/smoke.json 2>&1 | grep -v Warn | tail -40 | tee $OUT/smoke.log

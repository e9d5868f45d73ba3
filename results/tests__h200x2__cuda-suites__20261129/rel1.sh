#!/bin/bash
# Issue 8's GPU run: the device, long-context, CUDA, 2-GPU and kernel tests on 2 x H200, in priority order.
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1 || echo "install failed"
nvidia-smi --query-gpu=name,memory.total --format=csv
python3 -c "import torch, transformers, triton, accelerate; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__, 'accelerate', accelerate.__version__)"
run() { name=$1; shift; s=$(date +%s); timeout $1 python3 -m pytest -q -p no:cacheprovider --tb=short -m "not slow" --junitxml=$OUT/$name.xml "${@:2}" > $OUT/$name.log 2>&1; echo "== $name rc=$? $(( $(date +%s) - s ))s: $(tail -1 $OUT/$name.log)"; }
for part in ${PARTS:-devices long multi}; do
  case $part in
    devices) run devices 150 tests/test_devices.py -m cuda ;;
    devices2) run devices2 100 tests/test_devices.py -m cuda -k "kvquant or rotated" ;;
    long2) run long2 60 tests/test_long_context.py -m cuda -k rotated ;;
    long) run long 150 tests/test_long_context.py -m cuda ;;
    multi) run multi 260 tests/test_multi_gpu.py ;;
    cuda) run cuda 250 tests/test_cuda.py ;;
    kernels) run kernels 160 tests/kernels ;;
  esac
done
for f in $OUT/*.log; do grep -E "^(FAILED|ERROR)" $f | head -20; done

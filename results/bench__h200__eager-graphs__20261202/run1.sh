# GPU run 1 (issue 28): the per-layer CUDA graph prototype at batch 1 and 16 x 32k (proto.py).
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1
python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)"
d=results/bench__h200__eager-graphs__20261202
timeout 540 python3 $d/proto.py fp8-e4m3,int8,int4-g128,kivi-2,turboquant-3.5 1,16 2>&1 | tee $OUT/run1_proto.log | grep -v Warning

# Sourced by every run on the GPU host (from the repository root): the default model from the two halves carried by
# `../shared/tools/gpu-model-parts` (run 1 copies the first to /root/m; a later run on the same machine finds the
# file already assembled), its gguf wheel, and this checkout installed over the host's torch / transformers / triton.
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site HF_KVCACHE_DEFAULT_GGUF=/root/smollm2.gguf HF_KVCACHE_CACHE=/root/hfkv
if [ ! -f /root/smollm2.gguf ]; then
  cat /root/m/part_00 .gpu-model-2/part_01 > /root/smollm2.gguf || exit 1
  echo "$(cat .gpu-model-2/sha256)  /root/smollm2.gguf" | sha256sum -c --quiet || exit 1
fi
if [ -d .gpu-model-2 ]; then python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpu-model-2/gguf-*.whl 2>&1 | tail -1; fi
# KVQuant's artifact, made on the CPU (`HF_KVCACHE_CALIBRATION=.gpu-calibration hf-kvcache calibrate`: the fit of
# 16k tokens outran 100 s on the GPU host twice), carried in .gpu-calibration/ (add it to .git/info/exclude) when a
# run names it.
if [ -d .gpu-calibration ]; then export HF_KVCACHE_CALIBRATION=$PWD/.gpu-calibration; fi
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)"

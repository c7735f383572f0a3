#!/usr/bin/env bash
# The checks that need an NVIDIA GPU, as one prepared command for a lent GPU machine (CI has none):
#   bash scripts/gpu-check.sh
# Installs like `make test`, compiles the tiny_bert sample, builds its engine for the local GPU with whichever
# TensorRT is installed (tensorrt-rtx where it covers the architecture), loads it with the runtime, compares
# it with ONNX Runtime, prints issue 25's decode table for the tinylm sample's fp16 and INT4 engines
# (bench/gpu_decode.py; SmolLM-135M's shape too with GPU_CHECK_SMOLLM=1), and runs the tests marked `gpu`.
# Prints what it verified and what it could not.
set -uo pipefail
cd "$(dirname "$0")/.."
nvidia-smi --query-gpu=name,compute_cap,driver_version --format=csv,noheader || { echo "NOT VERIFIED: no GPU"; exit 1; }
make samples >/dev/null || exit 1
# Device detection through the CUDA driver alone (ctypes), before pynvml or cuda-python are installed.
expected="sm_$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d '.')"
probed=$(.venv/bin/python -c "from tensorsmith.runtime.device import _from_cuda_driver; print(_from_cuda_driver()[0])")
[ "$probed" = "$expected" ] && echo "VERIFIED: CUDA driver probe says $probed" || echo "NOT VERIFIED: probe $probed, nvidia-smi $expected"
.venv/bin/pip install -q cuda-python pynvml || echo "NOT VERIFIED: cuda-python/pynvml did not install"
out=build/gpu-check
.venv/bin/tensorsmith compile samples/tiny_bert/tensorsmith.toml -o "$out" || exit 1
target=$(.venv/bin/python -c "from tensorsmith.runtime import detect_device; print(detect_device().compute_capability)")
echo "local GPU: $target"
if .venv/bin/tensorsmith build "$out" --target "$target"; then
  echo "VERIFIED: engine built for $target"
else
  echo "NOT VERIFIED: no builder for $target here"
fi
.venv/bin/python - "$out" <<'PY'
import sys
import numpy as np
from tensorsmith.runtime import load
feeds = {"input_ids": np.random.default_rng(0).integers(0, 1000, (4, 16)), "attention_mask": np.ones((4, 16), np.int64)}
with load(sys.argv[1], backend="onnxruntime") as reference, load(sys.argv[1]) as model:
    print(f"runtime chose {model.backend} (fallback: {model.fallback_reason})")
    expected, actual = reference.run(feeds)["hidden_states"], model.run(feeds)["hidden_states"]
    error = float(np.max(np.abs(expected - actual)) / np.max(np.abs(expected)))
    print(("VERIFIED" if model.backend.startswith("tensorrt") and error < 1e-2 else "NOT VERIFIED")
          + f": TensorRT against ONNX Runtime, max relative error {error:.2e}")
PY
# The decoder sample: its engines for this GPU (prefill and decode profiles, the static KV cache kept on the
# device: runtime/tensorrt_cache.py), fp16 and INT4 weight-only (RTN: no calibration text needed), each with its
# cpu variant as the reference; 1,152 cache slots, so that the table's 1,024-token context fits.
long=(--max-sequence-length 1152)
.venv/bin/tensorsmith compile samples/tinylm/tensorsmith.toml -o build/gpu-tinylm --target cpu --target "$target" \
  "${long[@]}" || echo "NOT VERIFIED: tinylm engine for $target"
.venv/bin/tensorsmith compile samples/tinylm/tensorsmith.toml -o build/gpu-tinylm-int4 --target cpu --target "$target" \
  --precision int4 --int4-algorithm rtn "${long[@]}" || echo "NOT VERIFIED: tinylm INT4 engine for $target"
artifacts=(build/gpu-tinylm build/gpu-tinylm-int4)
# SmolLM-135M's shape (bench/shapes.py, seeded random weights) when there is time for its compile: GPU_CHECK_SMOLLM=1
if [ "${GPU_CHECK_SMOLLM:-0}" = 1 ]; then
  .venv/bin/python -m bench.shapes smollm-135m build/shapes/smollm-135m >/dev/null \
    && .venv/bin/tensorsmith compile build/shapes/smollm-135m -o build/gpu-smollm --target cpu --target "$target" \
      "${long[@]}" --no-verify && artifacts+=(build/gpu-smollm) || echo "NOT VERIFIED: SmolLM-135M engine for $target"
fi
# Issue 25's table, one call: greedy tokens on each engine against ONNX Runtime CPU's; decode tokens/s at batch 1
# and 8 with 128 and 1,024 tokens of context; the bytes each decode step handed to the CUDA API's copies against
# runtime/copy_plan.py's plan; tokens/s against the bandwidth bound (engine + cache bytes per step ÷ the memory
# bandwidth from the memory clock and bus width).
.venv/bin/python -m bench.gpu_decode "${artifacts[@]}" --batches 1 8 --contexts 128 1024 --json build/gpu-decode.json
# Every copy on the device as CUDA itself saw it (TensorRT's own included), where Nsight Systems is installed.
if command -v nsys >/dev/null; then
  nsys profile -q -o build/gpu-decode --force-overwrite true -t cuda .venv/bin/python -m bench.gpu_decode \
    build/gpu-tinylm --batches 1 --contexts 128 --steps 16 >/dev/null \
    && nsys stats -q -r cuda_gpu_mem_size_sum build/gpu-decode.nsys-rep \
    || echo "NOT VERIFIED: the copies as Nsight Systems counts them"
fi
.venv/bin/python -m pytest -q -m gpu -rs

#!/usr/bin/env bash
# The checks that need an NVIDIA GPU, as one prepared command for a lent GPU machine (CI has none):
#   bash scripts/gpu-check.sh
# Installs like `make test`, compiles the tiny_bert sample, builds its engine for the local GPU with whichever
# TensorRT is installed (tensorrt-rtx where it covers the architecture), loads it with the runtime, compares
# it with ONNX Runtime, and runs the tests marked `gpu`. Prints what it verified and what it could not.
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
# The decoder sample: its engine for this GPU (prefill and decode profiles), greedy tokens on TensorRT against
# ONNX Runtime.
.venv/bin/tensorsmith compile samples/tinylm/tensorsmith.toml -o build/gpu-tinylm --target cpu --target "$target" \
  || echo "NOT VERIFIED: tinylm engine for $target"
.venv/bin/python - build/gpu-tinylm <<'PY'
import sys
import numpy as np
from tensorsmith.runtime import load
prompt = np.arange(3, 67, dtype=np.int64)[None]
with load(sys.argv[1], backend="onnxruntime") as reference, load(sys.argv[1]) as model:
    expected = reference.generate(prompt, max_new_tokens=32, eos_token_id=[])
    actual = model.generate(prompt, max_new_tokens=32, eos_token_id=[])
    same = model.backend.startswith("tensorrt") and np.array_equal(expected, actual)
    print(("VERIFIED" if same else "NOT VERIFIED") + f": tinylm generate on {model.backend} against ONNX Runtime, "
          f"{int((expected != actual).sum())} of 32 greedy tokens differ")
PY
# INT4 weight-only (RTN: no calibration text needed) on this GPU's builder, run against its cpu variant: the
# tokens may differ a little (fp16 regions against fp32), so the check reports the agreement.
.venv/bin/tensorsmith compile samples/tinylm/tensorsmith.toml -o build/gpu-tinylm-int4 --target cpu --target "$target" \
  --precision int4 --int4-algorithm rtn || echo "NOT VERIFIED: tinylm INT4 engine for $target"
.venv/bin/python - build/gpu-tinylm-int4 <<'PY'
import sys
import numpy as np
from tensorsmith.runtime import load
prompt = np.arange(3, 67, dtype=np.int64)[None]
with load(sys.argv[1], backend="onnxruntime") as reference, load(sys.argv[1]) as model:
    expected = reference.generate(prompt, max_new_tokens=32, eos_token_id=[])
    actual = model.generate(prompt, max_new_tokens=32, eos_token_id=[])
    agree = float((expected[:, 64:] == actual[:, 64:]).mean())
    print(("VERIFIED" if model.backend.startswith("tensorrt") else "NOT VERIFIED") +
          f": tinylm INT4 generate on {model.backend}, {agree:.0%} of 32 greedy tokens as ONNX Runtime's cpu-int4")
PY
.venv/bin/python -m pytest -q -m gpu -rs

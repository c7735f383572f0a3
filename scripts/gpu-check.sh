#!/usr/bin/env bash
# The checks that need an NVIDIA GPU, run once on a lent GPU machine (CI has none):
#   bash scripts/gpu-check.sh
# Installs into .venv like `make test`, then runs the tests marked `gpu` and the runtime on the CUDA provider.
set -euo pipefail
cd "$(dirname "$0")/.."
nvidia-smi --query-gpu=name,compute_cap,driver_version --format=csv,noheader || { echo "no GPU"; exit 1; }
make samples
.venv/bin/python -m pytest -q -m gpu -rs || [ $? -eq 5 ]   # exit 5: no gpu tests collected yet

#!/usr/bin/env bash
# TensorRT Model Optimizer for bench/precision.py, without what its wheel would pull: nvidia-modelopt requires
# torch (unpinned: a CUDA build of several GB) and onnxruntime-gpu, and the bench needs neither of those
# (its ONNX PTQ calibrates on ONNX Runtime's CPU provider, the one in .venv). So the wheel and the pure-Python
# packages its ONNX path imports go, without dependencies, into a folder of their own that the bench appends
# to sys.path after .venv's (so .venv's onnx and onnxruntime win). Not part of `make test`.
#     bash bench/modelopt-site.sh [build/modelopt-site]
set -euo pipefail
site="${1:-build/modelopt-site}"
python="${PYTHON:-.venv/bin/python}"
"$python" -m pip install --quiet --no-deps --target "$site" \
    nvidia-modelopt==0.47.0 nvidia-ml-py omegaconf antlr4-python3-runtime==4.9.3 pulp \
    onnxconverter-common onnxslim cppimport lief
echo "TensorRT Model Optimizer in $site"

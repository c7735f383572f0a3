import subprocess
import sys
from pathlib import Path

from tests.conftest import compile_small_mlp


def test_runtime_imports_neither_torch_nor_graphsurgeon_nor_the_compiler() -> None:
    code = (
        "import sys, tensorsmith.runtime\n"
        "heavy = [m for m in ('torch', 'onnx_graphsurgeon', 'tensorsmith.compiler', 'tensorsmith.passes') "
        "if m in sys.modules]\n"
        "print(heavy)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


def test_load_and_run_never_import_torch(tmp_path: Path) -> None:
    """With torch installed (it is, here), a service that loads and runs an artifact does not pay for it: device
    detection goes through the CUDA driver (ctypes), then pynvml or cuda-python, never torch."""
    artifact = compile_small_mlp(tmp_path, targets=["cpu", "sm_86"])
    code = (
        "import sys, numpy as np\n"
        "from tensorsmith.runtime import load\n"
        f"with load({str(artifact)!r}) as model:\n"
        "    model.run({'x': np.ones((2, 8), np.float32)})\n"
        "    print(model.fallback_reason)\n"
        "print([m for m in sys.modules if m == 'torch' or m.startswith('torch.')])"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    reason, imported = result.stdout.strip().splitlines()
    assert imported == "[]", result.stdout
    assert "cuda-driver" in reason and "torch" not in reason  # what was asked, in the fallback reason


def test_the_driver_probe_names_what_it_could_not_open() -> None:
    from tensorsmith.runtime.device import detect_device

    device = detect_device()
    if device.compute_capability is not None:  # a GPU machine: scripts/gpu-check.sh compares it with nvidia-smi
        assert device.compute_capability.startswith("sm_") and device.name
    else:
        assert "cuda-driver: libcuda.so.1 or libcuda.so not found" in device.reason

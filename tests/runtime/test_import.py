import subprocess
import sys


def test_runtime_imports_neither_torch_nor_graphsurgeon_nor_the_compiler() -> None:
    code = (
        "import sys, tensorsmith.runtime\n"
        "heavy = [m for m in ('torch', 'onnx_graphsurgeon', 'tensorsmith.compiler', 'tensorsmith.passes') "
        "if m in sys.modules]\n"
        "print(heavy)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"

"""The precision table is the only place that spells a precision's name (core/precisions.py): every other module
asks it. A string literal equal to a precision's name anywhere else in the package is a failure, naming the
file and line; a line about dtypes (numpy's `int8`, say) says so with the comment `# dtypes, not precisions`, one
reading a checkpoint's `quant_method` (transformers' "fp8") with `# quant_method, not a precision`."""

from __future__ import annotations

import ast
from pathlib import Path

from tensorsmith.core.precisions import PRECISIONS

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("core", "passes", "calibration", "compiler", "cli", "runtime")
TABLE = ROOT / "core" / "precisions.py"
DTYPE_MARK = "# dtypes, not precisions"
METHOD_MARK = "# quant_method, not a precision"


def spelled_precisions(path: Path) -> list[str]:
    """`file:line: 'name'` for each string constant equal to a precision's name (docstrings and longer strings,
    f-strings included, are free to mention them)."""
    source = path.read_text(encoding="utf-8")
    lines = source.splitlines()
    found = []
    for node in ast.walk(ast.parse(source)):
        spelled = isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in PRECISIONS
        if spelled and not any(mark in lines[node.lineno - 1] for mark in (DTYPE_MARK, METHOD_MARK)):
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value!r}")
    return found


def test_no_precision_name_is_spelled_outside_the_table() -> None:
    files = [path for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py")) if path != TABLE]
    assert len(files) > 100
    spelled = [hit for path in files for hit in spelled_precisions(path)]
    assert spelled == [], "ask core/precisions.py instead:\n" + "\n".join(spelled)


def test_the_check_finds_a_spelled_name(tmp_path: Path) -> None:
    sample = ROOT / "core" / "_vocabulary_probe.py"
    try:
        text = 'LEVEL = "int4"\nTYPES = ("int8", "uint8")  # dtypes, not precisions\n"""int4 in a docstring"""\n'
        sample.write_text(text)
        assert spelled_precisions(sample) == ["core/_vocabulary_probe.py:1: 'int4'"]
    finally:
        sample.unlink()

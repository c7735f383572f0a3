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


MAX_NAMED_RECORDS = 24  # issue 41: under 25 (117 in 27 files when it was filed)


def named_records(path: Path) -> list[str]:
    """`file:line: NAME` for each use of a named record of the table (`INT4`, `precisions.FP16`…), imports
    excluded: the code that handles formats asks the records (their element, block, calibration) instead."""
    names = {name.upper().replace("-", "_") for name in PRECISIONS}
    tree = ast.parse(path.read_text(encoding="utf-8"))
    imported = {
        alias.asname or alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and (node.module or "").endswith("core.precisions")
        for alias in node.names
        if alias.name in names
    }
    found = []
    for node in ast.walk(tree):
        named = isinstance(node, ast.Name) and node.id in imported
        named |= isinstance(node, ast.Attribute) and node.attr in names and isinstance(node.value, ast.Name)
        named &= not (isinstance(node, ast.Attribute) and getattr(node.value, "id", "") != "precisions")
        if named:
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {getattr(node, 'id', getattr(node, 'attr', ''))}")
    return found


def test_named_records_stay_few() -> None:
    files = [path for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py")) if path != TABLE]
    uses = [hit for path in files for hit in named_records(path)]
    assert 0 < len(uses) <= MAX_NAMED_RECORDS, f"{len(uses)} uses of named records:\n" + "\n".join(uses)

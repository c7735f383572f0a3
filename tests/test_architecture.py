"""The package's shape (docs/architecture.md): imports point down the layers only, and modules stay small.

Every `tensorsmith` import of every module is read with `ast` (lazy imports inside functions and TYPE_CHECKING
blocks included), so a cycle cannot hide behind an import placed in a function.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("runtime", "serve", "core", "passes", "calibration", "compiler", "cli", "samples")
# Lowest first. A module may import its own unit and any unit of a lower rank; units that share a rank may not
# import each other (sideways).
LAYERS: tuple[tuple[str, ...], ...] = (
    ("runtime",),  # ships alone
    ("serve",),  # the server over the runtime (torch-free too)
    ("core",),  # what everything shares: errors, IR load/save, progress, ONNX Runtime sessions, metrics
    ("passes",),
    ("calibration",),  # its search quantizes graphs with the passes
    ("compiler.version",),
    ("compiler.targets",),  # the target table
    ("compiler.declarations",),  # inputs and dims ranges
    ("compiler.settings",),  # [build] and [generation]
    ("compiler.config",),
    ("compiler.frontend",),  # stage: source → fused graph
    ("compiler.variants",),  # stage: variant plan → variants
    ("compiler.engines",),  # stage: variants → engines
    ("compiler.artifact",),  # staging, inspection, Triton
    ("compiler.report",),
    ("compiler.resources",),  # will the compile fit: estimated from the checkpoint and the plan
    ("compiler.early_engines",),  # engines started during the variants stage
    ("compiler.pipeline", "compiler.add_engine", "compiler.calibrate"),  # compile(), `build`, `calibrate`: stages
    ("compiler",),  # the package's public face: compile, CompileConfig
    ("cli",),
    ("samples",),
)
MAX_LINES = 300


def _modules(root: Path = ROOT) -> dict[str, Path]:
    modules = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def _unit(module: str) -> tuple[int, str]:
    """(rank, unit) of a module: the longest unit in LAYERS that is the module or a package above it."""
    best: tuple[int, str] | None = None
    for rank, units in enumerate(LAYERS):
        for unit in units:
            if (module == unit or module.startswith(unit + ".")) and (best is None or len(unit) > len(best[1])):
                best = (rank, unit)
    assert best is not None, f"{module} is in no layer: add it to LAYERS in {Path(__file__).name}"
    return best


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every tensorsmith module `path` imports, without the `tensorsmith.` prefix."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from tensorsmith.compiler.report import plots` imports the module compiler.report.plots
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        found += [(node.lineno, name.removeprefix("tensorsmith.")) for name in names if name.startswith("tensorsmith.")]
    return found


def _violations(root: Path = ROOT) -> list[str]:
    modules = _modules(root)
    problems = []
    for module, path in modules.items():
        rank, unit = _unit(module)
        for line, imported in _imports(path):
            if imported not in modules:  # a name imported from a module (`from x import name`), not a module
                continue
            other_rank, other_unit = _unit(imported)
            if other_unit == unit or other_rank < rank:
                continue
            direction = "up" if other_rank > rank else "sideways"
            problems.append(f"{path.relative_to(root)}:{line}: {unit} imports {imported} ({direction})")
    return problems


def test_imports_point_down_only() -> None:
    assert _violations() == []


def test_an_import_that_points_up_or_sideways_is_caught(tmp_path: Path) -> None:
    """The check itself, on a tree made for it: a lazy import from passes into the compiler, and one stage
    module importing another of the same rank."""
    files = {
        "passes/bad.py": "def f():\n    from tensorsmith.compiler.config import CompileConfig\n",
        "compiler/config.py": "",
        "compiler/pipeline.py": "",
        "compiler/add_engine.py": "import tensorsmith.compiler.pipeline\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    assert sorted(_violations(tmp_path)) == [
        "compiler/add_engine.py:1: compiler.add_engine imports compiler.pipeline (sideways)",
        "passes/bad.py:2: passes imports compiler.config (up)",
    ]


def test_modules_stay_small() -> None:
    long = {
        str(path.relative_to(ROOT)): length
        for path in _modules().values()
        if (length := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}, f"modules over {MAX_LINES} lines: split them by what they do"


MAX_FORMAT_SKIPS = 3  # literal tables only: everything else is laid out by `ruff format`


def test_the_formatter_lays_out_the_product() -> None:
    skips = {
        str(path.relative_to(ROOT)): count
        for path in _modules().values()
        if (count := path.read_text().count("# fmt: skip"))
    }
    assert sum(skips.values()) <= MAX_FORMAT_SKIPS, f"'# fmt: skip' in {skips}: let the formatter lay it out"

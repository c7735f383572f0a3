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
    ("compiler.config_errors",),  # a config's validation error, as the user reads it
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


# Where a project module may be imported inside a function: the command line (each command loads only its own
# stage) and the compiler package's face (`import tensorsmith.compiler` loads no exporter until compile is called).
# The runtime's optional backends are opened through their table row's module name (runtime/backends.py).
LAZY_IMPORTS_ALLOWED = ("cli/", "compiler/__init__.py")


def _lazy_imports(path: Path) -> list[int]:
    """Lines of the tensorsmith imports inside functions of `path`."""
    return [
        node.lineno
        for function in ast.walk(ast.parse(path.read_text(), str(path)))
        if isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef)
        for node in ast.walk(function)
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tensorsmith")
    ]


def test_project_modules_are_imported_at_the_top() -> None:
    lazy = [
        f"{relative}:{line}"
        for path in _modules().values()
        if not (relative := str(path.relative_to(ROOT))).startswith(LAZY_IMPORTS_ALLOWED)
        for line in _lazy_imports(path)
    ]
    assert lazy == [], "import project modules at the top of the module (a cycle is a layering problem to solve)"


def _cycles(root: Path = ROOT) -> list[list[str]]:
    """The strongly connected components of the import graph with more than one module (Tarjan's algorithm)."""
    modules = _modules(root)
    graph = {
        module: {name for _, name in _imports(path) if name in modules and name != module}
        for module, path in modules.items()
    }
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for imported in graph[module]:
            if imported not in index:
                visit(imported)
                low[module] = min(low[module], low[imported])
            elif imported in stack:
                low[module] = min(low[module], index[imported])
        if low[module] == index[module]:
            component = [stack.pop()]
            while component[-1] != module:
                component.append(stack.pop())
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in graph:
        if module not in index:
            visit(module)
    return cycles


def test_no_import_cycles_between_files(tmp_path: Path) -> None:
    """No two modules import each other, even through TYPE_CHECKING blocks or others; and the check finds one."""
    assert _cycles() == []
    (tmp_path / "core").mkdir()
    (tmp_path / "core" / "a.py").write_text("from tensorsmith.core.b import x\n")
    (tmp_path / "core" / "b.py").write_text("if TYPE_CHECKING:\n    from tensorsmith.core.a import y\n")
    assert _cycles(tmp_path) == [["core.a", "core.b"]]

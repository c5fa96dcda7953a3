"""The import rules of DESIGN.md, checked on the source (every import statement, also inside functions)
and at run time (importing the GUI and installer modules must not load torch or the engine).

Inside engine/, the packages are layered (ENGINE_LAYERS, lowest first): a module imports its own package and
those of its layer or below, never above, and no two packages import each other (no cycle, even through
type-only imports). An import inside a function is allowed only with a one-line reason on its line
(`# lazy: why`), and there may be no more than MAX_LAZY_IMPORTS of them: the few that wait for an optional
dependency (Triton, Numba) or a costly first use. Modules load on demand through importlib in the two command
lines (engine/cli.py, engine/node/cli.py) and in engine/kernels/__init__.py, each saying why.

    python -m tests.import_rules [ROOT]     exit 1 and list the violations if there are any
"""

import ast
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

QT = ("PySide6", "shiboken6", "pyqtgraph")
RULES: dict[str, tuple[str, ...]] = {
    "app": ("torch", "engine"),
    "installer": ("torch", "engine", "app", *QT),
    "engine": ("app", *QT),
}


@dataclass(frozen=True)
class Violation:
    path: str
    line: int
    module: str
    package: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.package}/ must not import {self.module}"


def _imported(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        return [node.module]
    if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) in (
        "import_module",
        "__import__",
    ):
        if node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
            return [node.args[0].value]
    return []


# Lowest first. Same layer: may import each other one way (a cycle is refused below).
ENGINE_LAYERS: tuple[tuple[str, ...], ...] = (
    ("gguf", "tokenizer", "kernels", "telemetry", "private_file", "testing"),
    ("layers",),
    ("experts",),
    ("models",),
    ("pipeline",),
    ("link",),
    ("serve", "node", "commands", "cli"),
)
MAX_LAZY_IMPORTS = 6


def _engine_package(path: Path, root: Path) -> str:
    parts = path.relative_to(root / "engine").with_suffix("").parts
    return parts[0]


def _in_function(tree: ast.AST) -> set[int]:
    """ids of the import nodes inside a function body."""
    inside: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            for sub in ast.walk(node):
                if isinstance(sub, ast.Import | ast.ImportFrom):
                    inside.add(id(sub))
    return inside


def check_engine_layers(root: Path) -> list[str]:
    """Upward imports between engine packages, cycles between them, and function-local imports without a reason
    or past the allowance; one line each."""
    rank = {pkg: i for i, layer in enumerate(ENGINE_LAYERS) for pkg in layer}
    edges: dict[str, set[str]] = {}
    problems: list[str] = []
    lazy: list[str] = []
    for path in sorted((root / "engine").rglob("*.py")):
        pkg = _engine_package(path, root)
        rel = path.relative_to(root).as_posix()
        if pkg == "__init__":
            continue
        if pkg not in rank:
            problems.append(
                f"{rel}: engine/{pkg} is in no layer of tests/import_rules.py ENGINE_LAYERS: add it"
            )
            continue
        text = path.read_text(encoding="utf-8")
        lines = text.splitlines()
        tree = ast.parse(text, filename=str(path))
        local = _in_function(tree)
        for node in ast.walk(tree):
            if not isinstance(node, ast.Import | ast.ImportFrom):
                continue
            if id(node) in local:
                where = f"{rel}:{node.lineno}"
                if "# lazy:" not in lines[node.lineno - 1]:
                    problems.append(
                        f"{where}: an import inside a function needs its reason on its line (# lazy: ...)"
                    )
                lazy.append(where)
            for module in _imported(node):
                parts = module.split(".")
                if parts[0] != "engine" or len(parts) < 2 or parts[1] == pkg:
                    continue
                target = parts[1]
                edges.setdefault(pkg, set()).add(target)
                if target in rank and rank[target] > rank[pkg]:
                    problems.append(
                        f"{rel}:{node.lineno}: engine/{pkg} must not import {module} (a higher layer)"
                    )
    if len(lazy) > MAX_LAZY_IMPORTS:
        problems.append(
            f"{len(lazy)} imports inside functions in engine/, at most {MAX_LAZY_IMPORTS}: " + ", ".join(lazy)
        )
    problems += [f"engine packages import each other: {' -> '.join(c)}" for c in _cycles(edges)]
    return problems


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one package (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def check_source(root: Path) -> list[Violation]:
    found = []
    for package, forbidden in RULES.items():
        for path in sorted((root / package).rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
            for node in ast.walk(tree):
                for module in _imported(node):
                    top = module.split(".")[0]
                    if top in forbidden:
                        rel = path.relative_to(root).as_posix()
                        found.append(Violation(rel, getattr(node, "lineno", 0), module, package))
    return found


_RUNTIME_PROBE = """
import importlib, pkgutil, sys
bad = []
for pkg in ("app", "installer"):
    mod = importlib.import_module(pkg)
    for info in pkgutil.walk_packages(mod.__path__, pkg + "."):
        importlib.import_module(info.name)
loaded = sorted(m for m in ("torch", "engine") if m in sys.modules)
print(",".join(loaded))
"""


def check_runtime(root: Path) -> list[str]:
    """Modules among torch/engine that importing every app and installer module loads (directly or not)."""
    out = subprocess.run(
        [sys.executable, "-c", _RUNTIME_PROBE],
        cwd=root,
        capture_output=True,
        text=True,
        env={"QT_QPA_PLATFORM": "offscreen", **__import__("os").environ},
        check=False,
    )
    if out.returncode != 0:
        raise RuntimeError(f"importing the app and installer modules failed:\n{out.stderr}")
    return [m for m in out.stdout.strip().split(",") if m]


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    root = Path(args[0]) if args else Path(__file__).resolve().parent.parent
    problems = [str(v) for v in check_source(root)]
    problems += check_engine_layers(root)
    problems += [f"importing app/ and installer/ loads {m}" for m in check_runtime(root)]
    for p in problems:
        print(p)
    print(f"import rules: {len(problems)} violation(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

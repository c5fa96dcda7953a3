"""The import rules of DESIGN.md, checked on the source (every import statement, also inside functions)
and at run time (importing the GUI and installer modules must not load torch or the engine).

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
    problems += [f"importing app/ and installer/ loads {m}" for m in check_runtime(root)]
    for p in problems:
        print(p)
    print(f"import rules: {len(problems)} violation(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

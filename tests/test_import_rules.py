import shutil
import subprocess
import sys
from pathlib import Path

from tests.import_rules import MAX_LAZY_IMPORTS, check_engine_layers, check_runtime, check_source

ROOT = Path(__file__).resolve().parent.parent


def _copy_tree(dst: Path) -> Path:
    for pkg in ("app", "engine", "installer", "resources"):
        shutil.copytree(ROOT / pkg, dst / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    return dst


def test_the_project_follows_the_rules() -> None:
    assert check_source(ROOT) == []
    assert check_engine_layers(ROOT) == []
    assert check_runtime(ROOT) == []


def test_planted_engine_layer_violations_are_found(tmp_path: Path) -> None:
    root = _copy_tree(tmp_path)
    # a layer importing a higher one, which also closes a cycle (pipeline imports layers)
    (root / "engine" / "layers" / "planted.py").write_text("from engine.pipeline import split\n")
    # an import inside a function without its reason, and one with it
    (root / "engine" / "models" / "planted.py").write_text(
        "def f():\n    import json\n    return json\n\n\ndef g():\n    import csv  # lazy: a reason\n    return csv\n"
    )
    (root / "engine" / "newpkg").mkdir()
    (root / "engine" / "newpkg" / "__init__.py").write_text("")
    problems = check_engine_layers(root)
    assert any(
        "engine/layers/planted.py:1: engine/layers must not import engine.pipeline" in p for p in problems
    )
    assert any(p.startswith("engine packages import each other:") and "layers" in p and "pipeline" in p
               for p in problems)  # fmt: skip
    assert any(
        "engine/models/planted.py:2: an import inside a function needs its reason" in p for p in problems
    )
    assert not any("planted.py:7" in p and "needs its reason" in p for p in problems)
    assert any("engine/newpkg is in no layer" in p for p in problems)
    assert any(f"imports inside functions in engine/, at most {MAX_LAZY_IMPORTS}" in p for p in problems)


def test_planted_violations_are_found(tmp_path: Path) -> None:
    root = _copy_tree(tmp_path)
    (root / "app" / "planted.py").write_text("def f():\n    import torch\n    return torch\n")
    (root / "installer" / "planted.py").write_text("from engine.gguf import reader\n")
    (root / "engine" / "planted.py").write_text("from PySide6 import QtCore\n")
    found = {(v.path, v.module) for v in check_source(root)}
    assert found == {
        ("app/planted.py", "torch"),
        ("installer/planted.py", "engine.gguf"),
        ("engine/planted.py", "PySide6"),
    }


def test_the_command_fails_on_a_planted_runtime_violation(tmp_path: Path) -> None:
    root = _copy_tree(tmp_path)
    # A transitive import: the source of app/ names no torch, but a module it imports does.
    (root / "app" / "planted.py").write_text("import installer.planted_helper\n")
    (root / "installer" / "planted_helper.py").write_text(
        "import importlib\nimportlib.import_module('tor' + 'ch')\n"
    )
    assert "torch" in check_runtime(root)
    run = subprocess.run(
        [sys.executable, "-m", "tests.import_rules", str(root)], cwd=ROOT, capture_output=True, text=True
    )
    assert run.returncode == 1
    assert "loads torch" in run.stdout


def test_the_command_lines_and_the_kernels_load_lazily() -> None:
    """`strata-engine --help` and `strata-node --help` load no torch; engine.kernels loads Triton only on use, and
    says None (not an error) for a kernel module where Triton is absent."""
    probe = (
        "import sys, engine.cli, engine.node.cli, engine.kernels as k\n"
        "assert 'torch' not in sys.modules and 'triton' not in sys.modules, sorted(m for m in sys.modules if m in "
        "('torch', 'triton'))\n"
        "import importlib.util\n"
        "if importlib.util.find_spec('triton') is None:\n"
        "    assert k.loaded('gemv') is None\n"
        "print('ok')\n"
    )
    run = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr

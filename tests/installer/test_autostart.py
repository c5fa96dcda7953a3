"""Starting the node agent at log-in: the Linux XDG entry (its Exec= line read back by a POSIX shell, whose
double-quote rules are the Desktop Entry spec's) and the Windows Run value, with the write round-tripped in a
temporary home (Linux) and against a registry stand-in (Windows: the one class that calls winreg)."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from installer.autostart import (
    ENTRY_NAME,
    LinuxAutostart,
    WindowsAutostart,
    desktop_exec,
    entry_is_on,
    linux_entry,
    windows_run_value,
    xdg_config_home,
)

ODD = [
    "/opt/Poly Strata/strata-node",
    "serve",
    "--name",
    'Bob\'s "PC" $HOME `x` \\ 100%',
    "--host",
    "0.0.0.0",
]


@pytest.mark.skipif(shutil.which("sh") is None, reason="needs a POSIX shell")
def test_exec_line_reads_back_as_the_same_arguments() -> None:
    value = desktop_exec(ODD)
    # A reader undoes the file's string escape (\\ -> \) and the field-code escape (%% -> %), then the quoting.
    unescaped = value.replace("\\\\", "\\").replace("%%", "%")
    out = subprocess.run(
        ["sh", "-c", f"printf '%s\\0' {unescaped}"], capture_output=True, check=True
    ).stdout.decode()
    assert out.split("\0")[:-1] == ODD


def test_linux_entry() -> None:
    text = linux_entry(["/home/ann/PolyStrata/strata-node", "serve", "--host", "0.0.0.0"])
    assert text == (
        "[Desktop Entry]\n"
        "Type=Application\n"
        "Name=PolyStrata node agent\n"
        "Comment=Lends this PC's GPUs to a PolyStrata main PC\n"
        "Exec=/home/ann/PolyStrata/strata-node serve --host 0.0.0.0\n"
        "Terminal=false\n"
        "NoDisplay=true\n"
        "X-GNOME-Autostart-enabled=true\n"
    )
    assert entry_is_on(text)
    assert not entry_is_on(text + "Hidden=true\n")
    assert not entry_is_on(text.replace("enabled=true", "enabled=false"))


def test_windows_run_value() -> None:
    cmd = [r"C:\Program Files\PolyStrata\strata-node.exe", "serve", "--host", "0.0.0.0"]
    assert windows_run_value(cmd) == (
        'cmd.exe /c start "PolyStrata node agent" /min '
        '"C:\\Program Files\\PolyStrata\\strata-node.exe" serve --host 0.0.0.0'
    )


def test_linux_enable_disable_in_a_temporary_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("XDG_CONFIG_HOME", raising=False)
    if sys.platform.startswith("linux"):
        assert xdg_config_home() == tmp_path / ".config"
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "cfg"))
    auto = LinuxAutostart()
    entry = tmp_path / "cfg" / "autostart" / ENTRY_NAME
    assert auto.path == entry and not auto.enabled() and auto.note() == ""
    auto.enable(["/opt/strata/strata-node", "serve", "--host", "0.0.0.0"])
    assert auto.enabled() and entry.read_text() == linux_entry(
        ["/opt/strata/strata-node", "serve", "--host", "0.0.0.0"]
    )
    auto.enable(["/opt/strata/strata-node", "serve"])  # again: replaced, not appended
    assert "Exec=/opt/strata/strata-node serve\n" in entry.read_text()
    auto.disable()
    assert not entry.exists() and not auto.enabled()
    auto.disable()  # already off: nothing to do
    unit = tmp_path / "cfg" / "systemd" / "user" / "polystrata-node.service"
    unit.parent.mkdir(parents=True)
    unit.write_text("[Service]\n")
    assert "systemctl --user disable --now polystrata-node.service" in auto.note()


class FakeRunKey:
    """The registry value, in a dict (the boundary: RunKey is the only code that calls winreg)."""

    def __init__(self) -> None:
        self.values: dict[str, str] = {}

    def get(self) -> str | None:
        return self.values.get("v")

    def set(self, value: str) -> None:
        self.values["v"] = value

    def delete(self) -> None:
        self.values.pop("v", None)


def test_windows_enable_disable(tmp_path: Path) -> None:
    key = FakeRunKey()
    auto = WindowsAutostart(key, tmp_path)  # type: ignore[arg-type]
    assert not auto.enabled()
    auto.enable([r"C:\PolyStrata\strata-node.exe", "serve", "--host", "0.0.0.0"])
    assert auto.enabled() and key.values["v"].endswith(
        r"/min C:\PolyStrata\strata-node.exe serve --host 0.0.0.0"
    )
    auto.disable()
    assert not auto.enabled() and key.values == {}
    shortcut = tmp_path / "PolyStrata node agent.lnk"  # what the installer's "start at sign-in" task leaves
    shortcut.write_bytes(b"L\0\0\0")
    assert auto.enabled()
    auto.disable()
    assert not shortcut.exists() and not auto.enabled()
    assert (
        auto.where()
        == r"HKEY_CURRENT_USER\Software\Microsoft\Windows\CurrentVersion\Run\PolyStrata node agent"
    )

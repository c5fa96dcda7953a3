"""Start the node agent (`strata-node serve`) when the user logs in: the worker PCs page's "start at log-in".

- Linux: an XDG autostart entry, `$XDG_CONFIG_HOME/autostart/polystrata-node.desktop` (`~/.config` without the
  variable): the file the Linux installer writes for `--autostart-node`, so either one turns the other's off.
- Windows: the value `PolyStrata node agent` under `HKCU\\Software\\Microsoft\\Windows\\CurrentVersion\\Run` (per
  user, no administrator rights). The Windows installer's Startup-folder shortcut of the same name counts as on,
  and turning autostart off removes it too.

The entry's text and the command line are pure functions; only `LinuxAutostart.enable/disable`, `RunKey` and the
shortcut's removal touch the disk or the registry.
"""

import os
import subprocess
import sys
from pathlib import Path
from typing import Protocol

import platformdirs

ENTRY_NAME = "polystrata-node.desktop"
SYSTEMD_UNIT = "polystrata-node.service"
RUN_KEY = r"Software\Microsoft\Windows\CurrentVersion\Run"
RUN_VALUE = "PolyStrata node agent"
SHORTCUT = RUN_VALUE + ".lnk"  # the Windows installer's, in the Startup folder
_EXEC_RESERVED = set(" \t\n\"'\\><~|&;$*?#()`")


class Autostart(Protocol):
    def enabled(self) -> bool: ...

    def enable(self, command: list[str]) -> None: ...

    def disable(self) -> None: ...

    def where(self) -> str: ...

    def note(self) -> str: ...


# ---------------------------------------------------------------------------------------------------------------
# Linux


def _exec_arg(arg: str) -> str:
    """One argument of an `Exec=` key (Desktop Entry spec): quoted where it holds a reserved character, with `"`,
    `` ` ``, `$` and `\\` escaped inside the quotes; `%` doubled (field codes)."""
    arg = arg.replace("%", "%%")
    if arg and not (set(arg) & _EXEC_RESERVED):
        return arg
    inner = "".join("\\" + ch if ch in '"`$\\' else ch for ch in arg)
    return f'"{inner}"'


def desktop_exec(command: list[str]) -> str:
    """The `Exec=` value for `command`; the string escape of the file format (a backslash written twice) is
    applied on top of the quoting, as the spec orders."""
    return " ".join(_exec_arg(a) for a in command).replace("\\", "\\\\")


def linux_entry(command: list[str]) -> str:
    """The autostart `.desktop` file that runs `command` at log-in, without a terminal or a menu entry."""
    return (
        "[Desktop Entry]\n"
        "Type=Application\n"
        "Name=PolyStrata node agent\n"
        "Comment=Lends this PC's GPUs to a PolyStrata main PC\n"
        f"Exec={desktop_exec(command)}\n"
        "Terminal=false\n"
        "NoDisplay=true\n"
        "X-GNOME-Autostart-enabled=true\n"
    )


def xdg_config_home() -> Path:
    """$XDG_CONFIG_HOME, else ~/.config (platformdirs' rule on Linux)."""
    return Path(os.environ.get("XDG_CONFIG_HOME") or platformdirs.user_config_dir(roaming=False))


def entry_is_on(text: str) -> bool:
    """An autostart entry runs unless it says `Hidden=true` or `X-GNOME-Autostart-enabled=false`."""
    keys = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep:
            keys[key.strip()] = value.strip().lower()
    return keys.get("Hidden") != "true" and keys.get("X-GNOME-Autostart-enabled") != "false"


class LinuxAutostart:
    def __init__(self, config_home: Path | None = None) -> None:
        self.config_home = config_home or xdg_config_home()
        self.path = self.config_home / "autostart" / ENTRY_NAME

    def enabled(self) -> bool:
        try:
            return entry_is_on(self.path.read_text(encoding="utf-8", errors="replace"))
        except OSError:
            return False

    def enable(self, command: list[str]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(linux_entry(command), encoding="utf-8")
        tmp.replace(self.path)

    def disable(self) -> None:
        self.path.unlink(missing_ok=True)

    def where(self) -> str:
        return str(self.path)

    def note(self) -> str:
        """The installer may have set the agent up as a systemd user service instead; that one is not ours."""
        unit = self.config_home / "systemd" / "user" / SYSTEMD_UNIT
        if unit.exists():
            return (
                f"the installer also set the agent up as the systemd user service {SYSTEMD_UNIT}; "
                f"`systemctl --user disable --now {SYSTEMD_UNIT}` turns that one off"
            )
        return ""


# ---------------------------------------------------------------------------------------------------------------
# Windows


def windows_run_value(command: list[str]) -> str:
    """The Run value: `start /min` (a console program gets a minimised window, as the installer's shortcut does)
    with the command quoted by Windows' own rules (`subprocess.list2cmdline`)."""
    return f'cmd.exe /c start "{RUN_VALUE}" /min {subprocess.list2cmdline(command)}'


class RunKey:
    """The one registry value this module writes: HKCU\\...\\Run\\PolyStrata node agent."""

    def get(self) -> str | None:
        import winreg  # type: ignore[import-not-found,unused-ignore]

        try:
            with winreg.OpenKey(winreg.HKEY_CURRENT_USER, RUN_KEY) as k:
                value, _ = winreg.QueryValueEx(k, RUN_VALUE)
                return str(value)
        except FileNotFoundError:
            return None

    def set(self, value: str) -> None:
        import winreg  # type: ignore[import-not-found,unused-ignore]

        with winreg.CreateKeyEx(winreg.HKEY_CURRENT_USER, RUN_KEY, 0, winreg.KEY_SET_VALUE) as k:
            winreg.SetValueEx(k, RUN_VALUE, 0, winreg.REG_SZ, value)

    def delete(self) -> None:
        import winreg  # type: ignore[import-not-found,unused-ignore]

        try:
            with winreg.OpenKey(winreg.HKEY_CURRENT_USER, RUN_KEY, 0, winreg.KEY_SET_VALUE) as k:
                winreg.DeleteValue(k, RUN_VALUE)
        except FileNotFoundError:
            pass


def startup_dir() -> Path:
    """The user's Startup folder (where the installer puts its shortcut)."""
    return (
        Path(os.environ.get("APPDATA", "")) / "Microsoft" / "Windows" / "Start Menu" / "Programs" / "Startup"
    )


class WindowsAutostart:
    def __init__(self, key: RunKey | None = None, startup: Path | None = None) -> None:
        self.key = key or RunKey()
        self.shortcut = (startup or startup_dir()) / SHORTCUT

    def enabled(self) -> bool:
        return self.key.get() is not None or self.shortcut.exists()

    def enable(self, command: list[str]) -> None:
        self.key.set(windows_run_value(command))

    def disable(self) -> None:
        self.key.delete()
        self.shortcut.unlink(missing_ok=True)

    def where(self) -> str:
        return f"HKEY_CURRENT_USER\\{RUN_KEY}\\{RUN_VALUE}"

    def note(self) -> str:
        return ""


def for_this_os() -> Autostart | None:
    """This OS's autostart, or None where there is none (macOS)."""
    if sys.platform == "win32":
        return WindowsAutostart()
    if sys.platform.startswith("linux") or "bsd" in sys.platform:
        return LinuxAutostart()
    return None

"""Helpers for the Linux installer tests: a throw-away home, the installer's environment, desktop-entry parsing."""

import configparser
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LINUX = ROOT / "packaging" / "linux"
BUILD_INSTALLER = LINUX / "build-installer.sh"


@dataclass(frozen=True)
class Home:
    """A user's home folder for one test; the installer and the programs see only it."""

    root: Path
    extra_path: tuple[Path, ...] = ()

    @property
    def data(self) -> Path:
        return self.root / ".local" / "share" / "PolyStrata"

    @property
    def config(self) -> Path:
        return self.root / ".config" / "PolyStrata"

    @property
    def applications(self) -> Path:
        return self.root / ".local" / "share" / "applications"

    @property
    def autostart(self) -> Path:
        return self.root / ".config" / "autostart"

    def env(self, **extra: str) -> dict[str, str]:
        """No XDG_*, STRATA_*, DISPLAY or venv on PATH: what a fresh desktop login would give, in this home."""
        keep = {k: v for k, v in os.environ.items() if k in ("LANG", "LC_ALL", "TMPDIR", "TZ")}
        path = [str(p) for p in self.extra_path] + ["/usr/local/bin", "/usr/bin", "/bin"]
        return {**keep, "HOME": str(self.root), "PATH": os.pathsep.join(path), **extra}

    def files(self) -> list[str]:
        """Every file and link below the home, relative, sorted (folders only where empty)."""
        out = []
        for dirpath, dirnames, filenames in os.walk(self.root):
            rel = Path(dirpath).relative_to(self.root)
            out += [str(rel / f) for f in filenames]
            out += [str(rel / d) for d in dirnames if Path(dirpath, d).is_symlink()]
            if not dirnames and not filenames and Path(dirpath) != self.root:
                out.append(str(rel) + "/")
        return sorted(out)


def run(
    cmd: list[str | Path], env: dict[str, str], timeout: float = 120, check: bool = True
) -> subprocess.CompletedProcess[str]:
    """Run cmd with no input; stdout and stderr decoded as UTF-8 as written (no newline translation: a model may
    well generate a carriage return)."""
    raw = subprocess.run(
        [str(c) for c in cmd], env=env, stdin=subprocess.DEVNULL, capture_output=True, timeout=timeout
    )
    proc = subprocess.CompletedProcess(
        raw.args, raw.returncode, raw.stdout.decode("utf-8", "replace"), raw.stderr.decode("utf-8", "replace")
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(map(str, cmd))} exited {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
        )
    return proc


def build_installer(bundle: Path, out: Path, *extra: str) -> tuple[Path, Path | None]:
    """Run build-installer.sh; returns the .run and the .tar.gz (None with --no-tarball)."""
    proc = run(
        ["sh", BUILD_INSTALLER, "--bundle", bundle, "--out", out, *extra],
        env={**os.environ},
        timeout=900,
    )
    runs = sorted(out.glob("PolyStrata-*-linux-*.run"))
    assert len(runs) == 1, proc.stdout
    tars = sorted(out.glob("PolyStrata-*-linux-*.tar.gz"))
    return runs[0], (tars[0] if tars else None)


def read_desktop_entry(path: Path) -> dict[str, str]:
    """The [Desktop Entry] group, checked for the keys every entry needs (Desktop Entry spec 1.5)."""
    parser = configparser.ConfigParser(interpolation=None, strict=True)
    parser.optionxform = str  # keys are case-sensitive
    parser.read_string(path.read_text(encoding="utf-8"))
    assert parser.sections() == ["Desktop Entry"], path
    entry = dict(parser["Desktop Entry"])
    assert entry["Type"] == "Application"
    assert entry["Name"]
    for key, value in entry.items():
        assert value == value.strip(), f"{path}: {key} has surrounding blanks"
        if key in ("Terminal", "StartupNotify", "NoDisplay", "Hidden", "X-GNOME-Autostart-enabled"):
            assert value in ("true", "false"), f"{path}: {key}={value} is not a boolean"
        if key in ("Categories", "Keywords"):
            assert value.endswith(";"), f"{path}: {key} must end with ';'"
    validator = shutil.which("desktop-file-validate")  # desktop-file-utils, where installed
    if validator:
        proc = subprocess.run([validator, str(path)], capture_output=True, text=True)
        assert proc.returncode == 0 and "error" not in proc.stdout, proc.stdout + proc.stderr
    return entry


def exec_argv(value: str) -> list[str]:
    """An Exec value as argv, by the Desktop Entry spec: the string-value escapes first (\\\\ is one backslash), then
    arguments split at spaces, where a double-quoted argument takes \\ before ", `, $ and \\ as that character."""
    unescaped = []
    i = 0
    while i < len(value):
        if value[i] == "\\" and i + 1 < len(value):
            unescaped.append(
                {"s": " ", "n": "\n", "t": "\t", "r": "\r", "\\": "\\"}.get(value[i + 1], value[i : i + 2])
            )
            i += 2
        else:
            unescaped.append(value[i])
            i += 1
    text = "".join(unescaped)
    argv: list[str] = []
    i = 0
    while i < len(text):
        if text[i] == " ":
            i += 1
        elif text[i] == '"':
            arg, i = [], i + 1
            while text[i] != '"':
                if text[i] == "\\" and text[i + 1] in '"`$\\':
                    i += 1
                arg.append(text[i])
                i += 1
            argv.append("".join(arg))
            i += 1
        else:
            end = text.find(" ", i)
            end = len(text) if end < 0 else end
            arg = text[i:end]
            assert not any(c in arg for c in '"`$\\'), f"reserved character unquoted in Exec argument {arg!r}"
            argv.append(arg)
            i = end
    return argv

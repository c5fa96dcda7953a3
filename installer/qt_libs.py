"""Whether this Linux can open the app's window: a display, and the system libraries of Qt's X11 platform plugin.

Without them Qt aborts (rc 134) naming one library (often libxcb-cursor0) while others are missing too; this
check names every missing library and the one command that installs them all for the distribution's package
manager (apt, dnf, pacman, zypper). `start.sh`, `install.sh` and the app itself run it before Qt starts:

    python -m installer.qt_libs        (exit 0: the window can open; 2: no display; 3: libraries missing)
"""

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

# Each library the xcb plugin loads (directly or through Qt's own libraries) and its package, per manager.
_TABLE = """
library                  apt                  dnf                  pacman               zypper
libxcb-cursor.so.0       libxcb-cursor0       xcb-util-cursor      xcb-util-cursor      libxcb-cursor0
libxcb-icccm.so.4        libxcb-icccm4        xcb-util-wm          xcb-util-wm          libxcb-icccm4
libxcb-keysyms.so.1      libxcb-keysyms1      xcb-util-keysyms     xcb-util-keysyms     libxcb-keysyms1
libxcb-image.so.0        libxcb-image0        xcb-util-image       xcb-util-image       libxcb-image0
libxcb-util.so.1         libxcb-util1         xcb-util             xcb-util             libxcb-util1
libxcb-render-util.so.0  libxcb-render-util0  xcb-util-renderutil  xcb-util-renderutil  libxcb-render-util0
libxcb-shape.so.0        libxcb-shape0        libxcb               libxcb               libxcb-shape0
libxcb-randr.so.0        libxcb-randr0        libxcb               libxcb               libxcb-randr0
libxcb-xfixes.so.0       libxcb-xfixes0       libxcb               libxcb               libxcb-xfixes0
libxcb-sync.so.1         libxcb-sync1         libxcb               libxcb               libxcb-sync1
libxcb-shm.so.0          libxcb-shm0          libxcb               libxcb               libxcb-shm0
libxcb-render.so.0       libxcb-render0       libxcb               libxcb               libxcb-render0
libxcb-xkb.so.1          libxcb-xkb1          libxcb               libxcb               libxcb-xkb1
libxcb-xinerama.so.0     libxcb-xinerama0     libxcb               libxcb               libxcb-xinerama0
libxcb-glx.so.0          libxcb-glx0          libxcb               libxcb               libxcb-glx0
libxcb.so.1              libxcb1              libxcb               libxcb               libxcb1
libxkbcommon-x11.so.0    libxkbcommon-x11-0   libxkbcommon-x11     libxkbcommon-x11     libxkbcommon-x11-0
libxkbcommon.so.0        libxkbcommon0        libxkbcommon         libxkbcommon         libxkbcommon0
libX11-xcb.so.1          libx11-xcb1          libX11-xcb           libx11               libX11-xcb1
libX11.so.6              libx11-6             libX11               libx11               libX11-6
libEGL.so.1              libegl1              libglvnd-egl         libglvnd             libEGL1
libGL.so.1               libgl1               libglvnd-glx         libglvnd             libGL1
libOpenGL.so.0           libopengl0           libglvnd-opengl      libglvnd             libOpenGL0
libfontconfig.so.1       libfontconfig1       fontconfig           fontconfig           libfontconfig1
libfreetype.so.6         libfreetype6         freetype             freetype2            libfreetype6
libdbus-1.so.3           libdbus-1-3          dbus-libs            dbus                 libdbus-1-3
libglib-2.0.so.0         libglib2.0-0         glib2                glib2                libglib-2_0-0
"""
_ROWS = [line.split() for line in _TABLE.strip().splitlines()]
PACKAGES: dict[str, dict[str, str]] = {
    row[0]: dict(zip(_ROWS[0][1:], row[1:], strict=True)) for row in _ROWS[1:]
}

INSTALL = {
    "apt": "sudo apt install {}",
    "dnf": "sudo dnf install {}",
    "pacman": "sudo pacman -S --needed {}",
    "zypper": "sudo zypper install {}",
}
_FAMILIES = {  # os-release ID / ID_LIKE words -> manager
    "debian": "apt", "ubuntu": "apt", "linuxmint": "apt", "pop": "apt", "elementary": "apt", "raspbian": "apt",
    "fedora": "dnf", "rhel": "dnf", "centos": "dnf", "rocky": "dnf", "almalinux": "dnf", "nobara": "dnf",
    "arch": "pacman", "manjaro": "pacman", "endeavouros": "pacman", "cachyos": "pacman",
    "opensuse": "zypper", "suse": "zypper", "opensuse-leap": "zypper", "opensuse-tumbleweed": "zypper",
}  # fmt: skip


def missing_libraries(ldd_output: str) -> list[str]:
    """`ldd` output -> the libraries it could not find, in order, once each."""
    out: list[str] = []
    for line in ldd_output.splitlines():
        name, _, where = line.strip().partition("=>")
        if "not found" in where and name.strip() not in out:
            out.append(name.strip())
    return out


def package_manager(os_release: str) -> str | None:
    """/etc/os-release's text -> apt, dnf, pacman or zypper (from ID, then ID_LIKE), None where unknown."""
    fields = {}
    for line in os_release.splitlines():
        key, _, value = line.partition("=")
        fields[key.strip()] = value.strip().strip('"').lower()
    for word in (fields.get("ID", "") + " " + fields.get("ID_LIKE", "")).split():
        if word in _FAMILIES:
            return _FAMILIES[word]
    return None


def install_command(missing: list[str], manager: str | None) -> str | None:
    """The command that installs the packages of the missing libraries, None where the manager is unknown."""
    if manager not in INSTALL:
        return None
    packages: list[str] = []
    for lib in missing:
        pkg = PACKAGES.get(lib, {}).get(manager)
        if pkg is not None and pkg not in packages:
            packages.append(pkg)
    return INSTALL[manager].format(" ".join(packages)) if packages else None


def xcb_plugin() -> Path | None:
    """Qt's X11 platform plugin in this installation (a venv or the app bundle), None where there is none. Found
    without importing Qt (installer/ never does)."""
    spec = importlib.util.find_spec("PySide6")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "Qt" / "plugins" / "platforms" / "libqxcb.so"
    return path if path.exists() else None


def report(env: dict[str, str] | None = None) -> tuple[int, str]:
    """(exit code, message): 0 and "" where the window can open (or another platform is asked for); 2 without a
    display; 3 with the missing libraries and the command that installs them."""
    e = os.environ if env is None else env
    if not sys.platform.startswith("linux") or e.get("QT_QPA_PLATFORM"):
        return 0, ""
    if not e.get("DISPLAY") and not e.get("WAYLAND_DISPLAY"):
        return 2, (
            "no display found (DISPLAY and WAYLAND_DISPLAY are not set), so the app's window cannot open. To serve "
            "the OpenAI-compatible API without a window, run: ./start.sh --headless (or strata --headless)"
        )
    plugin = xcb_plugin()
    if not e.get("DISPLAY") or plugin is None or shutil.which("ldd") is None:
        return 0, ""  # Wayland alone, or nothing to check here
    ldd = subprocess.run(["ldd", str(plugin)], capture_output=True, text=True, check=False).stdout
    missing = missing_libraries(ldd)
    if not missing:
        return 0, ""
    try:
        release = Path("/etc/os-release").read_text()
    except OSError:
        release = ""
    cmd = install_command(missing, package_manager(release))
    how = f"Install them with:\n    {cmd}" if cmd else "Install them with your package manager."
    return 3, (
        f"the app's window needs system libraries this PC lacks: {', '.join(missing)}.\n{how}\n"
        "Then run this again. (./start.sh --headless serves the API without a window meanwhile.)"
    )


def main() -> int:
    code, message = report()
    if message:
        print(f"[polystrata] {message}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())

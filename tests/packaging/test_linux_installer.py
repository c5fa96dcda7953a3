"""The Linux installer (.run, tarball, install.sh, uninstall.sh) on a small stand-in bundle: shell programs named as
the PyInstaller bundle's, so that every install, autostart and uninstall path runs in seconds. The real bundle goes
through the same scripts in test_bundle.py."""

import os
import pty
import select
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from installer.version import __version__
from tests.packaging.linux_env import Home, build_installer, exec_argv, read_desktop_entry, run

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="the Linux installer runs on Linux"
)

EXES = ("strata", "strata-engine", "strata-node", "strata-setup")


def _script(path: Path, body: str) -> None:
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


def make_bundle(root: Path, node_serves: bool) -> Path:
    """A folder laid out as dist/PolyStrata: four programs and _internal/. Each program prints its name and where
    it runs from; strata-node has a `serve` command only when node_serves."""
    bundle = root / "PolyStrata"
    (bundle / "_internal" / "sub").mkdir(parents=True)
    (bundle / "_internal" / "sub" / "data.bin").write_bytes(bytes(range(256)) * 64)
    where = '$(cd "$(dirname "$(readlink -f "$0")")" && pwd)'
    for exe in EXES:
        _script(bundle / exe, f'echo "{exe} {where} $*"')
    serve = "echo serving; exit 0" if node_serves else 'echo "strata-node: unknown command serve" >&2; exit 2'
    _script(
        bundle / "strata-node",
        f'case "${{1:-}}" in serve) {serve} ;; *) echo "strata-node {where} $*" ;; esac',
    )
    return bundle


@pytest.fixture(scope="module")
def installers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path | None]]:
    """A .run and a tarball of the stand-in bundle, one whose node agent cannot serve and one whose can."""
    out = {}
    for name, serves in (("plain", False), ("serving", True)):
        base = tmp_path_factory.mktemp(name)
        out[name] = build_installer(make_bundle(base, serves), base / "out", "--gzip-level", "1")
    return out


@pytest.fixture
def home(tmp_path: Path) -> Home:
    (tmp_path / "home").mkdir()
    (tmp_path / "fakebin").mkdir()
    return Home(tmp_path / "home", extra_path=(tmp_path / "fakebin",))


def fake_systemctl(home: Home, works: bool) -> Path:
    """A systemctl on PATH that records its calls; `works`: whether a user manager answers."""
    log = home.root.parent / "systemctl.log"
    status = 0 if works else 1
    _script(home.extra_path[0] / "systemctl", f'echo "$*" >> "{log}"; exit {status}')
    return log


def install(run_file: Path, home: Home, prefix: Path, *args: str, **env: str) -> str:
    proc = run(["sh", run_file, "--prefix", prefix, "--yes", "--no-launch", *args], env=home.env(**env))
    return proc.stdout + proc.stderr


def test_run_file_names_version_and_flavour(installers: dict) -> None:
    run_file, tarball = installers["plain"]
    assert run_file.name == f"PolyStrata-{__version__}-linux-cpu.run"
    assert tarball is not None and tarball.name == f"PolyStrata-{__version__}-linux-cpu.tar.gz"
    assert os.access(run_file, os.X_OK)


def test_check_passes_and_a_damaged_file_is_refused(installers: dict, home: Home, tmp_path: Path) -> None:
    run_file, _ = installers["plain"]
    ok = run(["sh", run_file, "--check"], env=home.env())
    assert "is intact" in ok.stdout
    damaged = tmp_path / "damaged.run"
    data = bytearray(run_file.read_bytes())
    data[-100] ^= 0xFF  # inside the compressed payload
    damaged.write_bytes(bytes(data))
    bad = run(["sh", damaged, "--prefix", tmp_path / "p", "--yes"], env=home.env(), check=False)
    assert bad.returncode != 0
    assert "is damaged" in bad.stderr
    assert not (tmp_path / "p" / "lib" / "polystrata").exists()


def test_install_lays_out_program_commands_menu_entry_and_icons(
    installers: dict, home: Home, tmp_path: Path
) -> None:
    prefix = tmp_path / "pre fix"
    out = install(installers["plain"][0], home, prefix)
    app_dir = prefix / "lib" / "polystrata"
    for exe in EXES:
        assert os.access(app_dir / exe, os.X_OK)
        link = prefix / "bin" / exe
        assert link.is_symlink() and link.resolve() == (app_dir / exe).resolve()
        # Started through the link, the program runs from the program folder (where _internal/ is).
        assert run([link, "--version"], env=home.env()).stdout.strip() == f"{exe} {app_dir} --version"
    assert (app_dir / "_internal" / "sub" / "data.bin").read_bytes() == bytes(range(256)) * 64
    assert (app_dir / "VERSION").read_text().strip() == f"{__version__} (cpu)"
    assert (prefix / "bin" / "strata-uninstall").resolve() == (app_dir / "uninstall.sh").resolve()
    # No leftovers of the unpacking beside the program.
    assert sorted(p.name for p in (prefix / "lib").iterdir()) == ["polystrata"]

    entry = read_desktop_entry(home.applications / "polystrata.desktop")
    assert exec_argv(entry["Exec"]) == [str(app_dir / "strata")]
    assert entry["Icon"] == "polystrata"
    assert entry["Terminal"] == "false"
    icons = home.root / ".local" / "share" / "icons" / "hicolor"
    assert (icons / "scalable" / "apps" / "polystrata.svg").read_bytes() == (
        Path(__file__).resolve().parents[2] / "resources" / "polystrata.svg"
    ).read_bytes()
    for size in (16, 32, 48, 128, 256):
        assert (icons / f"{size}x{size}" / "apps" / "polystrata.png").is_file()
    assert not home.autostart.exists()
    assert "not on your PATH" in out


def test_exec_line_survives_quotes_dollars_and_backslashes_in_the_prefix(
    installers: dict, home: Home, tmp_path: Path
) -> None:
    prefix = tmp_path / 'odd "name" $HOME \\ `x`'
    install(installers["plain"][0], home, prefix, "--autostart")
    for entry_file in (home.applications / "polystrata.desktop", home.autostart / "polystrata.desktop"):
        argv = exec_argv(read_desktop_entry(entry_file)["Exec"])
        assert argv == [str(prefix / "lib" / "polystrata" / "strata")]
        assert run(argv, env=home.env()).stdout.startswith("strata ")


def test_autostart_of_the_app(installers: dict, home: Home, tmp_path: Path) -> None:
    install(installers["plain"][0], home, tmp_path / "p", "--autostart")
    entry = read_desktop_entry(home.autostart / "polystrata.desktop")
    assert exec_argv(entry["Exec"]) == [str(tmp_path / "p" / "lib" / "polystrata" / "strata")]


def test_node_autostart_is_refused_when_the_agent_cannot_serve(
    installers: dict, home: Home, tmp_path: Path
) -> None:
    log = fake_systemctl(home, works=True)
    out = install(installers["plain"][0], home, tmp_path / "p", "--autostart-node")
    assert "has no serve command" in out
    assert not home.autostart.exists()
    assert not (home.root / ".config" / "systemd").exists()
    assert not log.exists()


def test_node_autostart_as_a_systemd_user_service(installers: dict, home: Home, tmp_path: Path) -> None:
    log = fake_systemctl(home, works=True)
    prefix = tmp_path / "with space"
    install(installers["serving"][0], home, prefix, "--autostart-node")
    unit = home.root / ".config" / "systemd" / "user" / "polystrata-node.service"
    text = unit.read_text()
    node = prefix / "lib" / "polystrata" / "strata-node"
    assert f'ExecStart="{node}" serve' in text
    assert "WantedBy=default.target" in text
    assert "--user enable --now polystrata-node.service" in log.read_text()

    run([prefix / "bin" / "strata-uninstall", "--yes"], env=home.env())
    assert not unit.exists()
    assert "--user disable --now polystrata-node.service" in log.read_text()


def test_node_autostart_without_systemd_uses_an_autostart_entry(
    installers: dict, home: Home, tmp_path: Path
) -> None:
    fake_systemctl(home, works=False)  # no user manager (a container, a PC without systemd)
    install(installers["serving"][0], home, tmp_path / "p", "--autostart-node")
    entry = read_desktop_entry(home.autostart / "polystrata-node.desktop")
    argv = exec_argv(entry["Exec"])
    assert argv == [str(tmp_path / "p" / "lib" / "polystrata" / "strata-node"), "serve"]
    assert run(argv, env=home.env()).stdout.strip() == "serving"
    assert entry["NoDisplay"] == "true"


def test_uninstall_keeps_models_and_removes_everything_else(
    installers: dict, home: Home, tmp_path: Path
) -> None:
    prefix = tmp_path / "p"
    install(installers["plain"][0], home, prefix, "--autostart")
    # What the app leaves over time: settings, chat history, a model, caches.
    (home.config).mkdir(parents=True)
    (home.config / "app-settings.json").write_text("{}")
    (home.data / "conversations").mkdir(parents=True)
    (home.data / "conversations" / "c1.json").write_text("{}")
    (home.data / "models").mkdir()
    (home.data / "models" / "model.gguf").write_bytes(b"GGUF" + bytes(100))
    (home.root / ".cache" / "PolyStrata").mkdir(parents=True)
    (home.root / ".cache" / "PolyStrata" / "x").write_text("x")
    (home.root / "notes.txt").write_text("the user's own file")

    out = run([prefix / "bin" / "strata-uninstall"], env=home.env()).stdout
    assert "kept the models" in out
    assert home.files() == [".local/share/PolyStrata/models/model.gguf", "notes.txt"]
    assert list(prefix.iterdir()) == []


def test_uninstall_removes_models_when_asked(installers: dict, home: Home, tmp_path: Path) -> None:
    prefix = tmp_path / "p"
    install(installers["plain"][0], home, prefix)
    (home.data / "models").mkdir(parents=True)
    (home.data / "models" / "model.gguf").write_bytes(b"GGUF")
    run([prefix / "lib" / "polystrata" / "uninstall.sh", "--remove-models"], env=home.env())
    assert home.files() == []


def test_uninstall_follows_strata_data_dir(installers: dict, home: Home, tmp_path: Path) -> None:
    prefix = tmp_path / "p"
    install(installers["plain"][0], home, prefix)
    data = tmp_path / "elsewhere"
    (data / "models").mkdir(parents=True)
    (data / "models" / "m.gguf").write_bytes(b"GGUF")
    (data / "conversations").mkdir()
    run([prefix / "bin" / "strata-uninstall", "--yes"], env=home.env(STRATA_DATA_DIR=str(data)))
    assert sorted(p.name for p in data.iterdir()) == ["models"]


def test_reinstall_replaces_the_program_and_keeps_data_and_autostart(
    installers: dict, home: Home, tmp_path: Path
) -> None:
    prefix = tmp_path / "p"
    install(installers["plain"][0], home, prefix, "--autostart")
    app_dir = prefix / "lib" / "polystrata"
    (app_dir / "_internal" / "stale-from-old-version").write_text("x")
    (home.data / "models").mkdir(parents=True)
    (home.data / "models" / "m.gguf").write_bytes(b"GGUF")
    (home.config).mkdir(parents=True)
    (home.config / "app-settings.json").write_text('{"port": 9000}')

    out = install(installers["plain"][0], home, prefix)
    assert "replacing" in out
    assert not (app_dir / "_internal" / "stale-from-old-version").exists()
    assert (home.data / "models" / "m.gguf").read_bytes() == b"GGUF"
    assert (home.config / "app-settings.json").read_text() == '{"port": 9000}'
    assert (home.autostart / "polystrata.desktop").is_file()  # carried over: not asked again
    assert sorted(p.name for p in (prefix / "lib").iterdir()) == ["polystrata"]


def test_install_refuses_a_folder_that_is_not_polystrata(
    installers: dict, home: Home, tmp_path: Path
) -> None:
    prefix = tmp_path / "p"
    (prefix / "lib" / "polystrata").mkdir(parents=True)
    (prefix / "lib" / "polystrata" / "precious.txt").write_text("keep")
    proc = run(
        ["sh", installers["plain"][0], "--prefix", prefix, "--yes", "--no-launch"],
        env=home.env(),
        check=False,
    )
    assert proc.returncode != 0
    assert "is not a PolyStrata installation" in proc.stderr
    assert (prefix / "lib" / "polystrata" / "precious.txt").read_text() == "keep"
    assert sorted(p.name for p in (prefix / "lib").iterdir()) == ["polystrata"]


def test_tarball_install_script_copies_and_headless_skips_desktop_files(
    installers: dict, home: Home, tmp_path: Path
) -> None:
    _, tarball = installers["plain"]
    unpacked = tmp_path / "unpacked"
    unpacked.mkdir()
    run(["tar", "-xzf", tarball, "-C", unpacked], env=home.env())
    (folder,) = unpacked.iterdir()
    prefix = tmp_path / "p"
    run([folder / "install.sh", "--prefix", prefix, "--yes", "--no-desktop"], env=home.env())
    assert (folder / "PolyStrata" / "strata").is_file()  # copied, not moved: the unpacked folder stays usable
    assert run([prefix / "bin" / "strata-engine"], env=home.env()).stdout.startswith("strata-engine ")
    assert home.files() == []  # no menu entry, no icons


def test_extract_only(installers: dict, home: Home, tmp_path: Path) -> None:
    run(["sh", installers["plain"][0], "--extract", tmp_path / "x"], env=home.env())
    (folder,) = (tmp_path / "x").iterdir()
    assert sorted(p.name for p in folder.iterdir()) == [
        "PolyStrata",
        "VERSION",
        "icons",
        "install.sh",
        "uninstall.sh",
    ]
    assert home.files() == []


def test_unknown_option_is_refused_before_anything_is_installed(
    installers: dict, home: Home, tmp_path: Path
) -> None:
    proc = run(
        ["sh", installers["plain"][0], "--prefix", tmp_path / "p", "--autostrat"], env=home.env(), check=False
    )
    assert proc.returncode != 0
    assert "unknown option --autostrat" in proc.stderr
    assert not (tmp_path / "p" / "lib" / "polystrata").exists()
    assert home.files() == []


def _on_terminal(cmd: list, env: dict[str, str], answers: dict[str, bytes], timeout: float = 60) -> str:
    """Run cmd on a pseudo-terminal, typing answers[k] when the output shows k; returns the whole output."""
    master, slave = pty.openpty()
    proc = subprocess.Popen([str(c) for c in cmd], stdin=slave, stdout=slave, stderr=slave, env=env)
    os.close(slave)
    out, pending, deadline = b"", dict(answers), time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.2)
            if ready:
                try:
                    chunk = os.read(master, 4096)
                except OSError:  # the program closed the terminal
                    break
                if not chunk:
                    break
                out += chunk
                for prompt in list(pending):
                    if prompt in out.decode(errors="replace"):
                        os.write(master, pending.pop(prompt))
            elif proc.poll() is not None:
                break
        assert proc.wait(timeout=5) == 0, out.decode(errors="replace")
    finally:
        os.close(master)
    assert not pending, f"never asked {list(pending)}:\n{out.decode(errors='replace')}"
    return out.decode(errors="replace")


def test_on_a_terminal_it_asks_and_follows_the_answers(installers: dict, home: Home, tmp_path: Path) -> None:
    fake_systemctl(home, works=False)
    prefix = tmp_path / "p"
    _on_terminal(
        ["sh", installers["serving"][0], "--prefix", prefix, "--no-launch"],
        home.env(),
        {"when you log in?": b"y\n", "this PC's GPUs?": b"n\n"},
    )
    assert (home.autostart / "polystrata.desktop").is_file()
    assert not (home.autostart / "polystrata-node.desktop").exists()

    (home.data / "models").mkdir(parents=True)
    (home.data / "models" / "m.gguf").write_bytes(b"GGUF")
    out = _on_terminal(
        [prefix / "bin" / "strata-uninstall"], home.env(), {"Also delete the downloaded models": b"y\n"}
    )
    assert "removed PolyStrata's settings, data and models" in out
    assert home.files() == []

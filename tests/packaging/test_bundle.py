"""The real thing, end to end: build the PyInstaller bundle from build.spec, pack it into the self-extracting Linux
installer, install it into a throw-away prefix and home, run the frozen engine (its output must equal the source
tree's), start the frozen app offscreen and let it start the frozen engine and serve, uninstall, and check that
nothing is left but the models. A few minutes on a 2-core machine; the durations are printed (-s shows them)."""

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

from app.settings import AppSettings, save_settings
from engine.testing.tiny_models import write_tiny_model
from installer.version import __version__
from tests.packaging.linux_env import ROOT, Home, build_installer, run

PROMPT = "Once upon a time"
N_TOKENS = 12
# Created by the fontconfig library for any Qt program, not by PolyStrata, and shared with other programs.
NOT_OURS = (".cache/fontconfig/",)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, body: dict | None = None) -> dict:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read())


def _engines_in(app_dir: Path) -> list[psutil.Process]:
    exe = str(app_dir / "strata-engine")
    found = []
    for p in psutil.process_iter(["exe"]):
        if p.info["exe"] == exe:
            found.append(p)
    return found


@pytest.mark.slow
@pytest.mark.bundle
# the build, and two first compiles of the CPU kernels (the frozen engine's and the source tree's, ~1 min each on 2
# cores), took 8-10 of the default 10 minutes on a busy 2-core machine
@pytest.mark.timeout(900)
def test_bundle_builds_installs_runs_and_uninstalls(tmp_path: Path) -> None:
    times: dict[str, float] = {}
    t = time.monotonic()

    # 1. The bundle, as a release build makes it.
    dist, work = tmp_path / "dist", tmp_path / "work"
    run(
        [
            sys.executable,
            "-m",
            "PyInstaller",
            "--noconfirm",
            "--log-level",
            "WARN",
            "--distpath",
            dist,
            "--workpath",
            work,
            ROOT / "build.spec",
        ],
        env={**os.environ},
        timeout=1800,
    )
    bundle = dist / "PolyStrata"
    size_mb = sum(f.lstat().st_size for f in bundle.rglob("*") if f.is_file() and not f.is_symlink()) / 2**20
    times["pyinstaller"] = time.monotonic() - t
    t = time.monotonic()

    # 2. The self-extracting installer (fastest gzip level: CI time; releases use the default).
    run_file, _ = build_installer(bundle, tmp_path / "out", "--gzip-level", "1", "--no-tarball")
    shutil.rmtree(work)
    shutil.rmtree(dist)
    times["installer"] = time.monotonic() - t
    t = time.monotonic()

    # 3. Install for a user whose home and prefix are empty folders.
    (tmp_path / "home").mkdir()
    home = Home(tmp_path / "home")
    prefix = tmp_path / "prefix"
    run(["sh", run_file, "--prefix", prefix, "--yes", "--no-launch"], env=home.env(), timeout=600)
    run_file.unlink()
    app_dir = prefix / "lib" / "polystrata"
    times["install"] = time.monotonic() - t
    t = time.monotonic()

    # 4. The frozen engine generates exactly what the source tree's engine does (greedy).
    (home.data / "models").mkdir(parents=True)
    model = write_tiny_model(home.data / "models" / "tiny.gguf", "qwen3moe", qtype="Q8_0")
    # the default activations, which the source tree's test run sets to float (tests/conftest.py): the frozen
    # engine then compiles and runs the CPU block kernels (Numba, cached in the home for the app's engine below)
    args = ["generate", "--model", str(model), "--prompt", PROMPT, "-n", str(N_TOKENS), "--device", "cpu",
            "--activations", "int8"]  # fmt: skip
    frozen = run([prefix / "bin" / "strata-engine", *args], env=home.env())
    # The source tree's engine keeps its Numba cache apart: the frozen one caches where its code says it was built
    # (this tree, here), with the executable's time stamp, and the source run would overwrite that index with the
    # source file's stamp, so the app's engine below would compile the kernels again (~15 s) instead of loading them.
    source = run(
        [sys.executable, "-m", "engine.cli", *args],
        env={
            **os.environ,
            "STRATA_DATA_DIR": str(tmp_path / "source-data"),
            "NUMBA_CACHE_DIR": str(tmp_path / "nb"),
        },
    )
    assert frozen.stdout == source.stdout
    assert frozen.stdout.startswith(PROMPT) and len(frozen.stdout) > len(PROMPT) + 1
    assert f"{N_TOKENS} generated" in frozen.stderr
    assert run([prefix / "bin" / "strata-engine", "--version"], env=home.env()).stdout.strip() == (
        f"strata-engine {__version__}"
    )
    times["engine"] = time.monotonic() - t
    t = time.monotonic()

    # 5. The frozen app, offscreen, starts the bundle's engine (PATH holds no other) and it serves the model.
    port = _free_port()
    home.config.mkdir(parents=True, exist_ok=True)
    save_settings(
        AppSettings(model=str(model), port=port, device="cpu", wizard_done=True),
        home.config / "app-settings.json",
    )
    quit_after = 25
    app = subprocess.Popen(
        [str(prefix / "bin" / "strata"), "--quit-after", str(quit_after)],
        env=home.env(QT_QPA_PLATFORM="offscreen"),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + quit_after - 8
        health: dict = {}
        while time.monotonic() < deadline and health.get("status") != "ready":
            assert app.poll() is None, f"the app exited early ({app.returncode}):\n{app.communicate()[0]}"
            try:
                health = _get(f"http://127.0.0.1:{port}/health")
            except OSError:
                pass
            time.sleep(0.3)
        assert health.get("status") == "ready", f"the engine was not ready in time: {health}"
        times["app_to_ready"] = time.monotonic() - t
        engines = _engines_in(app_dir)
        assert len(engines) == 1 and engines[0].ppid() == app.pid, "the app did not start the bundle's engine"
        completion = _get(
            f"http://127.0.0.1:{port}/v1/completions",
            {"model": "tiny", "prompt": PROMPT, "max_tokens": N_TOKENS, "temperature": 0},
        )
        assert completion["choices"][0]["text"] == frozen.stdout[len(PROMPT) :].removesuffix("\n")
        output, _ = app.communicate(timeout=quit_after + 60)
    finally:
        if app.poll() is None:
            app.kill()
            app.wait()
    assert app.returncode == 0, output
    assert "Traceback" not in output, output
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", port)) != 0, "the engine still listens after the app quit"
    assert _engines_in(app_dir) == []
    times["app_total"] = time.monotonic() - t
    t = time.monotonic()

    # 6. Uninstall: only the models stay.
    out = run([prefix / "bin" / "strata-uninstall", "--yes"], env=home.env()).stdout
    assert "kept the models" in out
    left = [f for f in home.files() if not f.startswith(NOT_OURS)]
    assert left == [".local/share/PolyStrata/models/tiny.gguf"]
    assert list(prefix.iterdir()) == []
    times["uninstall"] = time.monotonic() - t

    print(f"\nbundle {size_mb:.0f} MiB; " + ", ".join(f"{k} {v:.1f} s" for k, v in times.items()))

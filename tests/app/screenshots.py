"""Screenshots of each window for docs/gui.md, taken under Xvfb (or offscreen):

    xvfb-run -s "-screen 0 1400x1000x24" .venv/bin/python -m tests.app.screenshots docs/img [--engine real|fake]

`--engine real` starts `strata-engine serve` on the embedded Gemma 3 270M (CPU); `fake` runs
tests/app/fake_engine.py. The GPU rows come from a simulated two-card PC (tests/app/fake_nvml.py) unless this PC
has NVIDIA cards and `--real-gpus` is given.
"""

import argparse
import os
import random
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("out", type=Path)
    p.add_argument("--engine", choices=("real", "fake"), default="fake")
    p.add_argument("--real-gpus", action="store_true")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="strata-shots-"))
    os.environ["STRATA_CONFIG_DIR"] = str(tmp / "config")
    os.environ["STRATA_DATA_DIR"] = str(tmp / "data")

    from PySide6.QtCore import QEventLoop, QTimer
    from PySide6.QtWidgets import QApplication

    from app.application import StrataApp
    from app.settings import AppSettings, Sampling
    from installer.gpus import GpuInfo, ProbeResult
    from tests.app.fake_nvml import two_cards

    app = QApplication.instance() or QApplication([])
    app.setStyle("Fusion")

    def wait(seconds: float, until: object = None) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            app.processEvents(QEventLoop.ProcessEventsFlag.AllEvents, 50)
            if until is not None and until():  # type: ignore[operator]
                return
            time.sleep(0.01)

    if args.engine == "real":  # the embedded Gemma 3 270M on the CPU
        command = None
        settings = AppSettings(device="cpu", port=_free_port(), max_context=2048)
    else:
        command = [sys.executable, str(Path(__file__).with_name("fake_engine.py"))]
        settings = AppSettings(model="", port=_free_port())
    settings = settings.with_changes(sampling=Sampling(temperature=0.0, max_tokens=12))
    gib = 1024**3
    cards = (
        GpuInfo(
            0,
            "GPU-0",
            "NVIDIA GeForce RTX 3090",
            24 * gib,
            23 * gib,
            (8, 6),
            "580.65",
            4,
            16,
            4,
            16,
            82,
            2100,
        ),
        GpuInfo(
            1, "GPU-1", "NVIDIA GeForce RTX 3070", 8 * gib, 7 * gib, (8, 6), "580.65", 4, 8, 4, 16, 46, 1905
        ),
        GpuInfo(
            2,
            "GPU-2",
            "NVIDIA GeForce GTX 1080 Ti",
            11 * gib,
            11 * gib,
            (6, 1),
            "580.65",
            3,
            16,
            3,
            16,
            28,
            1582,
        ),
    )
    fake_probe = ProbeResult(kind="ok", gpus=cards, driver="580.65")
    strata = StrataApp(
        settings,
        engine_command=command,
        tray_reason=None,
        nvml=None if args.real_gpus else two_cards(),
        probe_fn=(lambda: fake_probe) if not args.real_gpus else __import__("installer.gpus").gpus.probe,
        save=lambda s: None,
        poll_ms=200,
    )
    _wizard_shots(args.out, wait, tmp)
    strata.start()
    wait(120, lambda: strata.engine.state == "ready")
    wait(1.0)
    print("engine:", strata.engine.state, strata.engine.message, file=sys.stderr)

    chat = strata.open_chat()
    chat.resize(1000, 700)
    strata.chat.set_system_prompt("Answer briefly.")
    chat.sampling.load()
    chat.settings_toggle.setChecked(True)
    chat.input.setPlainText("Write a short poem about layers of rock.")
    chat.send()
    wait(240, lambda: not strata.chat.busy)
    wait(0.3)
    chat.input.setPlainText("What is a GPU? Answer in **one** sentence.")
    chat.send()
    wait(240, lambda: not strata.chat.busy)
    wait(0.5)
    chat.grab().save(str(args.out / "chat.png"))

    # Synthetic stage timings on top of the engine's own events: a two-stage split decoding and reading a prompt.
    rng = random.Random(0)
    strata.charts.clear()  # only the simulated split in this picture
    feed_until = time.monotonic() + 8.0

    def feed() -> None:
        if time.monotonic() > feed_until:
            return
        for stage, base in ((0, 11.0), (1, 18.0)):
            strata.charts.on_event({"type": "step", "stage": stage, "ms": base + rng.gauss(0, 0.8)})
        if rng.random() < 0.05:
            for stage, base in ((0, 140.0), (1, 210.0)):
                strata.charts.on_event(
                    {"type": "prompt_chunk", "stage": stage, "tokens": 512, "ms": base + rng.gauss(0, 8)}
                )
        if rng.random() < 0.03:
            strata.charts.on_event(
                {
                    "type": "request",
                    "prompt_per_second": 2400 + rng.gauss(0, 80),
                    "predicted_per_second": 33 + rng.gauss(0, 1),
                }
            )

    timer = QTimer()
    timer.timeout.connect(feed)
    timer.start(30)
    win = strata.window
    win.resize(1200, 860)
    win.tabs.setCurrentWidget(win.charts_page)
    win.show()
    wait(9.0)
    win.grab().save(str(args.out / "main-charts.png"))
    bar = win.charts_page.scroll.verticalScrollBar()
    bar.setValue(bar.maximum())
    wait(0.5)
    win.grab().save(str(args.out / "main-charts-gpus.png"))
    bar.setValue(0)
    win.tabs.setCurrentWidget(win.engine_page)
    wait(0.5)
    win.grab().save(str(args.out / "main-engine.png"))
    win.tabs.setCurrentWidget(win.workers_page)
    wait(20.0, lambda: strata.nodes.serve_supported is not None and not strata.nodes.refreshing)
    if win.workers_page.add_button.isEnabled():  # this build's agent can serve: lend this PC
        win.workers_page.add_button.click()
        wait(30.0, lambda: bool(strata.nodes.local_info.get("port")))
    wait(0.5)
    win.grab().save(str(args.out / "main-workers.png"))
    strata.nodes.stop_this_pc()
    win.tabs.setCurrentWidget(win.settings_page)
    wait(0.3)
    win.grab().save(str(args.out / "main-settings.png"))

    assert strata.tray is not None
    strata.tray.menu.popup(win.mapToGlobal(win.rect().center()))
    wait(0.5)
    strata.tray.menu.grab().save(str(args.out / "tray-menu.png"))
    strata.tray.menu.hide()

    # A broken model file: the real engine reports an error (or exits); then a real crash: the process is killed.
    bad = tmp / "broken.gguf"
    bad.write_bytes(b"this is not a GGUF file\n" * 8)
    if args.engine == "real":
        strata.engine.apply_settings(strata.engine.settings.with_changes(model=str(bad)))
    else:
        os.environ["FAKE_HEALTH_ERROR"] = f"{bad}: not a GGUF file; choose a .gguf model file"
    strata.engine.restart()
    wait(180, lambda: strata.engine.state in ("error", "crashed"))
    win.tabs.setCurrentWidget(win.engine_page)
    wait(1.0)
    win.grab().save(str(args.out / "main-error.png"))
    if strata.engine.state == "error" and strata.engine._proc is not None:
        os.kill(int(strata.engine._proc.processId()), 9)
    wait(180, lambda: strata.engine.state == "crashed")
    wait(0.5)
    win.crash_dialog.grab().save(str(args.out / "crash-dialog.png"))
    win.crash_dialog.close()

    strata.shutdown()
    print("screenshots in", args.out, file=sys.stderr)
    return 0


def _wizard_shots(out: Path, wait: Any, tmp: Path) -> None:
    """The wizard's pages on the seed's three cards, with Qwen3-30B-A3B from the catalog; its download runs
    against a local imitation of the hub that serves a small stand-in file slowly (nothing leaves this PC)."""
    from app.controllers.wizard import WizardController
    from installer.download import Downloader, DownloadOptions
    from tests.app.test_nodes import SEED_PC
    from tests.installer.hubserver import Hub

    hub = Hub()
    entry = "qwen3-30b-a3b-instruct-2507-q4_k_m"
    hub.add(
        "unsloth/Qwen3-30B-A3B-Instruct-2507-GGUF",
        "Qwen3-30B-A3B-Instruct-2507-Q4_K_M.gguf",
        random.Random(1).randbytes(6 << 20),
        throttle_s=0.01,
    )
    ctl = WizardController(
        probe_fn=lambda: SEED_PC,
        make_downloader=lambda dest: Downloader(dest, endpoint=hub.url, options=DownloadOptions(parts=2)),
        models_dir=lambda: tmp / "models",
        config_dir=tmp / "config",
    )
    from app.ui.wizard import SetupWizard

    wizard = SetupWizard(ctl)
    wizard.show()
    wait(3, lambda: not ctl.probing)
    wait(0.3)
    wizard.grab().save(str(out / "wizard-1-gpus.png"))
    wizard.next()
    for i in range(wizard.model_page.list.count()):
        if wizard.model_page.list.item(i).data(256) == entry:
            wizard.model_page.list.setCurrentRow(i)
    wait(0.3)
    wizard.grab().save(str(out / "wizard-2-model.png"))
    wizard.next()
    wait(2.5)
    wizard.grab().save(str(out / "wizard-3-download.png"))
    wait(60, lambda: ctl.downloaded)
    wizard.next()
    wait(0.3)
    wizard.grab().save(str(out / "wizard-4-split.png"))
    wizard.next()
    wait(0.3)
    wizard.grab().save(str(out / "wizard-5-done.png"))
    wizard.close()
    hub.close()


if __name__ == "__main__":
    sys.exit(main())

"""Screenshots of each window for docs/app.md, taken under Xvfb (or offscreen):

    xvfb-run -s "-screen 0 1400x1000x24" .venv/bin/python -m tests.app.screenshots docs/img [--engine real|fake]

`--engine real` starts `strata-engine serve` on the embedded chat model (CPU); `fake` runs
tests/app/fake_engine.py. The GPU rows come from a simulated two-card PC (tests/app/fake_nvml.py) unless this PC
has NVIDIA cards and `--real-gpus` is given, and from a worker PC: a real node agent on loopback with a scripted
NVML, paired with the app's keys.
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
    os.environ["XDG_CONFIG_HOME"] = str(tmp / "xdg-config")  # the autostart checkbox never touches this PC's

    from PySide6.QtCore import QEventLoop, Qt, QTimer
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

    if args.engine == "real":  # the embedded chat model on the CPU
        command = None
        settings = AppSettings(device="cpu", port=_free_port(), max_context=2048)
    else:
        command = [sys.executable, str(Path(__file__).with_name("fake_engine.py"))]
        settings = AppSettings(model="", port=_free_port())
    settings = settings.with_changes(sampling=Sampling(temperature=0.0, max_tokens=72))
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
    box, box_nvml = _worker_pc(tmp)
    strata = StrataApp(
        settings,
        engine_command=command,
        node_command=[sys.executable, "-m", "engine.node.cli"],  # this checkout's agent and its client
        tray_reason=None,
        nvml=None if args.real_gpus else two_cards(),
        probe_fn=(lambda: fake_probe) if not args.real_gpus else __import__("installer.gpus").gpus.probe,
        save=lambda s: None,
        poll_ms=200,
    )
    _wizard_shots(args.out, wait, tmp)
    _cpu_only_shots(args.out, wait, tmp)
    strata.start()
    wait(120, lambda: strata.engine.state == "ready")
    wait(1.0)
    print("engine:", strata.engine.state, strata.engine.message, file=sys.stderr)

    chat = strata.open_chat()
    chat.resize(1000, 700)
    strata.chat.set_system_prompt("Answer briefly.")
    chat.sampling.load()
    chat.settings_toggle.setChecked(True)
    chat.input.setPlainText("What is a GPU? Answer in **one** sentence.")
    chat.send()
    wait(240, lambda: not strata.chat.busy)
    wait(0.3)
    chat.input.setPlainText("Write a Python function that adds two numbers.")
    chat.send()
    wait(240, lambda: not strata.chat.busy)
    wait(0.5)
    chat.grab().save(str(args.out / "chat.png"))
    win = strata.window
    win.tabs.setCurrentWidget(win.library_page)
    strata.library.refresh()
    wait(30, lambda: not strata.library.scanning and bool(strata.library.models))
    wait(0.5)
    win.grab().save(str(args.out / "main-models.png"))

    # Synthetic stage timings on top of the engine's own events: a split over two cards of this PC and a worker PC,
    # reading a prompt, decoding, pausing, and again. The worker PC's card drops its clocks while idle.
    rng = random.Random(0)
    strata.charts.clear()  # only the simulated split in this picture
    start = time.monotonic()
    stages = (
        # stage, layers, where, compute ms per step, transfer ms per step, prompt chunk compute ms
        (0, "0-15", {"device": "cuda:0"}, 6.0, 0.0, 45.0),
        (1, "16-31", {"device": "cuda:1"}, 7.0, 0.15, 52.0),
        (2, "32-47", {"device": "remote", "host": "192.168.1.20:7470"}, 8.5, 1.6, 61.0),
    )

    def feed() -> None:
        at = time.monotonic() - start
        if at > 24.0:
            return
        box_nvml.live[0].pstate, box_nvml.live[0].sm_mhz, box_nvml.live[0].reasons = (
            (8, 210, 0x1) if rng.random() < 0.3 else (2, 1905, 0)
        )
        # three answers: a prompt read in chunks, then decoding; a pause between them
        phase = "idle"
        busy = 0  # slots holding a request (--parallel): three, four, then two clients at once
        for (begin, end), clients in zip(((0.0, 6.0), (8.0, 15.0), (17.0, 24.0)), (3, 4, 2), strict=True):
            if begin <= at < end:
                phase = "prompt" if at < begin + 0.6 else "decode"
                busy = clients
        if phase == "idle":
            return
        upstream = 0.0
        for stage, layers, where, step_ms, transfer, chunk_ms in stages:
            prompt = phase == "prompt"
            compute = (chunk_ms if prompt else step_ms) * (1 + rng.gauss(0, 0.05))
            hop = transfer * (8 if prompt else 1) * (1 + rng.gauss(0, 0.1))
            # waiting: local cards idle until the stages before them are done; a worker's request queues briefly
            wait = upstream if where["device"] != "remote" else rng.uniform(0.1, 0.4)
            ev = {
                "type": "prompt_chunk" if prompt else "step",
                "stage": stage,
                "ms": compute,
                "compute_ms": compute,
                "wait_ms": wait,
                "transfer_ms": hop,
                "layers": layers,
                "tokens": 512 if prompt else busy,  # a shared step decides a token for each busy slot
                **where,
            }
            if not prompt:  # now and then a new request's prompt tokens ride along with the decode rows
                ev.update(rows=busy + (rng.choice((8, 16)) if rng.random() < 0.08 else 0), slots=busy)
            strata.charts.on_event(ev)
            upstream += compute + hop
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
    win.resize(1200, 960)
    win.tabs.setCurrentWidget(win.charts_page)
    win.show()
    wait(24.5)
    win.grab().save(str(args.out / "main-charts.png"))
    page = win.charts_page
    remote_key = "gpu-box:0"
    wait(20.0, lambda: remote_key in strata.charts.flags and remote_key in page.gpu_rows)
    page.gpu_rows[remote_key].lock_button.click()  # the agent is not root: its answer says what to do
    wait(30.0, lambda: page.gpu_rows[remote_key].lock_button.isEnabled())
    bar = page.scroll.verticalScrollBar()
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
    wp = win.workers_page  # run the model across this PC and gpu-box: tick its card, see the plan
    wait(
        20.0,
        lambda: any(wp.plan_cards.item(i).text().startswith("gpu-box") for i in range(wp.plan_cards.count())),
    )
    for i in range(wp.plan_cards.count()):
        if wp.plan_cards.item(i).text().startswith("gpu-box"):
            wp.plan_cards.item(i).setCheckState(Qt.CheckState.Checked)
            break
    win.resize(1200, 1080)
    wait(0.5)
    win.grab().save(str(args.out / "main-workers.png"))
    win.resize(1200, 960)
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
    box.close()
    print("screenshots in", args.out, file=sys.stderr)
    return 0


def _worker_pc(tmp: Path) -> tuple[Any, Any]:
    """A worker PC on loopback: a real node agent (its NVML scripted: an RTX 3080 whose agent has no administrator
    rights), paired with this app's main keys, so the charts follow it through the real `strata-node samples`."""
    import pynvml

    from engine.node.agent import Agent, AgentOptions
    from engine.node.client import main_keys
    from tests.engine.node.conftest import pair_with
    from tests.engine.node.fake_nvml import RTX_3080, ClockNvml

    nv = ClockNvml(cards=[RTX_3080], lock_error=pynvml.NVML_ERROR_NO_PERMISSION)
    nv.live[0].util_gpu = 93
    opts = AgentOptions(tmp / "gpu-box", "127.0.0.1", 0, "gpu-box", nvml=nv, sample_ms=100, advertise=False)
    agent = Agent(opts).start()
    pair_with(agent, main_keys()).client.close()
    return agent, nv


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

    wizard = _first_two_pages(ctl, out, wait, "", entry)
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


def _cpu_only_shots(out: Path, wait: Any, tmp: Path) -> None:
    """What a PC without an NVIDIA card sees: the wizard's first page (the CPU mode offered) and the model list
    with each model's fit in 24 GiB of RAM, the first offered one that fits."""
    from app.controllers.wizard import WizardController
    from installer.gpus import ProbeResult

    ctl = WizardController(
        probe_fn=lambda: ProbeResult("no_gpus", message="no NVIDIA GPU found"),
        models_dir=lambda: tmp / "models-cpu",
        config_dir=tmp / "config-cpu",
        ram_bytes=lambda: 24 * 1024**3,
    )
    _first_two_pages(ctl, out, wait, "-cpu").close()


def _first_two_pages(ctl: Any, out: Path, wait: Any, suffix: str, entry: str | None = None) -> Any:
    """The wizard's GPU page and model page (with `entry` chosen, else the first offered) as wizard-1-gpus and
    wizard-2-model (+ `suffix`) -> the wizard, on its model page."""
    from app.ui.wizard import SetupWizard

    wizard = SetupWizard(ctl)
    wizard.show()
    wait(3, lambda: not ctl.probing)
    wait(0.3)
    wizard.grab().save(str(out / f"wizard-1-gpus{suffix}.png"))
    wizard.next()
    for i in range(wizard.model_page.list.count()):
        if entry is not None and wizard.model_page.list.item(i).data(256) == entry:
            wizard.model_page.list.setCurrentRow(i)
    wait(0.3)
    wizard.grab().save(str(out / f"wizard-2-model{suffix}.png"))
    return wizard


if __name__ == "__main__":
    sys.exit(main())

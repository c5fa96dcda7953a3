"""The first-run wizard (controller and pages) on top of the installer: fake NVML cards, the real catalog, and a
local imitation of the Hugging Face hub for the download."""

import hashlib
import json
import random
from collections.abc import Iterator
from pathlib import Path

import pytest
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QWizard
from pytestqt.qtbot import QtBot

from app.controllers.wizard import WizardController
from app.ui.wizard import SetupWizard
from installer.catalog import load_catalog
from installer.config import read_config
from installer.download import Downloader, DownloadOptions
from installer.gpus import ProbeResult
from tests.app.test_nodes import SEED_PC
from tests.installer.hubserver import Hub

KIB = 1024
REPO = "test/tiny-moe-GGUF"
FILE = "tiny-moe-Q4_K_M.gguf"
DATA = random.Random(7).randbytes(600 * KIB)


def write_catalog(tmp_path: Path, sha256: str | None) -> Path:
    doc = {
        "version": 1,
        "models": [
            {
                "family": "tiny-moe",
                "display_name": "Tiny MoE",
                "architecture": "qwen3moe",
                "layers": 24,
                "experts": 16,
                "experts_used": 2,
                "context": 8192,
                "geometry": {
                    "hidden_size": 256,
                    "expert_ffn": 128,
                    "kv_heads": 2,
                    "head_dim": 64,
                    "vocab": 1000,
                    "params_total": 4_000_000,
                    "tied_embeddings": False,
                },
                "variants": [
                    {
                        "id": "tiny-moe-q4_k_m",
                        "quant": "Q4_K_M",
                        "hf_repo": REPO,
                        "files": [{"path": FILE, "size_bytes": len(DATA), "sha256": sha256}],
                        "size_bytes": len(DATA),
                        "size_exact": True,
                    }
                ],
            }
        ],
    }
    path = tmp_path / "catalog.json"
    path.write_text(json.dumps(doc))
    return path


FAST = DownloadOptions(
    parts=2,
    min_part_bytes=128 * KIB,
    chunk_bytes=16 * KIB,
    stall_timeout_s=0.3,
    connect_timeout_s=2.0,
    max_retries=2,
    backoff_base_s=0.02,
    backoff_max_s=0.1,
    free_margin_bytes=0,
    save_every_bytes=32 * KIB,
    save_interval_s=0.05,
    event_interval_s=0.01,
    verify_retries=0,
)


def _opened(qtbot: QtBot, ctl: WizardController) -> SetupWizard:
    """The wizard shown, its cards probed (the GPU page complete)."""
    wizard = SetupWizard(ctl)
    qtbot.addWidget(wizard)
    wizard.show()
    qtbot.waitUntil(lambda: wizard.gpu_page.isComplete(), timeout=3000)
    return wizard


@pytest.fixture
def hub() -> Iterator[Hub]:
    server = Hub()
    yield server
    server.close()


def make_ctl(tmp_path: Path, hub: Hub, probe: ProbeResult = SEED_PC, sha: bool = True) -> WizardController:
    catalog = load_catalog(write_catalog(tmp_path, hashlib.sha256(DATA).hexdigest() if sha else None))
    return WizardController(
        probe_fn=lambda: probe,
        catalog=catalog,
        make_downloader=lambda dest: Downloader(dest, endpoint=hub.url, options=FAST),
        models_dir=lambda: tmp_path / "models",
        config_dir=tmp_path / "config",
        ram_bytes=lambda: 32 << 30,  # a PC of 32 GiB, whatever runs the tests
    )


def test_controller_gpus_model_fit(qtbot: QtBot, tmp_path: Path, hub: Hub) -> None:
    ctl = make_ctl(tmp_path, hub)
    with qtbot.waitSignal(ctl.probed, timeout=3000):
        ctl.probe()
    assert [c.usable for c in ctl.cards] == [True, False, True, False]
    assert ctl.choices[0].recommended and ctl.choices[0].indices == (0, 2)  # newest generation first
    assert ctl.gpus == ctl.choices[0].gpus and ctl.gpu_message == ""
    assert ctl.choose_model("no-such-model") is not None
    assert ctl.choose_model("tiny-moe-q4_k_m") is None
    assert ctl.context == 8192
    fit = ctl.fit()
    assert fit is not None and [c.gpu.index for c in fit.cards] == [
        0,
        2,
    ]  # speeds unknown: the order as given
    assert fit.cards[0].begin == 0 and fit.cards[-1].end == 24 and fit.cards[-1].last
    lines = ctl.fit_lines()
    assert lines[-1].startswith("fits fully") and any("room for experts" in ln for ln in lines)
    ctl.choose_gpus(None)
    assert ctl.fit() is None and ctl.fit_lines()[0] == "CPU only: Tiny MoE Q4_K_M at 8192 tokens of context"
    assert ctl.fit_lines()[1].startswith("CPU mode, RAM: weights ") and "RAM 32.0 GiB" in ctl.fit_lines()[1]


def test_no_driver_offers_the_cpu(qtbot: QtBot, tmp_path: Path, hub: Hub) -> None:
    ctl = make_ctl(
        tmp_path,
        hub,
        ProbeResult(
            kind="no_nvml", message="No NVIDIA driver found. PolyStrata can still run on the CPU (slow)."
        ),
    )
    wizard = SetupWizard(ctl)
    qtbot.addWidget(wizard)
    wizard.show()
    qtbot.waitUntil(lambda: not ctl.probing, timeout=3000)
    page = wizard.gpu_page
    assert "No NVIDIA driver found" in page.message.text()
    assert [b.text() for b in page.group.buttons()] == ["1) CPU mode (no GPU; slow)"]
    assert page.group.button(0).isChecked() and ctl.gpus == ()


def test_wizard_end_to_end_with_download(qtbot: QtBot, tmp_path: Path, hub: Hub) -> None:
    hub.add(REPO, FILE, DATA, drops=[100 * KIB])  # the first connection is cut: the download resumes
    ctl = make_ctl(tmp_path, hub)
    wizard = _opened(qtbot, ctl)
    assert "✖" in wizard.gpu_page.listing.text() and "GTX 1080 Ti" in wizard.gpu_page.listing.text()
    assert wizard.gpu_page.group.buttons()[0].text().endswith("(recommended)")
    wizard.next()
    assert wizard.currentPage() is wizard.model_page and ctl.model is not None
    assert "fits fully" in wizard.model_page.fit.text()
    wizard.next()  # checks the config can be written, starts the download
    assert ctl.config_path is None  # written once the model is in place
    qtbot.waitUntil(lambda: wizard.download_page.isComplete(), timeout=10000)
    assert ctl.config_path is not None and ctl.config_path.name == "strata-tiny-moe-q4_k_m.json"
    got = tmp_path / "models" / "test--tiny-moe-GGUF" / FILE
    assert got.read_bytes() == DATA
    assert wizard.download_page.bar.value() == 1000 and str(got) in wizard.download_page.status.text()
    cfg = read_config(ctl.config_path)
    assert (cfg.model, cfg.gpu, cfg.layer_split, cfg.max_context) == (str(got), (0, 2), "auto", 8192)
    wizard.next()
    picture = wizard.split_page.picture
    assert picture.layers == 24 and picture.segments[0].begin == 0 and picture.segments[-1].end == 24
    assert picture.segments[-1].head and picture.segments[0].title.startswith("GPU ")
    assert "experts in VRAM" in picture.segments[0].detail
    wizard.next()
    assert str(ctl.config_path) in wizard.done_page.summary.text()
    with qtbot.waitSignal(wizard.setupDone, timeout=2000) as done:
        wizard.button(QWizard.WizardButton.FinishButton).click()
    assert done.args == [str(ctl.config_path), True]


def test_download_failure_is_shown_with_retry(qtbot: QtBot, tmp_path: Path, hub: Hub) -> None:
    hub.add(REPO, FILE, DATA, corrupt_offset=5000, corrupt_times=1000)  # never the right bytes
    ctl = make_ctl(tmp_path, hub)
    wizard = _opened(qtbot, ctl)
    wizard.next()
    wizard.next()
    qtbot.waitUntil(lambda: bool(wizard.download_page.error.text()), timeout=10000)
    assert "sha256" in wizard.download_page.error.text()
    assert not wizard.download_page.retry.isHidden() and not wizard.download_page.isComplete()
    assert not (tmp_path / "models" / "test--tiny-moe-GGUF" / FILE).exists()  # nothing half-done at the name
    assert ctl.config_path is None and not list((tmp_path / "config").glob("strata-*.json"))  # no config left
    assert not wizard.download_page.embedded.isHidden()  # a way on: the model that comes with PolyStrata
    hub.files[f"{REPO}/{FILE}"].corrupt_times = 0
    wizard.download_page.retry.click()
    qtbot.waitUntil(lambda: wizard.download_page.isComplete(), timeout=10000)


def test_local_file_needs_no_download(qtbot: QtBot, tmp_path: Path, hub: Hub) -> None:
    model = tmp_path / "mine.gguf"
    model.write_bytes(b"GGUF....")
    ctl = make_ctl(tmp_path, hub)
    wizard = _opened(qtbot, ctl)
    wizard.next()
    wizard.model_page.other.setText(str(model))
    wizard.model_page.other.returnPressed.emit()
    assert ctl.model_name == "mine.gguf"
    wizard.next()
    assert wizard.download_page.isComplete() and "Nothing to download" in wizard.download_page.what.text()
    assert read_config(ctl.config_path).model == str(model)
    wizard.next()
    assert wizard.split_page.picture.segments == []
    assert "when it loads" in wizard.split_page.lines.text()


def test_the_model_list_labels_each_fit_and_offers_one_that_fits_first(
    qtbot: QtBot, tmp_path: Path, hub: Hub
) -> None:
    """A CPU-only PC of 2 GiB: the 0.6 MB model runs, one of 84 GB does not, and the list says so, fitting first."""
    catalog = json.loads(write_catalog(tmp_path, None).read_text())
    huge = json.loads(json.dumps(catalog["models"][0]))
    huge["family"], huge["display_name"] = "huge-moe", "Huge MoE"
    var = huge["variants"][0]
    var["id"], var["size_bytes"], var["files"][0]["size_bytes"] = (
        "huge-moe-q8",
        84_800_000_000,
        84_800_000_000,
    )
    catalog["models"].insert(0, huge)  # first in the catalog's own order
    (tmp_path / "catalog.json").write_text(json.dumps(catalog))
    ctl = WizardController(
        probe_fn=lambda: ProbeResult(kind="no_nvml", message="No NVIDIA driver found."),
        catalog=load_catalog(tmp_path / "catalog.json"),
        models_dir=lambda: tmp_path / "models",
        config_dir=tmp_path / "config",
        ram_bytes=lambda: 4 << 30,
    )
    wizard = _opened(qtbot, ctl)
    wizard.next()
    items = [wizard.model_page.list.item(i).text() for i in range(wizard.model_page.list.count())]
    assert items[0].startswith("Tiny MoE") and items[0].endswith("CPU only")
    assert items[1].startswith("Huge MoE") and "does not fit" in items[1]
    assert ctl.model is not None and ctl.model.id == "tiny-moe-q4_k_m"  # the first offered fits


def test_enter_in_the_model_field_does_not_press_next_and_a_bad_name_leaves_nothing_chosen(
    qtbot: QtBot, tmp_path: Path, hub: Hub
) -> None:
    ctl = make_ctl(tmp_path, hub)
    wizard = _opened(qtbot, ctl)
    wizard.next()
    page = wizard.model_page
    assert ctl.model is not None and page.isComplete()
    mine = tmp_path / "mine.gguf"
    mine.write_bytes(b"GGUF....")
    page.other.setText(str(mine))
    qtbot.keyClick(page.other, Qt.Key.Key_Return)
    assert ctl.model is not None and ctl.model.path == mine  # Enter used the field ...
    assert wizard.currentPage() is page  # ... and did not press Next as well
    page.other.setText("owner/no-such-repo")  # not owner/repo:file
    qtbot.keyClick(page.other, Qt.Key.Key_Return)
    assert page.error.text()  # what is wrong with it
    assert ctl.model is None and not page.isComplete()  # not the model chosen before


def test_a_failed_download_can_go_on_with_the_embedded_model(
    qtbot: QtBot, tmp_path: Path, hub: Hub, monkeypatch: pytest.MonkeyPatch
) -> None:
    from installer import default_model

    embedded = tmp_path / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
    embedded.write_bytes(b"GGUF")
    monkeypatch.setattr(default_model.Embedded, "path", lambda self, assemble=True: embedded)
    hub.add(REPO, FILE, DATA, corrupt_offset=5000, corrupt_times=1000)
    ctl = make_ctl(tmp_path, hub)
    ctl.catalog = load_catalog()  # the real catalog: it has the embedded chat model
    assert ctl.choose_model("tiny-moe-q4_k_m") is not None  # not in the real catalog ...
    ctl.catalog = load_catalog(write_catalog(tmp_path, hashlib.sha256(DATA).hexdigest()))
    wizard = _opened(qtbot, ctl)
    wizard.next()
    wizard.next()
    qtbot.waitUntil(lambda: bool(wizard.download_page.error.text()), timeout=10000)
    ctl.catalog = load_catalog()
    wizard.download_page.embedded.click()
    qtbot.waitUntil(lambda: wizard.download_page.isComplete(), timeout=10000)
    assert ctl.is_embedded and ctl.model_path == embedded
    assert read_config(ctl.config_path).model == str(embedded)

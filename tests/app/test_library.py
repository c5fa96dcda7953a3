"""The model library: the models on this PC (installer.library) found, described and deleted; the Models page,
the chat window's picker and the tray's Model menu, serving one through the app (the engine restarts on it)."""

from pathlib import Path

import pytest
from pytestqt.qtbot import QtBot

from app.controllers.library import LibraryController
from app.ui.library_page import LibraryPage
from engine.testing.tiny_models import write_tiny_model
from installer import library
from installer.catalog import load_catalog
from installer.gpus import ProbeResult
from tests.app.test_windows import make_app  # noqa: F401 - the fixture

CATALOG = load_catalog()
KNOWN = next(e for e in CATALOG if e.id == "qwen3-30b-a3b-instruct-2507-q4_k_m")


@pytest.fixture
def shelf(tmp_path: Path) -> Path:
    """A models folder: a file the catalog knows (by name), a split model in two parts, and a file of our own."""
    models = tmp_path / "models"
    (models / "unsloth").mkdir(parents=True)
    with (models / "unsloth" / KNOWN.main_file.name.rsplit("/", 1)[-1]).open("wb") as f:
        f.truncate(KNOWN.size_bytes)  # sparse: its real size, no disk used
    (models / "split").mkdir()
    for i in (1, 2):
        (models / "split" / f"big-0000{i}-of-00002.gguf").write_bytes(b"GGUF" + b"\0" * (10 * i))
    (models / "mine").mkdir()
    write_tiny_model(models / "mine" / "tiny.gguf", "qwen3moe", seed=1, qtype="Q4_K")
    return models


def test_the_models_on_this_pc_are_found_described_and_deleted(
    shelf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    index = shelf.parent / library.INDEX
    got = library.scan([shelf], CATALOG, index_path=index)
    by_name = {m.path.name: m for m in got}
    assert set(by_name) == {KNOWN.main_file.name.rsplit("/", 1)[-1], "big-00001-of-00002.gguf", "tiny.gguf"}
    known = by_name[KNOWN.main_file.name.rsplit("/", 1)[-1]]
    assert (known.catalog_id, known.architecture, known.quant) == (KNOWN.id, KNOWN.architecture, KNOWN.quant)
    split = by_name["big-00001-of-00002.gguf"]
    assert len(split.parts) == 2 and split.size == 14 + 24  # both parts counted, listed once
    tiny = by_name["tiny.gguf"]
    assert tiny.architecture == "qwen3moe" and tiny.catalog_id is None
    assert index.exists() and not (shelf / library.INDEX).exists()  # beside the models, not among them

    def unread(path: Path) -> dict:
        raise AssertionError(f"{path} was read again: the index should have it")

    monkeypatch.setattr(library, "_read", unread)
    assert {m.path.name for m in library.scan([shelf], CATALOG, index_path=index)} == set(by_name)
    library.delete(split)
    assert not (shelf / "split").exists()  # both parts, and the folder they leave empty


def _controller(shelf: Path, served: list[str]) -> LibraryController:
    return LibraryController(
        lambda: served[0],
        probe_fn=lambda: ProbeResult(kind="no_nvml", message="no driver"),
        catalog=CATALOG,
        folders=lambda: [shelf],
        ram_bytes=lambda: 24 << 30,
    )


def test_the_models_page_lists_fits_serves_and_deletes(qtbot: QtBot, shelf: Path) -> None:
    served = [str(shelf / "mine" / "tiny.gguf")]
    lib = _controller(shelf, served)
    page = LibraryPage(lib, ask=False)
    qtbot.addWidget(page)
    with qtbot.waitSignal(lib.changed, timeout=10000):
        lib.refresh()
    rows = {page.table.item(r, 0).text(): r for r in range(page.table.rowCount())}
    assert "Qwen3 30B-A3B Instruct 2507 Q4_K_M" in "".join(rows)
    known_row = next(r for name, r in rows.items() if name.startswith("Qwen3 30B"))
    assert page.table.item(known_row, 4).text() == "does not fit: RAM"  # CPU only, 24 GiB: the honest label
    tiny_row = next(r for name, r in rows.items() if "(serving)" in name)
    assert page.table.item(tiny_row, 4).text() == "fit checked when it loads"
    page.table.selectRow(tiny_row)
    page.delete_button.click()
    assert "being served" in page.status.text() and (shelf / "mine" / "tiny.gguf").exists()
    page.table.selectRow(known_row)
    with qtbot.waitSignal(lib.serveRequested, timeout=2000) as asked:
        page.serve_button.click()
    assert asked.args[0].endswith(KNOWN.main_file.name.rsplit("/", 1)[-1])
    served[0] = asked.args[0]
    page.table.selectRow(tiny_row)
    page.delete_button.click()
    assert not (shelf / "mine" / "tiny.gguf").exists() and page.table.rowCount() == 2


def test_the_app_serves_a_model_from_the_library_picker_and_tray(
    qtbot: QtBot, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    app = request.getfixturevalue("make_app")(autostart=False)
    model = tmp_path / "data" / "models" / "x" / "tiny.gguf"
    model.parent.mkdir(parents=True)
    write_tiny_model(model, "qwen3moe", seed=1, qtype="Q4_K")
    app.library._folders = lambda: [model.parent.parent]
    with qtbot.waitSignal(app.library.changed, timeout=10000):
        app.library.refresh()
    chat = app.open_chat()
    assert chat.model_picker.count() == 1 and chat.model_picker.itemData(0) == str(model.resolve())
    assert app.tray is not None and [a.text() for a in app.tray.model_menu.actions()] == [
        app.library.models[0].name
    ]
    app.tray.model_menu.actions()[0].trigger()
    assert app.settings.model == str(model.resolve()) and app.saved[-1].model == str(model.resolve())
    assert app.engine.running  # started on it
    assert app.tray.model_menu.actions()[0].isChecked()

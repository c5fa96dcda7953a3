"""The worker PCs' plan on the Worker PCs tab, without any agent: which cards can be ticked, one per PC, the split
picture, and what is refused with its reason (the flow with a real agent: test_e2e_worker_pc.py)."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
from PySide6.QtWidgets import QLabel, QPushButton
from pytestqt.qtbot import QtBot

from app.clients.node_client import AgentInfo, NodeClient
from app.controllers.nodes import NodesController
from app.controllers.worker_plan import WorkerPlanController
from app.ui.workers_page import WorkersPage
from installer.gpus import GpuInfo, ProbeResult

GIB = 1024**3


def _gpu(i: int, name: str, gib: int) -> GpuInfo:
    return GpuInfo(i, f"GPU-{i}", name, gib * GIB, gib * GIB, (8, 6), "580.0")


def _card(i: int, name: str, gib: int) -> dict:
    return {
        "index": i,
        "name": name,
        "vram_total": gib * GIB,
        "vram_free": gib * GIB,
        "compute_capability": [7, 5],
    }


def _page(qtbot: QtBot, model: str) -> tuple[NodesController, WorkerPlanController, WorkersPage]:
    client = NodeClient(["false"])
    old = GpuInfo(
        2, "GPU-2", "NVIDIA GeForce GTX 1080 Ti", 11 * GIB, 11 * GIB, (6, 1), "580.0"
    )  # not offered
    local = (_gpu(0, "NVIDIA GeForce RTX 3080", 10), _gpu(1, "NVIDIA GeForce RTX 3060", 12), old)
    nodes = NodesController(client, probe_fn=lambda: ProbeResult("ok", local))
    nodes.gpus = local
    nodes.agents = [
        AgentInfo("pc2", "10.0.0.2:7460", "FP2", paired=True, host="10.0.0.2", port=7460,
                  cards=(_card(0, "NVIDIA GeForce RTX 2080 Ti", 11), _card(1, "NVIDIA GeForce RTX 2070", 8))),
        AgentInfo("pc3", "10.0.0.3:7460", "FP3", paired=True, included=False, host="10.0.0.3", port=7460,
                  cards=(_card(0, "NVIDIA GeForce RTX 4090", 24),)),
        AgentInfo("pc4", "10.0.0.4:7460", "FP4", paired=False, host="10.0.0.4", port=7460),
    ]  # fmt: skip
    plan = WorkerPlanController(nodes, client, lambda: model, lambda: "")
    page = WorkersPage(nodes, plan)
    qtbot.addWidget(page)
    return nodes, plan, page


def test_cards_of_included_paired_pcs_are_offered_one_per_pc(qtbot: QtBot, tmp_path: Path) -> None:
    from engine.testing.tiny_models import write_tiny_model

    model = write_tiny_model(tmp_path / "m.gguf", "qwen3moe", qtype="Q8_0", n_layer=8, seed=2)
    _, plan, page = _page(qtbot, str(model))
    labels = [c.card.label for c in plan.choices()]
    assert labels == ["this PC GPU 0 · RTX 3080", "this PC GPU 1 · RTX 3060", "pc2 GPU 0 · RTX 2080 Ti",
                      "pc2 GPU 1 · RTX 2070"]  # fmt: skip
    assert [c.chosen for c in plan.choices()] == [True, False, False, False]  # this PC's first card
    assert plan.plan is None and not page.apply_button.isEnabled()

    page.plan_cards.item(2).setCheckState(page.plan_cards.item(2).checkState().Checked)
    assert plan.plan is not None and [s.card.pc for s in plan.plan.stages] == ["this PC", "pc2"]
    assert page.apply_button.isEnabled() and len(page.plan_picture.segments) == 2
    # another card of pc2 moves its tick; another card of this PC moves this PC's
    page.plan_cards.item(3).setCheckState(page.plan_cards.item(3).checkState().Checked)
    page.plan_cards.item(1).setCheckState(page.plan_cards.item(1).checkState().Checked)
    assert [c.chosen for c in plan.choices()] == [False, True, False, True]
    assert plan.plan.stages[0].card.gpu.index == 1 and plan.plan.stages[1].card.label.endswith("RTX 2070")
    assert (
        "layers 0-" in page.plan_lines.text() and not page.unuse_button.isEnabled()
    )  # no workers in use yet


def test_the_built_in_model_cannot_be_spread_and_says_why(qtbot: QtBot) -> None:
    _, plan, page = _page(qtbot, "")
    page.plan_cards.item(2).setCheckState(page.plan_cards.item(2).checkState().Checked)
    assert plan.plan is None and "choose a model file first" in plan.problem
    assert (
        page.plan_problem.text().startswith("Choose a model file first") and not page.apply_button.isEnabled()
    )


def test_a_windows_worker_pc_is_flagged_with_a_lock_button_that_says_what_happened(
    qtbot: QtBot, tmp_path: Path
) -> None:
    from engine.testing.tiny_models import write_tiny_model

    model = write_tiny_model(tmp_path / "m.gguf", "qwen3moe", qtype="Q8_0", n_layer=8, seed=2)
    nodes, plan, page = _page(qtbot, str(model))
    nodes.agents[0] = dataclasses.replace(nodes.agents[0], os="Windows")
    assert plan.windows_cards() == []  # not ticked yet: nothing to flag
    page.plan_cards.item(2).setCheckState(page.plan_cards.item(2).checkState().Checked)
    (win,) = plan.windows_cards()
    assert win.card.pc == "pc2"
    flag = _labels(page)
    assert any("pc2 GPU 0" in t and "runs Windows" in t for t in flag), flag
    (button,) = [
        b for b in page.findChildren(QPushButton) if b.text() == "Lock clocks" and b.isVisibleTo(page)
    ]
    button.click()  # this client's command is `false`: the lock fails, and the note says so
    qtbot.waitUntil(lambda: plan.clock_notes.get(win.key, "").startswith("NOT locked"), timeout=10_000)
    qtbot.waitUntil(lambda: any("NOT locked" in t for t in _labels(page)), timeout=5_000)


def _labels(page: WorkersPage) -> list[str]:
    return [w.text() for w in page.findChildren(QLabel) if w.isVisibleTo(page)]


def test_tuning_from_the_window_fails_with_the_tuners_own_reason(
    qtbot: QtBot, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Apply with the tuner against a worker PC that is not paired in this data folder: the real `strata-node tune`
    refuses, the window shows why, and nothing is left running."""
    from engine.testing.tiny_models import write_tiny_model

    monkeypatch.setenv("STRATA_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("STRATA_CONFIG_DIR", str(tmp_path / "config"))
    model = write_tiny_model(tmp_path / "m.gguf", "qwen3moe", qtype="Q8_0", n_layer=8, seed=2)
    _, plan, page = _page(qtbot, str(model))
    plan.client = NodeClient([sys.executable, "-m", "engine.node.cli"])
    page.plan_cards.item(2).setCheckState(page.plan_cards.item(2).checkState().Checked)
    page.tune_check.setChecked(True)
    assert plan.tune
    page.apply_button.click()
    assert plan.busy.startswith("Measuring") and page.plan_progress.isVisibleTo(page)
    qtbot.waitUntil(lambda: not plan.busy, timeout=60_000)
    assert plan.problem.startswith("tuning failed") and "FP2" in plan.problem, plan.problem
    assert page.plan_problem.text().startswith("Tuning failed") and page.apply_button.isEnabled()
    assert not page.report_button.isVisible()

"""The main window's Worker PCs tab: this PC's cards, "add this PC as worker", and the worker PCs (paired ones with
their health, agents found on the LAN, pairing by address + code + fingerprint, include / exclude)."""

import html
from pathlib import Path

from PySide6.QtCore import Qt
from PySide6.QtGui import QFontDatabase
from PySide6.QtWidgets import (
    QCheckBox,
    QDialog,
    QDialogButtonBox,
    QGroupBox,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QListWidget,
    QListWidgetItem,
    QPlainTextEdit,
    QProgressBar,
    QPushButton,
    QTextBrowser,
    QVBoxLayout,
    QWidget,
)

from app.clients.node_client import AgentInfo
from app.controllers.nodes import NodesController
from app.controllers.worker_plan import WorkerPlanController
from app.ui.split_picture import Segment, SplitPicture

NO_AGENTS = "No agents found yet."
HOW_AGENTS = (
    "A worker PC shows up here when its node agent (strata-node) runs on it and is found on the LAN, or is added "
    "by address, then paired once by confirming its key fingerprint and a one-time code."
)


def agent_text(a: AgentInfo) -> str:
    state = ("paired" + ("" if a.included else ", excluded")) if a.paired else "found on the LAN, not paired"
    text = f"{a.name} ({a.address}) · {state}"
    if a.fingerprint:
        text += f" · key {a.fingerprint}"
    if a.gpus:
        text += " · " + "; ".join(a.gpus)
    if a.problem:
        text += f" · {a.problem}"
    elif not a.reachable:
        text += " · unreachable"
    return text


class WorkersPage(QWidget):
    def __init__(
        self, nodes: NodesController, plan: WorkerPlanController | None = None, parent: QWidget | None = None
    ) -> None:
        super().__init__(parent)
        self.nodes = nodes
        self.plan = plan
        here = QGroupBox(f"This PC ({nodes.host_name})")
        here_layout = QVBoxLayout(here)
        self.cards = QLabel(nodes.cards_message)
        self.cards.setWordWrap(True)
        self.cards.setTextFormat(Qt.TextFormat.RichText)
        self.cards.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        here_layout.addWidget(self.cards)
        row = QHBoxLayout()
        self.add_button = QPushButton("Add this PC as worker")
        self.add_button.clicked.connect(self._on_add)
        self.stop_button = QPushButton("Stop the agent")
        self.stop_button.clicked.connect(nodes.stop_this_pc)
        row.addWidget(self.add_button)
        row.addWidget(self.stop_button)
        self.autostart = QCheckBox("Start the node agent when I log in")
        self.autostart.setToolTip(
            "Runs `strata-node serve` at log-in, listening on the LAN; it admits only the main PC it is paired with"
        )
        self.autostart.toggled.connect(self._on_autostart)
        row.addWidget(self.autostart)
        row.addStretch(1)
        here_layout.addLayout(row)
        self.autostart_status = QLabel("")
        self.autostart_status.setWordWrap(True)
        self.autostart_status.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        here_layout.addWidget(self.autostart_status)
        self.agent_status = QLabel("Checking what the node agent in this build can do…")
        self.agent_status.setWordWrap(True)
        self.agent_status.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        here_layout.addWidget(self.agent_status)
        self.agent_log = QPlainTextEdit()
        self.agent_log.setReadOnly(True)
        self.agent_log.setMaximumBlockCount(500)
        self.agent_log.setFont(QFontDatabase.systemFont(QFontDatabase.SystemFont.FixedFont))
        self.agent_log.setMaximumHeight(110)
        self.agent_log.hide()
        here_layout.addWidget(self.agent_log)

        others = QGroupBox("Worker PCs")
        others_layout = QVBoxLayout(others)
        self.agent_list = QListWidget()
        self.agent_list.setMaximumHeight(140)
        self.agent_list.currentRowChanged.connect(lambda _r: self._update_buttons())
        self.empty = QLabel(f"<b>{NO_AGENTS}</b><br>{HOW_AGENTS}")
        self.empty.setWordWrap(True)
        self.empty.setAlignment(Qt.AlignmentFlag.AlignTop | Qt.AlignmentFlag.AlignLeft)
        self.refresh_button = QPushButton("Look again")
        self.refresh_button.clicked.connect(nodes.refresh)
        self.include_button = QPushButton("Include")
        self.exclude_button = QPushButton("Exclude")
        self.include_button.clicked.connect(lambda: self._include(True))
        self.exclude_button.clicked.connect(lambda: self._include(False))
        self.address = QLineEdit()
        self.address.setPlaceholderText("address, e.g. 192.168.1.20 or 192.168.1.20:7460")
        self.code = QLineEdit()
        self.code.setPlaceholderText("pairing code")
        self.fingerprint = QLineEdit()
        self.fingerprint.setPlaceholderText("key fingerprint")
        self.pair_button = QPushButton("Pair")
        self.pair_button.clicked.connect(self._on_pair)
        pair_row = QHBoxLayout()
        pair_row.addWidget(QLabel("Add a PC:"))
        pair_row.addWidget(self.address, 2)
        pair_row.addWidget(self.code, 1)
        pair_row.addWidget(self.fingerprint, 1)
        pair_row.addWidget(self.pair_button)
        self.problem = QLabel()
        self.problem.setWordWrap(True)
        self.problem.setStyleSheet("color: #b00020;")
        others_layout.addWidget(self.empty)
        others_layout.addWidget(self.agent_list, 1)
        buttons = QHBoxLayout()
        buttons.addWidget(self.refresh_button)
        buttons.addWidget(self.include_button)
        buttons.addWidget(self.exclude_button)
        buttons.addStretch(1)
        others_layout.addLayout(buttons)
        others_layout.addLayout(pair_row)
        others_layout.addWidget(self.problem)

        layout = QVBoxLayout(self)
        layout.addWidget(here)
        layout.addWidget(others)
        if plan is not None:
            layout.addWidget(self._plan_box(plan))
        layout.addStretch(1)
        nodes.changed.connect(self.refresh)
        nodes.agentOutput.connect(self._on_output)
        self.refresh()

    def _plan_box(self, plan: WorkerPlanController) -> QGroupBox:
        box = QGroupBox("Run the model across PCs")
        lay = QVBoxLayout(box)
        self.plan_model = QLabel()
        self.plan_model.setWordWrap(True)
        lay.addWidget(self.plan_model)
        self.plan_cards = QListWidget()
        self.plan_cards.setMaximumHeight(120)
        self.plan_cards.itemChanged.connect(self._on_card_ticked)
        lay.addWidget(self.plan_cards)
        self.plan_picture = SplitPicture()
        self.plan_picture.empty_text = "Tick a card on a worker PC to see the split."
        lay.addWidget(self.plan_picture)
        self.plan_lines = QLabel()
        self.plan_lines.setWordWrap(True)
        self.plan_lines.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        lay.addWidget(self.plan_lines)
        self.plan_progress = QProgressBar()
        self.plan_progress.setRange(0, 100)
        self.plan_progress.hide()
        lay.addWidget(self.plan_progress)
        self.tune_check = QCheckBox(
            "Measure splits around this one first (the tuner; minutes) and keep the fastest"
        )
        self.tune_check.setToolTip(
            "Apply then runs strata-node tune: it sends the worker PCs the layers every split it tries needs, "
            "measures prompts and answers on each, writes the fastest split into the config and a report"
        )
        self.tune_check.toggled.connect(lambda on: setattr(plan, "tune", on))
        lay.addWidget(self.tune_check)
        self.tune_view = QPlainTextEdit()
        self.tune_view.setReadOnly(True)
        self.tune_view.setFont(QFontDatabase.systemFont(QFontDatabase.SystemFont.FixedFont))
        self.tune_view.setMaximumHeight(120)
        self.tune_view.hide()
        lay.addWidget(self.tune_view)
        self.clock_flags = QVBoxLayout()
        lay.addLayout(self.clock_flags)
        row = QHBoxLayout()
        self.apply_button = QPushButton("Apply")
        self.apply_button.setToolTip(
            "Sends each worker PC the layers it runs (resumable, checked by SHA-256), writes the config and "
            "restarts the engine with the worker PCs"
        )
        self.apply_button.clicked.connect(plan.apply)
        self.cancel_button = QPushButton("Cancel")
        self.cancel_button.clicked.connect(plan.cancel)
        self.unuse_button = QPushButton("Stop using worker PCs")
        self.unuse_button.setToolTip("Runs the model on this PC alone again (the config without its workers)")
        self.unuse_button.clicked.connect(plan.stop_using)
        self.report_button = QPushButton("Tuning report")
        self.report_button.setToolTip("The last tuning run's measurements and the split it chose")
        self.report_button.clicked.connect(self.show_report)
        self.report_button.hide()
        row.addWidget(self.apply_button)
        row.addWidget(self.cancel_button)
        row.addWidget(self.unuse_button)
        row.addWidget(self.report_button)
        row.addStretch(1)
        lay.addLayout(row)
        self.plan_problem = QLabel()
        self.plan_problem.setWordWrap(True)
        self.plan_problem.setStyleSheet("color: #b00020;")
        lay.addWidget(self.plan_problem)
        plan.changed.connect(self._refresh_plan)
        plan.tuned.connect(lambda _path: self.show_report())
        self._refresh_plan()
        return box

    def _on_card_ticked(self, item: QListWidgetItem) -> None:
        if self.plan is None or self._filling:
            return
        choices = self.plan.choices()
        row = self.plan_cards.row(item)
        if 0 <= row < len(choices):
            self.plan.set_chosen(choices[row], item.checkState() == Qt.CheckState.Checked)

    _filling = False
    _flags_shown: tuple = ((), ())

    def _refresh_plan(self) -> None:
        plan = self.plan
        if plan is None:
            return
        model = plan.model_path()
        self.plan_model.setText(
            f"Model: <b>{html.escape(Path(model).name) if model else 'the built-in one'}</b>"
            " · tick this PC's card and one card on each worker PC that should run the later layers."
        )
        self._filling = True
        self.plan_cards.clear()
        choices = plan.choices()
        for c in choices:
            free = c.card.gpu.vram_free / 2**30
            item = QListWidgetItem(f"{c.card.label} · {free:.1f} GiB free")
            item.setFlags(item.flags() | Qt.ItemFlag.ItemIsUserCheckable)
            item.setCheckState(Qt.CheckState.Checked if c.chosen else Qt.CheckState.Unchecked)
            self.plan_cards.addItem(item)
        self._filling = False
        if not choices:
            self.plan_lines.setText("No NVIDIA card on this PC: worker PCs extend a card of this PC.")
        p = plan.plan
        if p is not None:
            segs = [
                Segment(s.begin, s.end, s.card.label, f"{s.fit.experts_in_vram} of {s.fit.experts_total} experts"
                        if s.fit.experts_total else "", head=i == len(p.stages) - 1)
                for i, s in enumerate(p.stages)
            ]  # fmt: skip
            self.plan_picture.set_split(p.layers, segs)
            self.plan_lines.setText("<br>".join(html.escape(x) for x in p.lines()))
        else:
            self.plan_picture.set_split(0, [])
            if choices:
                self.plan_lines.setText("")
        busy = bool(plan.busy)
        self.plan_progress.setVisible(busy)
        self.plan_progress.setValue(max(plan.percent, 0))
        self.plan_progress.setFormat(f"{plan.busy} %p%")
        self.apply_button.setEnabled(p is not None and p.fits and not busy)
        self.cancel_button.setVisible(busy)
        self.unuse_button.setEnabled(plan.using_workers() and not busy)
        text = plan.problem
        self.plan_problem.setText(text[:1].upper() + text[1:] if text else "")
        self.tune_check.setEnabled(not busy)
        text = "\n".join(plan.tune_log)
        if text != self.tune_view.toPlainText():
            self.tune_view.setPlainText(text)
            self.tune_view.verticalScrollBar().setValue(self.tune_view.verticalScrollBar().maximum())
        self.tune_view.setVisible(bool(plan.tune_log))
        self.report_button.setVisible(bool(plan.report))
        self._refresh_clock_flags()

    def _refresh_clock_flags(self) -> None:
        """A line and a Lock button per ticked card on a Windows worker PC (and the tuner's warnings)."""
        plan = self.plan
        assert plan is not None
        flagged = plan.windows_cards()
        shown = (
            tuple((c.key, c.card.label, plan.clock_notes.get(c.key, "")) for c in flagged),
            tuple(plan.warnings),
        )
        if shown == self._flags_shown:  # `changed` comes with every progress line: rebuild only what changed
            return
        self._flags_shown = shown
        while self.clock_flags.count():
            item = self.clock_flags.takeAt(0)
            w = item.widget() if item is not None else None
            if w is None and item is not None and item.layout() is not None:
                lay = item.layout()
                while lay.count():
                    sub = lay.takeAt(0).widget()
                    if sub is not None:
                        sub.deleteLater()
                lay.deleteLater()
            elif w is not None:
                w.deleteLater()
        for c in flagged:
            note = plan.clock_notes.get(c.key, "")
            row = QHBoxLayout()
            label = QLabel(
                f"⚠ {html.escape(c.card.label)} runs Windows, which lowers an idle GPU's clocks between decode steps: "
                "lock them for steady speed." + (f" <i>{html.escape(note)}</i>" if note else "")
            )
            label.setWordWrap(True)
            row.addWidget(label, 1)
            if not note.startswith("locked"):
                button = QPushButton("Lock clocks")
                button.setToolTip(
                    "strata-node clocks NODE --lock: the agent there needs administrator rights"
                )
                button.clicked.connect(lambda _=False, c=c: plan.lock_clocks(c))
                row.addWidget(button)
            self.clock_flags.addLayout(row)
        for w in plan.warnings:
            label = QLabel(html.escape(w))
            label.setWordWrap(True)
            label.setStyleSheet("color: #8a5a00;")
            self.clock_flags.addWidget(label)

    def show_report(self) -> QDialog | None:
        """The last tuning report in a dialog (Markdown as text), or None when there is none to read."""
        if self.plan is None or not self.plan.report:
            return None
        try:
            text = Path(self.plan.report).read_text(encoding="utf-8")
        except OSError as e:
            self.plan_problem.setText(f"The tuning report {self.plan.report} cannot be read ({e})")
            return None
        dialog = QDialog(self)
        dialog.setWindowTitle("Tuning report")
        dialog.resize(820, 520)
        lay = QVBoxLayout(dialog)
        view = QTextBrowser()
        view.setMarkdown(text)
        lay.addWidget(view)
        where = QLabel(f"Saved as {html.escape(self.plan.report)}")
        where.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        lay.addWidget(where)
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Close)
        buttons.rejected.connect(dialog.reject)
        lay.addWidget(buttons)
        dialog.setModal(False)
        dialog.show()
        self.report_dialog = dialog
        return dialog

    def _on_autostart(self, on: bool) -> None:
        if on != self.nodes.autostart_on:
            self.nodes.set_autostart(on)

    def _on_add(self) -> None:
        self.nodes.add_this_pc()

    def _on_output(self, line: str) -> None:
        self.agent_log.show()
        self.agent_log.appendPlainText(line)

    def _on_pair(self) -> None:
        problem = self.nodes.pair(self.address.text(), self.code.text(), self.fingerprint.text())
        self.problem.setText(problem[:1].upper() + problem[1:] + "." if problem else "Pairing…")

    def _selected(self) -> AgentInfo | None:
        row = self.agent_list.currentRow()
        return self.nodes.agents[row] if 0 <= row < len(self.nodes.agents) else None

    def _include(self, included: bool) -> None:
        agent = self._selected()
        if agent is not None and agent.paired:
            self.nodes.set_included(agent, included)

    def _update_buttons(self) -> None:
        agent = self._selected()
        paired = agent is not None and agent.paired
        self.include_button.setEnabled(paired and not agent.included)  # type: ignore[union-attr]
        self.exclude_button.setEnabled(paired and agent.included)  # type: ignore[union-attr]

    def refresh(self) -> None:
        n = self.nodes
        if n.cards:
            rows = []
            for c in n.cards:
                mark = "✔" if c.usable else "✖"
                color = "#2a7a3a" if c.usable else "#a33"
                rows.append(f"<span style='color:{color}'>{mark}</span> {html.escape(c.text)}")
            text = "<br>".join(rows)
            if n.cards_message:
                text += f"<br><i>{html.escape(n.cards_message)}</i>"
            self.cards.setText(text)
        else:
            self.cards.setText(html.escape(n.cards_message))
        supported = n.serve_supported
        running = n.local_state in ("starting", "running")
        self.add_button.setEnabled(bool(supported) and not running)
        self.stop_button.setVisible(running)
        info = n.local_info
        if supported is None:
            self.agent_status.setText("Checking what the node agent in this build can do…")
        elif not supported:
            self.agent_status.setText(f"Not available: {n.serve_detail}.")
        elif running and info.get("fingerprint"):
            host = info.get("host")
            where = "every address of this PC" if host in ("0.0.0.0", "::") else host
            self.agent_status.setText(
                f"The node agent runs here: port {info.get('port')} on {where}. On the main PC, add this PC with "
                f"pairing code <b>{html.escape(str(info.get('pairing_code') or '–'))}</b> and key fingerprint "
                f"<b>{html.escape(str(info.get('fingerprint')))}</b>."
            )
        elif running:
            self.agent_status.setText("The node agent is starting…")
        elif n.local_state == "failed":
            self.agent_status.setText("The node agent ended with an error: see its output below.")
        else:
            self.agent_status.setText("Starts the node agent here so that a main PC can pair with this PC.")
        self.autostart.blockSignals(True)
        self.autostart.setChecked(n.autostart_on)
        self.autostart.blockSignals(False)
        self.autostart.setEnabled(n.autostart is not None and bool(supported))
        if n.autostart_problem:
            self.autostart_status.setStyleSheet("color: #b00020;")
            self.autostart_status.setText(n.autostart_problem[:1].upper() + n.autostart_problem[1:] + ".")
        else:
            self.autostart_status.setStyleSheet("color: #555;")
            text = n.autostart_text()
            self.autostart_status.setText(text[:1].upper() + text[1:] + "." if text else "")
        self.autostart_status.setVisible(bool(self.autostart_status.text()))
        current = self.agent_list.currentRow()
        self.agent_list.clear()
        for a in n.agents:
            item = QListWidgetItem(agent_text(a))
            if a.problem or not a.reachable:
                item.setForeground(Qt.GlobalColor.darkRed)
            self.agent_list.addItem(item)
        if 0 <= current < self.agent_list.count():
            self.agent_list.setCurrentRow(current)
        self.agent_list.setVisible(bool(n.agents))
        self.empty.setVisible(not n.agents)
        if n.refreshing and not n.agents:
            self.empty.setText(f"<b>Looking for worker PCs…</b><br>{HOW_AGENTS}")
        else:
            self.empty.setText(f"<b>{NO_AGENTS}</b><br>{HOW_AGENTS}")
        if n.problem:
            self.problem.setText(n.problem[:1].upper() + n.problem[1:])
        elif self.problem.text() == "Pairing…" and not n.refreshing:
            self.problem.clear()
        self._update_buttons()

"""The main window's Engine tab: what runs (model, device, split plan per card and PC, experts in VRAM) and the log."""

from PySide6.QtCore import Qt
from PySide6.QtGui import QFont, QFontDatabase
from PySide6.QtWidgets import (
    QFormLayout,
    QGroupBox,
    QHeaderView,
    QLabel,
    QPlainTextEdit,
    QSplitter,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from app.controllers.engine import EngineController
from app.controllers.stats import (
    StageView,
    experts_held,
    last_timings,
    queue_text,
    runs_on,
    slots_text,
    stage_views,
)
from app.ui.split_picture import Segment, SplitPicture

SPLIT_COLUMNS = ("Stage", "PC", "Device", "Layers", "Experts in VRAM", "Cache hits", "Step")


def stage_row(v: StageView) -> list[str]:
    span = f"{v.begin}–{v.end - 1}" if v.begin is not None and v.end is not None else "–"
    if v.experts_total:
        experts = f"{v.experts_in_vram} of {v.experts_total}"
    else:
        experts = "dense" if v.experts_total == 0 else "–"
    rate = v.hit_rate
    hits = f"{100.0 * rate:.1f}%" if rate is not None else "–"
    if v.cpu_share is not None:  # the rest of the misses: the CPU computes this share, PCIe copies the others
        hits += f" · CPU {100.0 * v.cpu_share:.0f}% of misses"
    return [
        str(v.index),
        v.host or "this PC",
        v.device,
        span,
        experts,
        hits,
        f"{v.step_ms:.1f} ms" if v.step_ms is not None else "–",
    ]


def split_segments(views: list[StageView]) -> tuple[int, list[Segment]]:
    """The model's layer count and one picture segment per stage."""
    segs = []
    for i, v in enumerate(views):
        if v.begin is None or v.end is None or v.end <= v.begin:
            continue
        detail = f"experts in VRAM {v.experts_in_vram} of {v.experts_total}" if v.experts_total else ""
        segs.append(
            Segment(v.begin, v.end, f"{v.host or 'this PC'} · {v.device}", detail, head=i == len(views) - 1)
        )
    return (max((s.end for s in segs), default=0), segs)


class EnginePage(QWidget):
    def __init__(self, engine: EngineController, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.engine = engine
        info = QGroupBox("Engine")
        form = QFormLayout(info)
        self.model_label = QLabel("–")
        self.model_label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.device_label = QLabel("–")
        self.queue_label = QLabel("–")
        self.slots_label = QLabel("–")
        self.slots_label.setToolTip(
            "Requests decoded together in shared steps (strata-engine serve --parallel N); each slot has its own KV cache"
        )
        self.totals_label = QLabel("–")
        form.addRow("Model:", self.model_label)
        form.addRow("Runs on:", self.device_label)
        form.addRow("Requests:", self.queue_label)
        form.addRow("Slots:", self.slots_label)
        form.addRow("Last answer:", self.totals_label)

        split = QGroupBox("Split plan: which layers run where")
        split_layout = QVBoxLayout(split)
        self.table = QTableWidget(0, len(SPLIT_COLUMNS))
        self.table.setHorizontalHeaderLabels(SPLIT_COLUMNS)
        self.table.verticalHeader().setVisible(False)
        self.table.setEditTriggers(QTableWidget.EditTrigger.NoEditTriggers)
        self.table.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeMode.Stretch)
        self._fit_table()
        self.picture = SplitPicture()
        self.picture.empty_text = "The split plan appears when the engine is ready."
        self.split_note = QLabel("The split plan appears when the engine is ready.")
        self.split_note.setWordWrap(True)
        split_layout.addWidget(self.picture)
        split_layout.addWidget(self.table)
        split_layout.addWidget(self.split_note)

        log_box = QGroupBox("Engine log")
        log_layout = QVBoxLayout(log_box)
        self.log = QPlainTextEdit()
        self.log.setReadOnly(True)
        self.log.setMaximumBlockCount(2000)
        font = QFontDatabase.systemFont(QFontDatabase.SystemFont.FixedFont)
        font.setStyleHint(QFont.StyleHint.Monospace)
        self.log.setFont(font)
        self.log.setLineWrapMode(QPlainTextEdit.LineWrapMode.NoWrap)
        log_layout.addWidget(self.log)

        top = QWidget()
        top_layout = QVBoxLayout(top)
        top_layout.setContentsMargins(0, 0, 0, 0)
        top_layout.addWidget(info)
        top_layout.addWidget(split)
        splitter = QSplitter(Qt.Orientation.Vertical)
        splitter.addWidget(top)
        splitter.addWidget(log_box)
        splitter.setStretchFactor(1, 1)
        layout = QVBoxLayout(self)
        layout.addWidget(splitter)

        for line in engine.log_tail(2000):
            self.log.appendPlainText(line)
        engine.logLine.connect(self.log.appendPlainText)
        engine.statsChanged.connect(self.show_stats)
        engine.healthChanged.connect(lambda _h: self.refresh())
        engine.stateChanged.connect(self._on_state)
        self.refresh()

    def _on_state(self, state: str) -> None:
        if state in ("starting", "stopped", "crashed"):  # a new process or none: the old numbers are gone
            for label in (self.device_label, self.queue_label, self.slots_label, self.totals_label):
                label.setText("–")
        self.refresh()

    def refresh(self) -> None:
        e = self.engine
        self.model_label.setText(e.model_name)
        if e.state != "ready":
            self.table.setRowCount(0)
            self._fit_table()
            self.picture.set_split(0, [])
            self.split_note.setText("The split plan appears when the engine is ready.")

    def _fit_table(self) -> None:
        """As tall as its rows (at least one), so the log below gets the room."""
        rows = max(self.table.rowCount(), 1)
        height = (
            self.table.horizontalHeader().sizeHint().height()
            + rows * self.table.verticalHeader().defaultSectionSize()
        )
        self.table.setFixedHeight(height + 2 * self.table.frameWidth())

    def show_stats(self, stats: dict) -> None:
        self.device_label.setText(runs_on(stats))
        self.queue_label.setText(queue_text(stats))
        self.slots_label.setText(slots_text(stats))
        last = last_timings(stats)
        if last and last.get("predicted_per_second") is not None:
            self.totals_label.setText(
                f"prompt {last.get('prompt_n', '?')} tokens at {last.get('prompt_per_second') or 0:.0f} tok/s, "
                f"{last.get('predicted_n', '?')} generated at {last.get('predicted_per_second') or 0:.1f} tok/s"
            )
        views = stage_views(stats)
        self.table.setRowCount(len(views))
        for r, view in enumerate(views):
            for c, text in enumerate(stage_row(view)):
                item = QTableWidgetItem(text)
                item.setTextAlignment(Qt.AlignmentFlag.AlignCenter)
                self.table.setItem(r, c, item)
        self._fit_table()
        self.picture.set_split(*split_segments(views))
        held = experts_held(stats)
        if not views:
            self.split_note.setText("The engine reports no stages.")
        elif held:
            self.split_note.setText(
                f"{len(views)} stage(s); routed experts in VRAM: {held[0]} of {held[1]}; "
                "the rest are computed from host RAM."
            )
        else:
            self.split_note.setText(f"{len(views)} stage(s).")

"""The main window's Charts tab (pyqtgraph): per stage, each decode step's and prompt chunk's time stacked as
compute, waiting and transfer; tokens/s; per GPU (this PC's and the worker PCs') its clock state, with a flag and a
"Lock clocks" button for a card that drops its clocks between steps."""

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt, QTimer, Signal
from PySide6.QtWidgets import (
    QGridLayout,
    QGroupBox,
    QHBoxLayout,
    QLabel,
    QPushButton,
    QScrollArea,
    QVBoxLayout,
    QWidget,
)

from app.controllers.charts import WINDOW_S, ChartsController, ClockFlag, StagePoint, stacked
from app.controllers.gpu_sampler import GpuSample

REFRESH_MS = 250
GIB = 1024**3
CHUNK_BARS = 32
"""Prompt chunks shown per stage (the newest)."""
# compute, waiting, transfer
PART_COLORS = ("#1f77b4", "#ffbb78", "#9467bd")
PART_NAMES = ("compute", "waiting", "transfer")


def _plot(title: str, y_label: str, height: int = 200, x_label: str = "seconds ago") -> pg.PlotWidget:
    w = pg.PlotWidget(background="w")
    w.setTitle(title, color="#333", size="10pt")
    w.setLabel("left", y_label)
    w.setLabel("bottom", x_label)
    w.showGrid(x=True, y=True, alpha=0.25)
    if x_label == "seconds ago":
        w.setXRange(-WINDOW_S, 0, padding=0)
    w.setMouseEnabled(x=False, y=False)
    w.setMenuEnabled(False)
    w.hideButtons()
    w.setFixedHeight(height)
    legend = w.addLegend(
        offset=(8, 4), labelTextSize="8pt", labelTextColor="#333", brush=(255, 255, 255, 200)
    )
    legend.setColumnCount(3)
    for axis in ("left", "bottom"):
        w.getAxis(axis).setTextPen("#444")
        w.getAxis(axis).setPen("#888")
    return w


def _headroom(plot: pg.PlotWidget, top: float) -> None:
    """Room above the highest value for the legend, which sits at the top left."""
    plot.setYRange(0.0, top * 1.7 if top > 0 else 1.0, padding=0)


def split_text(p: StagePoint | None) -> str:
    if p is None:
        return "no decode steps in the last 5 s"
    return (
        f"per step (median of the last 5 s): compute {p.compute:.2f} ms · waiting {p.wait:.2f} ms · "
        f"transfer {p.transfer:.2f} ms"
    )


class StageRow(QGroupBox):
    """One stage: its decode steps as a stacked area over time, its last prompt chunks as stacked bars."""

    def __init__(self, stage: int) -> None:
        super().__init__(f"Stage {stage}")
        self.stage = stage
        self.text = QLabel("–")
        self.steps = _plot("Decode step time", "ms", 180)
        # Painted back to front: the total (its top band is transfer), then compute + waiting, then compute.
        self.areas = [
            self.steps.plot(pen=pg.mkPen(color, width=1), fillLevel=0.0, brush=color, name=name)
            for color, name in reversed(list(zip(PART_COLORS, PART_NAMES, strict=True)))
        ]
        self.chunks = _plot(
            f"Prompt chunk time (last {CHUNK_BARS})", "ms", 180, x_label="prompt chunks, newest right"
        )
        self.bars = [
            pg.BarGraphItem(x=[], height=[], y0=[], width=0.8, brush=color, pen=pg.mkPen(color), name=name)
            for color, name in zip(PART_COLORS, PART_NAMES, strict=True)
        ]
        for b in self.bars:
            self.chunks.addItem(b)
        grid = QGridLayout(self)
        grid.addWidget(self.text, 0, 0, 1, 2)
        grid.addWidget(self.steps, 1, 0)
        grid.addWidget(self.chunks, 1, 1)

    def update_from(self, c: ChartsController, now: float) -> None:
        label = c.stage_labels.get(self.stage)
        self.setTitle(f"Stage {self.stage}" + (f" · {label}" if label else ""))
        cut = now - WINDOW_S
        steps = [p for p in c.steps.get(self.stage, ()) if p.t >= cut]
        x, comp, cw, total = stacked(steps, now)
        for item, y in zip(self.areas, (total, cw, comp), strict=True):
            item.setData(x, y)
        _headroom(self.steps, max(total, default=0.0))
        chunks = list(c.chunks.get(self.stage, ()))[-CHUNK_BARS:]
        xs = np.arange(1, len(chunks) + 1, dtype=float)
        comp_c = np.array([p.compute for p in chunks], float)
        wait_c = np.array([p.wait for p in chunks], float)
        tran_c = np.array([p.transfer for p in chunks], float)
        for bar, height, y0 in zip(
            self.bars, (comp_c, wait_c, tran_c), (np.zeros(len(chunks)), comp_c, comp_c + wait_c), strict=True
        ):
            bar.setOpts(x=xs, height=height, y0=y0, width=0.8)
        self.chunks.setXRange(0.4, CHUNK_BARS + 0.6, padding=0)
        _headroom(self.chunks, float((comp_c + wait_c + tran_c).max(initial=0.0)))
        self.text.setText(split_text(c.recent_split(self.stage)))


class GpuRow(QGroupBox):
    """One card: a text line with its state, clocks over time, utilisation and VRAM over time, a flag when raised."""

    def __init__(self, label: str) -> None:
        super().__init__(label)
        self.state = QLabel("–")
        self.flag = QLabel("")
        self.flag.setWordWrap(True)
        self.flag.setStyleSheet("color: #b00020; font-weight: bold;")
        self.flag.hide()
        self.lock_button = QPushButton("Lock clocks")
        self.lock_button.setToolTip(
            "Ask this card's PC to hold its clocks (through its node agent; this PC's through NVML); it needs "
            "administrator / root rights there"
        )
        self.lock_button.hide()
        self.locked = False
        """Locked through this button (then it offers to reset them)."""
        self.asking_lock = True
        self.flagged = False
        self.lock_result = QLabel("")
        self.lock_result.setWordWrap(True)
        self.lock_result.hide()
        flag_row = QHBoxLayout()
        flag_row.addWidget(self.flag, 1)
        flag_row.addWidget(self.lock_button)
        self.clocks = _plot("Clocks", "MHz", 160)
        self.sm = self.clocks.plot(pen=pg.mkPen("#1f77b4", width=2), name="SM")
        self.mem = self.clocks.plot(pen=pg.mkPen("#ff7f0e", width=2), name="memory")
        self.load = _plot("Utilisation and VRAM", "%", 160)
        self.load.setYRange(0, 100, padding=0.02)
        self.util = self.load.plot(pen=pg.mkPen("#2ca02c", width=2), name="GPU busy")
        self.vram = self.load.plot(pen=pg.mkPen("#9467bd", width=2), name="VRAM used")
        grid = QGridLayout(self)
        grid.addWidget(self.state, 0, 0, 1, 2)
        grid.addLayout(flag_row, 1, 0, 1, 2)
        grid.addWidget(self.lock_result, 2, 0, 1, 2)
        grid.addWidget(self.clocks, 3, 0)
        grid.addWidget(self.load, 3, 1)

    def update_from(self, samples: list[GpuSample], now: float) -> None:
        if not samples:
            return
        s = samples[-1]
        self.state.setText(
            f"P{s.pstate if s.pstate <= 15 else '?'} · SM {s.sm_mhz} MHz (max {s.max_sm_mhz}) · memory {s.mem_mhz} MHz · "
            f"busy {s.util}% · VRAM {s.vram_used / GIB:.1f} of {s.vram_total / GIB:.1f} GiB · "
            f"clock-event reasons: {s.reason_text}"
        )
        x = np.fromiter((x.t - now for x in samples), float, len(samples))
        self.sm.setData(x, np.fromiter((x.sm_mhz for x in samples), float, len(samples)))
        self.mem.setData(x, np.fromiter((x.mem_mhz for x in samples), float, len(samples)))
        self.util.setData(x, np.fromiter((x.util for x in samples), float, len(samples)))
        vram = np.fromiter((100.0 * x.vram_used / max(x.vram_total, 1) for x in samples), float, len(samples))
        self.vram.setData(x, vram)

    def set_flag(self, flag: ClockFlag | None) -> None:
        self.flag.setVisible(flag is not None)
        self.flag.setText(flag.text if flag else "")
        self.flagged = flag is not None
        self._show_button()

    def _show_button(self) -> None:
        self.lock_button.setText("Reset clocks" if self.locked else "Lock clocks")
        self.lock_button.setVisible(self.flagged or self.locked)

    def set_lock_result(self, ok: bool | None, text: str) -> None:
        """None: asking; True: done as asked (the agent's words); False: refused, with what to do."""
        self.lock_result.setVisible(bool(text))
        color = {None: "#555", True: "#2a7a3a", False: "#b00020"}[ok]
        self.lock_result.setStyleSheet(f"color: {color};")
        self.lock_result.setText(text)
        self.lock_button.setEnabled(ok is not None)
        if ok:
            self.locked = self.asking_lock
        self._show_button()


class ChartsPage(QWidget):
    lockRequested = Signal(object, bool)
    """(the newest GpuSample of the card, lock (True) or reset (False)): its "Lock clocks" / "Reset clocks"."""

    def __init__(self, charts: ChartsController, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.charts = charts
        pg.setConfigOptions(antialias=True)
        self.summary = QLabel("Waiting for the engine's events (start the engine and send a message).")
        self.summary.setWordWrap(True)
        self.speed_plot = _plot("Decode tokens per second", "tok/s")
        self.prompt_plot = _plot("Prompt tokens per second", "tok/s")
        self.decode_live = self.speed_plot.plot(pen=pg.mkPen("#2ca02c", width=1.5), name="live")
        self.decode_curve = self.speed_plot.plot(
            pen=None, symbol="o", symbolSize=7, symbolBrush="#1b5e20", name="per answer"
        )
        self.prompt_live = self.prompt_plot.plot(
            pen=pg.mkPen("#1f77b4", width=1.5), name="live (first stage)"
        )
        self.prompt_curve = self.prompt_plot.plot(
            pen=None, symbol="t", symbolSize=8, symbolBrush="#0d3c73", name="per answer"
        )
        self._live: list[tuple[float, float, float]] = []
        # --parallel: the shared steps' rows, the slots holding a request and the requests waiting for one
        self.slots_plot = _plot("Slots (several requests at once)", "count")
        self.rows_live = self.slots_plot.plot(pen=pg.mkPen("#2ca02c", width=1.5), name="rows a step")
        self.busy_live = self.slots_plot.plot(
            pen=pg.mkPen("#ff7f0e", width=2, style=Qt.PenStyle.DashLine), name="busy slots"
        )
        self.waiting_live = self.slots_plot.plot(pen=pg.mkPen("#d62728", width=1.5), name="waiting")
        self.slots_plot.hide()  # until the server reports slots
        self._slots: list[tuple[float, float, float, float]] = []
        self.stage_rows: dict[int, StageRow] = {}
        self.gpu_note = QLabel("Sampling the GPUs…")
        self.gpu_note.setWordWrap(True)
        self.remote_note = QLabel("")
        self.remote_note.setWordWrap(True)
        self.remote_note.setStyleSheet("color: #8a5a00;")
        self.remote_note.hide()
        self.gpu_rows: dict[str, GpuRow] = {}

        body = QWidget()
        self.body_layout = QVBoxLayout(body)
        engine_box = QGroupBox("Engine")
        eg = QGridLayout(engine_box)
        eg.addWidget(self.summary, 0, 0, 1, 2)
        eg.addWidget(self.speed_plot, 1, 0)
        eg.addWidget(self.prompt_plot, 1, 1)
        eg.addWidget(self.slots_plot, 2, 0, 1, 2)
        self.stages_layout = QVBoxLayout()
        eg.addLayout(self.stages_layout, 3, 0, 1, 2)
        self.body_layout.addWidget(engine_box)
        self.gpu_box = QGroupBox("GPUs of this PC and the worker PCs (sampled every 100 ms)")
        self.gpu_layout = QVBoxLayout(self.gpu_box)
        self.gpu_layout.addWidget(self.gpu_note)
        self.gpu_layout.addWidget(self.remote_note)
        self.body_layout.addWidget(self.gpu_box)
        self.body_layout.addStretch(1)
        self.scroll = scroll = QScrollArea()
        scroll.setWidgetResizable(True)
        scroll.setWidget(body)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(scroll)

        charts.gpuUnavailable.connect(self._on_gpu_unavailable)
        charts.flagsChanged.connect(self._on_flags)
        if charts.gpu_reason:
            self._on_gpu_unavailable(charts.gpu_reason)
        self.timer = QTimer(self)
        self.timer.timeout.connect(self.redraw)
        self.timer.start(REFRESH_MS)

    def redraw(self) -> None:
        if not self.isVisible():
            return
        c = self.charts
        now = c.clock()
        cut = now - WINDOW_S
        for stage in sorted(set(c.steps) | set(c.chunks)):
            row = self.stage_rows.get(stage)
            if row is None:
                row = self.stage_rows[stage] = StageRow(stage)
                self.stages_layout.addWidget(row)
            row.update_from(c, now)
        for stage in [s for s in self.stage_rows if s not in c.steps and s not in c.chunks]:
            self.stage_rows.pop(stage).deleteLater()  # the engine restarted with fewer stages
        if c.events_seen:
            self._live.append((now, c.decode_rate(), c.prompt_rate()))
        self._live = [x for x in self._live if x[0] >= cut]
        self.decode_live.setData([x[0] - now for x in self._live], [x[1] for x in self._live])
        self.prompt_live.setData([x[0] - now for x in self._live], [x[2] for x in self._live])
        self._redraw_slots(now, cut)
        req = [(t - now, p, d) for t, p, d in c.requests if t >= cut]
        self.decode_curve.setData([r[0] for r in req], [r[2] for r in req])
        self.prompt_curve.setData([r[0] for r in req], [r[1] for r in req])
        if c.events_seen:
            parts = [f"decode now: {c.decode_rate():.1f} tok/s", f"prompt now: {c.prompt_rate():.0f} tok/s"]
            if c.requests:
                _, p, d = c.requests[-1]
                parts.append(f"last answer: prompt {p:.0f} tok/s, decode {d:.1f} tok/s")
            if c.batch:
                parts.append(f"{c.rows_per_step():.1f} rows a step")
            if c.slot_rates:
                parts.append("decoding: " + ", ".join(f"slot {i} {r:.1f} tok/s" for i, r in c.slot_rates))
            for stage in sorted(c.steps):
                split = c.recent_split(stage)
                if split is not None:
                    parts.append(f"stage {stage}: {split.ms:.1f} ms per step (median of 5 s)")
            self.summary.setText(" · ".join(parts))
        for key, samples in c.gpus.items():
            row = self.gpu_rows.get(key)
            if row is None:
                row = GpuRow(samples[-1].label)
                row.lock_button.clicked.connect(lambda _=False, key=key: self._lock(key))
                self.gpu_rows[key] = row
                self.gpu_layout.addWidget(row)
                row.set_flag(c.flags.get(key))
                self.gpu_note.hide()
            row.update_from([s for s in samples if s.t >= cut], now)

    def _redraw_slots(self, now: float, cut: float) -> None:
        """The slots chart: every refresh, the mean rows of the last second's steps, the busy slots of the last one
        and the requests waiting at the last /stats poll."""
        c = self.charts
        if not c.batch and not c.slot_rates:
            return
        self.slots_plot.show()
        recent = [b for b in c.batch if b.t > now - 1.0]
        busy = recent[-1].slots if recent else 0
        waiting = c.waiting[-1][1] if c.waiting and c.waiting[-1][0] > now - 2.0 else 0
        self._slots.append((now, c.rows_per_step(1.0), float(busy), float(waiting)))
        self._slots = [x for x in self._slots if x[0] >= cut]
        xs = [x[0] - now for x in self._slots]
        for curve, j in ((self.rows_live, 1), (self.busy_live, 2), (self.waiting_live, 3)):
            curve.setData(xs, [x[j] for x in self._slots])
        _headroom(self.slots_plot, max((max(x[1:]) for x in self._slots), default=0.0))

    def _lock(self, key: str) -> None:
        samples = self.charts.gpus.get(key)
        row = self.gpu_rows.get(key)
        if not samples or row is None:
            return
        row.asking_lock = not row.locked
        row.set_lock_result(None, f"Asking its PC to {'lock' if row.asking_lock else 'reset'} the clocks…")
        self.lockRequested.emit(samples[-1], row.asking_lock)

    def on_lock_done(self, key: str, ok: bool, text: str) -> None:
        row = self.gpu_rows.get(key)
        if row is not None:
            row.set_lock_result(ok, (text[:1].upper() + text[1:]) if text else "")

    def on_remote_problems(self, problems: dict) -> None:
        lines = [f"{name}: {why}" for name, why in sorted(problems.items())]
        self.remote_note.setText("\n".join(lines))
        self.remote_note.setVisible(bool(lines))

    def _on_gpu_unavailable(self, reason: str) -> None:
        self.gpu_note.setText(f"No GPU chart for this PC: {reason}.")
        self.gpu_note.show()

    def _on_flags(self, flags: list) -> None:
        by_key = {f.key: f for f in flags}
        for key, row in self.gpu_rows.items():
            row.set_flag(by_key.get(key))

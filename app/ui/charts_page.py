"""The main window's Charts tab (pyqtgraph): per-stage step and prompt-chunk times, tokens/s, per-GPU clock state."""

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QTimer
from PySide6.QtWidgets import QGridLayout, QGroupBox, QLabel, QScrollArea, QVBoxLayout, QWidget

from app.controllers.charts import WINDOW_S, ChartsController, ClockFlag
from app.controllers.gpu_sampler import GpuSample

STAGE_COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f")
REFRESH_MS = 250
GIB = 1024**3


def _plot(title: str, y_label: str, height: int = 200) -> pg.PlotWidget:
    w = pg.PlotWidget(background="w")
    w.setTitle(title, color="#333", size="10pt")
    w.setLabel("left", y_label)
    w.setLabel("bottom", "seconds ago")
    w.showGrid(x=True, y=True, alpha=0.25)
    w.setXRange(-WINDOW_S, 0, padding=0)
    w.setMouseEnabled(x=False, y=False)
    w.setMenuEnabled(False)
    w.hideButtons()
    w.setFixedHeight(height)
    legend = w.addLegend(
        offset=(8, 4), labelTextSize="8pt", labelTextColor="#333", brush=(255, 255, 255, 200)
    )
    legend.setColumnCount(2)
    for axis in ("left", "bottom"):
        w.getAxis(axis).setTextPen("#444")
        w.getAxis(axis).setPen("#888")
    return w


class GpuRow(QGroupBox):
    """One card: a text line with its state, clocks over time, utilisation and VRAM over time, a flag when raised."""

    def __init__(self, label: str) -> None:
        super().__init__(label)
        self.state = QLabel("–")
        self.flag = QLabel("")
        self.flag.setWordWrap(True)
        self.flag.setStyleSheet("color: #b00020; font-weight: bold;")
        self.flag.hide()
        self.clocks = _plot("Clocks", "MHz", 160)
        self.sm = self.clocks.plot(pen=pg.mkPen("#1f77b4", width=2), name="SM")
        self.mem = self.clocks.plot(pen=pg.mkPen("#ff7f0e", width=2), name="memory")
        self.load = _plot("Utilisation and VRAM", "%", 160)
        self.load.setYRange(0, 100, padding=0.02)
        self.util = self.load.plot(pen=pg.mkPen("#2ca02c", width=2), name="GPU busy")
        self.vram = self.load.plot(pen=pg.mkPen("#9467bd", width=2), name="VRAM used")
        grid = QGridLayout(self)
        grid.addWidget(self.state, 0, 0, 1, 2)
        grid.addWidget(self.flag, 1, 0, 1, 2)
        grid.addWidget(self.clocks, 2, 0)
        grid.addWidget(self.load, 2, 1)

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


class ChartsPage(QWidget):
    def __init__(self, charts: ChartsController, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.charts = charts
        pg.setConfigOptions(antialias=True)
        self.summary = QLabel("Waiting for the engine's events (start the engine and send a message).")
        self.summary.setWordWrap(True)
        self.step_plot = _plot("Decode step time per stage", "ms")
        self.chunk_plot = _plot("Prompt chunk time per stage", "ms")
        self.speed_plot = _plot("Decode tokens per second", "tok/s")
        self.prompt_plot = _plot("Prompt tokens per second", "tok/s")
        self.step_curves: dict[int, pg.PlotDataItem] = {}
        self.chunk_curves: dict[int, pg.PlotDataItem] = {}
        self.decode_live = self.speed_plot.plot(pen=pg.mkPen("#2ca02c", width=1.5), name="live (steps/s)")
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
        self.gpu_note = QLabel("Sampling the GPUs…")
        self.gpu_note.setWordWrap(True)
        self.gpu_rows: dict[str, GpuRow] = {}

        body = QWidget()
        self.body_layout = QVBoxLayout(body)
        engine_box = QGroupBox("Engine")
        eg = QGridLayout(engine_box)
        eg.addWidget(self.summary, 0, 0, 1, 2)
        eg.addWidget(self.step_plot, 1, 0)
        eg.addWidget(self.chunk_plot, 1, 1)
        eg.addWidget(self.speed_plot, 2, 0)
        eg.addWidget(self.prompt_plot, 2, 1)
        self.body_layout.addWidget(engine_box)
        self.gpu_box = QGroupBox("GPUs (sampled every 100 ms)")
        self.gpu_layout = QVBoxLayout(self.gpu_box)
        self.gpu_layout.addWidget(self.gpu_note)
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

    def _curve(self, plot: pg.PlotWidget, store: dict[int, pg.PlotDataItem], stage: int, points: bool):
        if stage not in store:
            color = STAGE_COLORS[stage % len(STAGE_COLORS)]
            if points:
                store[stage] = plot.plot(
                    pen=None, symbol="o", symbolSize=6, symbolBrush=color, name=f"stage {stage}"
                )
            else:
                store[stage] = plot.plot(pen=pg.mkPen(color, width=1.5), name=f"stage {stage}")
        return store[stage]

    def redraw(self) -> None:
        if not self.isVisible():
            return
        c = self.charts
        now = c.clock()
        cut = now - WINDOW_S
        for stage, series in sorted(c.steps.items()):
            pts = [(t - now, ms) for t, ms in series if t >= cut]
            self._curve(self.step_plot, self.step_curves, stage, False).setData(
                [p[0] for p in pts], [p[1] for p in pts]
            )
        for stage, series in sorted(c.chunks.items()):
            pts = [(t - now, ms) for t, ms, _ in series if t >= cut]
            self._curve(self.chunk_plot, self.chunk_curves, stage, True).setData(
                [p[0] for p in pts], [p[1] for p in pts]
            )
        if c.events_seen:
            self._live.append((now, c.decode_rate(), c.prompt_rate()))
        self._live = [x for x in self._live if x[0] >= cut]
        self.decode_live.setData([x[0] - now for x in self._live], [x[1] for x in self._live])
        self.prompt_live.setData([x[0] - now for x in self._live], [x[2] for x in self._live])
        req = [(t - now, p, d) for t, p, d in c.requests if t >= cut]
        self.decode_curve.setData([r[0] for r in req], [r[2] for r in req])
        self.prompt_curve.setData([r[0] for r in req], [r[1] for r in req])
        if c.events_seen:
            parts = [f"decode now: {c.decode_rate():.1f} steps/s", f"prompt now: {c.prompt_rate():.0f} tok/s"]
            if c.requests:
                _, p, d = c.requests[-1]
                parts.append(f"last answer: prompt {p:.0f} tok/s, decode {d:.1f} tok/s")
            for stage, series in sorted(c.steps.items()):
                recent = [ms for t, ms in series if t >= now - 5.0]
                if recent:
                    parts.append(f"stage {stage}: {np.median(recent):.1f} ms per step (median of 5 s)")
            self.summary.setText(" · ".join(parts))
        for key, samples in c.gpus.items():
            row = self.gpu_rows.get(key)
            if row is None:
                row = GpuRow(samples[-1].label)
                self.gpu_rows[key] = row
                self.gpu_layout.addWidget(row)
                row.set_flag(c.flags.get(key))
                self.gpu_note.hide()
            row.update_from([s for s in samples if s.t >= cut], now)

    def _on_gpu_unavailable(self, reason: str) -> None:
        self.gpu_note.setText(f"No GPU chart: {reason}.")
        self.gpu_note.show()

    def _on_flags(self, flags: list) -> None:
        by_key = {f.key: f for f in flags}
        for key, row in self.gpu_rows.items():
            row.set_flag(by_key.get(key))

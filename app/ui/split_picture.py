"""A picture of a layer split: the model's layers as one bar, each card's contiguous range in its own colour, with
the card, its layers and what it holds written under its part."""

from dataclasses import dataclass

from PySide6.QtCore import QRectF, QSize, Qt
from PySide6.QtGui import QColor, QFont, QFontMetrics, QPainter, QPaintEvent, QPen
from PySide6.QtWidgets import QSizePolicy, QWidget

COLORS = ("#3b6fb6", "#e08a2c", "#2f9a5a", "#b8474f", "#7a5cb8", "#8c6d4f", "#d05fa6", "#5f8f9f")


@dataclass(frozen=True)
class Segment:
    begin: int
    end: int
    """Half-open layer range [begin, end)."""
    title: str
    """Where it runs, e.g. `GPU 0 · RTX 3090` or `pc-b GPU 0`."""
    detail: str = ""
    """What it holds, e.g. `experts in VRAM 3000 of 4608`."""
    head: bool = False
    """This card also runs the output head."""


class SplitPicture(QWidget):
    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.layers = 0
        self.segments: list[Segment] = []
        self.empty_text = "No split to show yet."
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)
        self.setMinimumHeight(96)

    def set_split(self, layers: int, segments: list[Segment]) -> None:
        self.layers = layers
        self.segments = list(segments)
        self.update()

    def sizeHint(self) -> QSize:
        return QSize(600, 96)

    def paintEvent(self, _event: QPaintEvent) -> None:
        p = QPainter(self)
        p.setRenderHint(QPainter.RenderHint.Antialiasing)
        w = self.width() - 2
        if not self.segments or self.layers <= 0:
            p.setPen(QColor("#777"))
            p.drawText(self.rect(), Qt.AlignmentFlag.AlignCenter, self.empty_text)
            return
        small = QFont(self.font())
        small.setPointSizeF(max(7.0, self.font().pointSizeF() - 1))
        fm = QFontMetrics(small)
        bar_top, bar_h = 18.0, 30.0
        p.setFont(small)
        p.setPen(QColor("#555"))
        p.drawText(QRectF(1, 0, w, 16), Qt.AlignmentFlag.AlignLeft, "layer 0")
        p.drawText(QRectF(1, 0, w, 16), Qt.AlignmentFlag.AlignRight, f"layer {self.layers - 1}")
        unit = w / self.layers
        for i, seg in enumerate(self.segments):
            x0 = 1 + seg.begin * unit
            x1 = 1 + seg.end * unit
            color = QColor(COLORS[i % len(COLORS)])
            p.setPen(Qt.PenStyle.NoPen)
            p.setBrush(color)
            p.drawRoundedRect(QRectF(x0 + 1, bar_top, x1 - x0 - 2, bar_h), 4, 4)
            # thin ticks per layer, so a range reads as so many layers
            p.setPen(QPen(QColor(255, 255, 255, 70), 1))
            if unit >= 4:
                for k in range(seg.begin + 1, seg.end):
                    x = 1 + k * unit
                    p.drawLine(int(x), int(bar_top + 4), int(x), int(bar_top + bar_h - 4))
            p.setPen(QColor("white"))
            inside = f"{seg.begin}–{seg.end - 1}" + (" + head" if seg.head else "")
            if fm.horizontalAdvance(inside) < x1 - x0 - 6:
                p.drawText(QRectF(x0, bar_top, x1 - x0, bar_h), Qt.AlignmentFlag.AlignCenter, inside)
            p.setPen(color.darker(130))
            text_rect = QRectF(x0 + 2, bar_top + bar_h + 2, max(x1 - x0 - 4, 10), 16)
            p.drawText(
                text_rect,
                Qt.AlignmentFlag.AlignLeft,
                fm.elidedText(seg.title, Qt.TextElideMode.ElideRight, int(text_rect.width())),
            )
            if seg.detail:
                p.setPen(QColor("#555"))
                r2 = QRectF(x0 + 2, bar_top + bar_h + 18, max(x1 - x0 - 4, 10), 16)
                p.drawText(
                    r2,
                    Qt.AlignmentFlag.AlignLeft,
                    fm.elidedText(seg.detail, Qt.TextElideMode.ElideRight, int(r2.width())),
                )
        p.end()

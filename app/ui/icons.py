"""The app icon (three stacked strata) and the tray's state icons, drawn with QPainter (no image files needed)."""

from PySide6.QtCore import QRectF, Qt
from PySide6.QtGui import QColor, QIcon, QPainter, QPixmap

STATE_COLORS = {
    "stopped": "#8a8f98",
    "starting": "#e0a030",
    "loading": "#e0a030",
    "ready": "#2fa84f",
    "degraded": "#e07a30",
    "error": "#d64545",
    "crashed": "#d64545",
    "stopping": "#8a8f98",
}
LAYERS = ("#3b6fb6", "#4f8fd6", "#7fb2ea")


def state_color(state: str) -> QColor:
    return QColor(STATE_COLORS.get(state, STATE_COLORS["stopped"]))


def _draw(size: int, state: str | None) -> QPixmap:
    pix = QPixmap(size, size)
    pix.fill(Qt.GlobalColor.transparent)
    p = QPainter(pix)
    p.setRenderHint(QPainter.RenderHint.Antialiasing)
    p.setPen(Qt.PenStyle.NoPen)
    s = size / 32.0
    for i, color in enumerate(LAYERS):
        p.setBrush(QColor(color))
        p.drawRoundedRect(QRectF(3 * s, (5 + 8 * i) * s, 26 * s, 6 * s), 2 * s, 2 * s)
    if state is not None:
        p.setBrush(QColor("white"))
        p.drawEllipse(QRectF(17 * s, 17 * s, 15 * s, 15 * s))
        p.setBrush(state_color(state))
        p.drawEllipse(QRectF(19 * s, 19 * s, 11 * s, 11 * s))
    p.end()
    return pix


def app_icon() -> QIcon:
    icon = QIcon()
    for size in (16, 24, 32, 48, 64, 128, 256):
        icon.addPixmap(_draw(size, None))
    return icon


def state_icon(state: str) -> QIcon:
    icon = QIcon()
    for size in (16, 22, 24, 32, 48, 64):
        icon.addPixmap(_draw(size, state))
    return icon


def dot_pixmap(state: str, size: int = 12) -> QPixmap:
    pix = QPixmap(size, size)
    pix.fill(Qt.GlobalColor.transparent)
    p = QPainter(pix)
    p.setRenderHint(QPainter.RenderHint.Antialiasing)
    p.setPen(Qt.PenStyle.NoPen)
    p.setBrush(state_color(state))
    p.drawEllipse(0, 0, size, size)
    p.end()
    return pix

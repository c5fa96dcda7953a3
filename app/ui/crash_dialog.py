"""Shown when the engine ends on its own: what happened, the last lines of its log, and a restart button."""

import html

from PySide6.QtCore import Signal
from PySide6.QtGui import QFontDatabase, QGuiApplication
from PySide6.QtWidgets import (
    QDialog,
    QDialogButtonBox,
    QLabel,
    QPlainTextEdit,
    QPushButton,
    QVBoxLayout,
    QWidget,
)


class CrashDialog(QDialog):
    restartRequested = Signal()

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setWindowTitle("PolyStrata: the engine stopped")
        self.setModal(False)
        self.text = ""
        self.message = QLabel()
        self.message.setWordWrap(True)
        self.tail = QPlainTextEdit()
        self.tail.setReadOnly(True)
        self.tail.setFont(QFontDatabase.systemFont(QFontDatabase.SystemFont.FixedFont))
        self.tail.setLineWrapMode(QPlainTextEdit.LineWrapMode.NoWrap)
        buttons = QDialogButtonBox()
        self.restart_button = QPushButton("Restart the engine")
        self.copy_button = QPushButton("Copy the log")
        buttons.addButton(self.restart_button, QDialogButtonBox.ButtonRole.AcceptRole)
        buttons.addButton(self.copy_button, QDialogButtonBox.ButtonRole.ActionRole)
        buttons.addButton(QDialogButtonBox.StandardButton.Close)
        self.restart_button.clicked.connect(self._restart)
        self.copy_button.clicked.connect(self._copy)
        buttons.rejected.connect(self.close)
        note = QLabel("The app keeps running. The last lines of the engine's log:")
        layout = QVBoxLayout(self)
        layout.addWidget(self.message)
        layout.addWidget(note)
        layout.addWidget(self.tail, 1)
        layout.addWidget(buttons)
        self.resize(760, 420)

    def show_crash(self, message: str, tail: list[str]) -> None:
        self.text = message[:1].upper() + message[1:]
        self.message.setText(f"<b>{html.escape(self.text)}</b>")
        self.tail.setPlainText("\n".join(tail))
        self.tail.verticalScrollBar().setValue(self.tail.verticalScrollBar().maximum())
        self.show()
        self.raise_()

    def _restart(self) -> None:
        self.close()
        self.restartRequested.emit()

    def _copy(self) -> None:
        QGuiApplication.clipboard().setText(self.text + "\n" + self.tail.toPlainText())

"""The QApplication and its top-level window."""

import argparse

from PySide6.QtCore import QTimer
from PySide6.QtWidgets import QApplication, QLabel, QMainWindow, QVBoxLayout, QWidget

from installer.version import __version__


class MainWindow(QMainWindow):
    def __init__(self) -> None:
        super().__init__()
        self.setWindowTitle(f"PolyStrata {__version__}")
        body = QWidget()
        layout = QVBoxLayout(body)
        self.status = QLabel("Engine: stopped")
        layout.addWidget(QLabel(f"<h2>PolyStrata</h2><p>version {__version__}</p>"))
        layout.addWidget(self.status)
        self.setCentralWidget(body)
        self.resize(900, 600)


def run(args: argparse.Namespace) -> int:
    app = QApplication.instance() or QApplication([])
    app.setApplicationName("PolyStrata")
    win = MainWindow()
    win.show()
    if args.quit_after:
        QTimer.singleShot(int(args.quit_after * 1000), app.quit)
    return app.exec()

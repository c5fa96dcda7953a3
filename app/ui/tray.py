"""The tray icon: the server's state in the icon, start/stop, open chat, copy the API URL, open the window, quit.

Where the desktop has no tray (GNOME without an AppIndicator extension, some minimal window managers), `available`
is False with the reason, and the main window stays the way back (closing it quits).
"""

import os
import sys
from collections.abc import Callable

from PySide6.QtCore import QObject, Signal
from PySide6.QtGui import QAction, QGuiApplication
from PySide6.QtWidgets import QMenu, QSystemTrayIcon

from app.controllers.engine import STATE_TEXT, EngineController, EngineState
from app.controllers.library import LibraryController
from app.ui.icons import state_icon


def tray_unavailable_reason() -> str | None:
    """None where a tray exists; else why not, with what to do."""
    if QSystemTrayIcon.isSystemTrayAvailable():
        return None
    desktop = os.environ.get("XDG_CURRENT_DESKTOP", "")
    if sys.platform.startswith("linux") and "GNOME" in desktop.upper():
        return (
            "this GNOME desktop has no system tray; install the AppIndicator extension "
            "(gnome-shell-extension-appindicator) to keep PolyStrata in the tray"
        )
    return "this desktop has no system tray"


class Tray(QObject):
    openWindowRequested = Signal()
    openChatRequested = Signal()
    quitRequested = Signal()

    def __init__(
        self,
        engine: EngineController,
        available: bool | None = None,
        clipboard_set: Callable[[str], None] | None = None,
        parent: QObject | None = None,
    ) -> None:
        super().__init__(parent)
        self.engine = engine
        self.available = QSystemTrayIcon.isSystemTrayAvailable() if available is None else available
        self._clipboard_set = clipboard_set or (lambda text: QGuiApplication.clipboard().setText(text))
        self.menu = QMenu()
        self.state_action = QAction("Engine: stopped", self.menu)
        self.state_action.setEnabled(False)
        self.start_action = QAction("Start the engine", self.menu)
        self.stop_action = QAction("Stop the engine", self.menu)
        self.chat_action = QAction("Open chat", self.menu)
        self.copy_action = QAction("Copy API URL", self.menu)
        self.window_action = QAction("Open window", self.menu)
        self.model_menu = QMenu(
            "Model"
        )  # the models on this PC (set_library): choosing one restarts the engine
        self.model_menu.menuAction().setVisible(False)
        self._library: LibraryController | None = None
        self.quit_action = QAction("Quit PolyStrata", self.menu)
        for a in (
            self.state_action,
            None,
            self.start_action,
            self.stop_action,
            None,
            self.chat_action,
            self.model_menu.menuAction(),
            self.copy_action,
            self.window_action,
            None,
            self.quit_action,
        ):
            if a is None:
                self.menu.addSeparator()
            else:
                self.menu.addAction(a)
        self.start_action.triggered.connect(engine.start)
        self.stop_action.triggered.connect(engine.stop)
        self.chat_action.triggered.connect(self.openChatRequested)
        self.copy_action.triggered.connect(self.copy_api_url)
        self.window_action.triggered.connect(self.openWindowRequested)
        self.quit_action.triggered.connect(self.quitRequested)
        self.icon = QSystemTrayIcon()
        self.icon.setContextMenu(self.menu)
        self.icon.activated.connect(self._on_activated)
        engine.stateChanged.connect(lambda _s: self.refresh())
        self.refresh()
        if self.available:
            self.icon.show()

    def refresh(self) -> None:
        state = self.engine.state
        text = f"Engine: {STATE_TEXT[state].lower()}"
        if state == EngineState.READY:
            text += f" · {self.engine.api_url}"
        self.state_action.setText(text)
        self.start_action.setEnabled(not self.engine.running and state != EngineState.STOPPING)
        self.stop_action.setEnabled(self.engine.running)
        self.icon.setIcon(state_icon(state.value))
        self.icon.setToolTip(f"PolyStrata: {text[len('Engine: ') :]}")

    def set_library(self, library: LibraryController) -> None:
        self._library = library
        library.changed.connect(self._fill_models)
        self._fill_models()

    def _fill_models(self) -> None:
        lib = self._library
        self.model_menu.clear()
        models = lib.models if lib is not None else []
        served = lib.served if lib is not None else None
        for m in models:
            a = self.model_menu.addAction(m.name)
            a.setCheckable(True)
            a.setChecked(served is not None and m.path == served)
            a.triggered.connect(lambda _c=False, m=m: lib.serve(m))  # type: ignore[union-attr]
        self.model_menu.menuAction().setVisible(bool(models))

    def copy_api_url(self) -> None:
        self._clipboard_set(self.engine.api_url)
        self.notify("API URL copied", self.engine.api_url)

    def notify(self, title: str, text: str) -> None:
        if self.available and self.icon.supportsMessages():
            self.icon.showMessage(title, text, QSystemTrayIcon.MessageIcon.Information, 3000)

    def _on_activated(self, reason: QSystemTrayIcon.ActivationReason) -> None:
        if reason in (QSystemTrayIcon.ActivationReason.Trigger, QSystemTrayIcon.ActivationReason.DoubleClick):
            self.openWindowRequested.emit()

    def hide(self) -> None:
        self.icon.hide()

"""The main window: the engine's state and controls on top; tabs Engine (split plan, log), Charts, Worker PCs,
Settings. Closing it leaves the server running in the tray; without a tray it says so and closing quits."""

import html

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QCloseEvent, QGuiApplication
from PySide6.QtWidgets import QHBoxLayout, QLabel, QMainWindow, QPushButton, QTabWidget, QVBoxLayout, QWidget

from app.controllers.charts import ChartsController
from app.controllers.engine import STATE_TEXT, EngineController, EngineState
from app.controllers.library import LibraryController
from app.controllers.nodes import NodesController
from app.controllers.worker_plan import WorkerPlanController
from app.settings import AppSettings
from app.ui.charts_page import ChartsPage
from app.ui.crash_dialog import CrashDialog
from app.ui.engine_page import EnginePage
from app.ui.icons import app_icon, dot_pixmap
from app.ui.library_page import LibraryPage
from app.ui.settings_page import SettingsPage
from app.ui.workers_page import WorkersPage
from installer.version import __version__


class MainWindow(QMainWindow):
    chatRequested = Signal()
    quitRequested = Signal()
    hiddenToTray = Signal()

    def __init__(
        self,
        engine: EngineController,
        charts: ChartsController,
        nodes: NodesController,
        settings: AppSettings,
        tray_reason: str | None,
        library: LibraryController | None = None,
        parent: QWidget | None = None,
        plan: WorkerPlanController | None = None,
    ) -> None:
        super().__init__(parent)
        self.engine = engine
        self.nodes = nodes
        self.tray_reason = tray_reason
        self.setWindowTitle(f"PolyStrata {__version__}")
        self.setWindowIcon(app_icon())

        self.dot = QLabel()
        self.state_label = QLabel()
        self.state_label.setStyleSheet("font-size: 15px; font-weight: bold;")
        self.model_label = QLabel()
        self.url_label = QLabel()
        self.url_label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.copy_url = QPushButton("Copy API URL")
        self.copy_url.clicked.connect(lambda: QGuiApplication.clipboard().setText(engine.api_url))
        self.start_button = QPushButton("Start")
        self.stop_button = QPushButton("Stop")
        self.restart_button = QPushButton("Restart")
        self.chat_button = QPushButton("Open chat")
        self.start_button.clicked.connect(engine.start)
        self.stop_button.clicked.connect(engine.stop)
        self.restart_button.clicked.connect(engine.restart)
        self.chat_button.clicked.connect(self.chatRequested)

        head = QHBoxLayout()
        head.addWidget(self.dot)
        head.addWidget(self.state_label)
        head.addSpacing(12)
        head.addWidget(self.model_label, 1)
        for b in (self.start_button, self.stop_button, self.restart_button, self.chat_button):
            head.addWidget(b)
        url_row = QHBoxLayout()
        url_row.addWidget(QLabel("API:"))
        url_row.addWidget(self.url_label)
        url_row.addWidget(self.copy_url)
        url_row.addStretch(1)
        self.message = QLabel()
        self.message.setWordWrap(True)
        self.message.setStyleSheet("color: #b00020;")
        self.message.hide()
        self.tray_banner = QLabel()
        self.tray_banner.setWordWrap(True)
        self.tray_banner.setStyleSheet("background: #fff4d6; padding: 6px; border-radius: 4px;")
        if tray_reason:
            self.tray_banner.setText(
                f"No tray icon: {html.escape(tray_reason)}. This window stays open; closing it quits PolyStrata "
                "and stops the server."
            )
        else:
            self.tray_banner.hide()

        self.tabs = QTabWidget()
        self.engine_page = EnginePage(engine)
        self.charts_page = ChartsPage(charts)
        self.workers_page = WorkersPage(nodes, plan)
        self.settings_page = SettingsPage(settings)
        self.library = library or LibraryController(lambda: settings.model)
        self.library_page = LibraryPage(self.library)
        self.tabs.addTab(self.engine_page, "Engine")
        self.tabs.addTab(self.library_page, "Models")
        self.tabs.addTab(self.charts_page, "Charts")
        self.tabs.addTab(self.workers_page, "Worker PCs")
        self.tabs.addTab(self.settings_page, "Settings")
        self._browsed = False  # the LAN is browsed (mDNS) the first time the worker PCs page opens
        self.tabs.currentChanged.connect(self._on_tab)

        body = QWidget()
        layout = QVBoxLayout(body)
        layout.addLayout(head)
        layout.addLayout(url_row)
        layout.addWidget(self.message)
        layout.addWidget(self.tray_banner)
        layout.addWidget(self.tabs, 1)
        self.setCentralWidget(body)
        self.resize(1100, 780)

        self.crash_dialog = CrashDialog(self)
        self.crash_dialog.restartRequested.connect(engine.restart)
        engine.stateChanged.connect(lambda _s: self.refresh())
        engine.healthChanged.connect(lambda _h: self.refresh())
        engine.crashed.connect(self._on_crashed)
        engine.startRefused.connect(self._on_refused)
        self.refresh()

    def refresh(self) -> None:
        e = self.engine
        state = e.state
        self.dot.setPixmap(dot_pixmap(state.value, 14))
        self.state_label.setText(STATE_TEXT[state])
        self.model_label.setText(f"Model: {e.model_name}")
        self.url_label.setText(e.api_url)
        self.start_button.setEnabled(not e.running and state != EngineState.STOPPING)
        self.stop_button.setEnabled(e.running)
        self.restart_button.setEnabled(e.running or state == EngineState.CRASHED)
        if state in (EngineState.ERROR, EngineState.CRASHED, EngineState.DEGRADED) and e.message:
            self.show_message(e.message)
        elif e.pending:
            self.show_message(
                f"Saved. The engine still serves at {e.api_url} with its earlier options: restart it to apply "
                "the new ones."
            )
        elif state in (EngineState.STARTING, EngineState.LOADING, EngineState.READY):
            self.message.hide()

    def _on_tab(self, _index: int) -> None:
        if self.tabs.currentWidget() is self.workers_page and not self._browsed:
            self._browsed = True
            self.nodes.refresh(discover=True)

    def show_message(self, text: str) -> None:
        self.message.setText(text[:1].upper() + text[1:])
        self.message.show()

    def _on_crashed(self, message: str) -> None:
        self.crash_dialog.show_crash(message, self.engine.log_tail())

    def _on_refused(self, message: str) -> None:
        self.show_message(f"The engine was not started: {message}")
        self.tabs.setCurrentWidget(self.settings_page)

    def closeEvent(self, event: QCloseEvent) -> None:
        if self.tray_reason is None:
            event.ignore()
            self.hide()
            self.hiddenToTray.emit()
            return
        event.accept()
        self.quitRequested.emit()

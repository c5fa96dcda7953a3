"""The QApplication and its parts: one EngineClient, the controllers, the main window, the tray and the chat window."""

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

from PySide6.QtCore import QObject, QTimer
from PySide6.QtWidgets import QApplication

from app.clients.engine_client import EngineClient
from app.clients.node_client import NodeClient
from app.controllers.charts import ChartsController
from app.controllers.chat import ChatController
from app.controllers.conversations import ConversationStore
from app.controllers.engine import EngineController, EngineState
from app.controllers.gpu_sampler import GpuSampler
from app.controllers.library import LibraryController
from app.controllers.nodes import NodesController
from app.controllers.remote_gpus import RemoteGpus
from app.controllers.wizard import WizardController
from app.controllers.worker_plan import WorkerPlanController
from app.controllers.worker_stages import WorkerStages
from app.settings import AppSettings, SettingsError, load_settings, save_settings
from app.ui.chat_window import ChatWindow
from app.ui.icons import app_icon
from app.ui.main_window import MainWindow
from app.ui.tray import Tray, tray_unavailable_reason
from app.ui.wizard import SetupWizard
from installer import default_model
from installer.config import ConfigError, default_config, read_config
from installer.gpus import ProbeResult, probe


class StrataApp(QObject):
    """Builds and wires everything; `start()` shows the window (and starts the engine when so configured)."""

    def __init__(
        self,
        settings: AppSettings,
        *,
        engine_command: list[str] | None = None,
        node_command: list[str] | None = None,
        tray_reason: str | bool | None = False,
        nvml: Any = None,
        probe_fn: Callable[[], ProbeResult] = probe,
        save: Callable[[AppSettings], object] = save_settings,
        poll_ms: int = 500,
        make_wizard: Callable[[], WizardController] | None = None,
    ) -> None:
        super().__init__()
        self.settings = settings
        self._save = save
        self._make_wizard = make_wizard or (lambda: WizardController(probe_fn))
        self.wizard: SetupWizard | None = None
        self._quitting = False
        self.client = EngineClient(settings.base_url, settings.api_key)
        self.node_client = NodeClient(node_command)
        self.engine = EngineController(
            self.client, settings, engine_command, poll_ms=poll_ms, stages=WorkerStages(self.node_client)
        )
        self.charts = ChartsController()
        self.sampler = GpuSampler(nvml=nvml)
        self.nodes = NodesController(self.node_client, probe_fn)
        self.plan = WorkerPlanController(
            self.nodes,
            self.node_client,
            self._served_model,
            lambda: self.settings.config,
            lambda: self.settings.max_context,
            lambda: self.settings.device == "cpu",
        )
        self.library = LibraryController(self._served_model, probe_fn)
        self.remote_gpus = RemoteGpus(self.node_client)
        self.chat = ChatController(
            self.client, ConversationStore(), settings.system_prompt, settings.sampling
        )
        # tray_reason False: ask the desktop; None: a tray exists; a string: why there is none.
        reason = tray_unavailable_reason() if tray_reason is False else tray_reason
        self.tray: Tray | None = None if reason else Tray(self.engine, available=True)
        self.window = MainWindow(
            self.engine, self.charts, self.nodes, settings, reason or None, self.library, plan=self.plan
        )
        self.chat_window: ChatWindow | None = None
        self._told_tray = False
        self.exit_app: Callable[[], None] = QApplication.quit
        """Ends the event loop after shutdown(); tests replace it."""

        self.engine.engineEvent.connect(self.charts.on_event)
        self.engine.statsChanged.connect(self.charts.on_stats)
        self.engine.stateChanged.connect(self._on_state)
        self.sampler.sampled.connect(self.charts.on_gpu_samples)
        self.sampler.unavailable.connect(self.charts.on_gpu_unavailable)
        self.node_client.agentsChanged.connect(self.remote_gpus.watch)
        self.remote_gpus.sampled.connect(self.charts.on_gpu_samples)
        charts_page = self.window.charts_page
        self.remote_gpus.problemsChanged.connect(charts_page.on_remote_problems)
        self.remote_gpus.clocksDone.connect(charts_page.on_lock_done)
        charts_page.lockRequested.connect(self.remote_gpus.set_clocks)
        self.window.chatRequested.connect(self.open_chat)
        self.window.quitRequested.connect(self.quit)
        self.window.hiddenToTray.connect(self._on_hidden)
        self.window.settings_page.saved.connect(self.apply_settings)
        self.window.settings_page.wizardRequested.connect(self.open_wizard)
        self.window.library_page.wizardRequested.connect(self.open_wizard)
        self.library.serveRequested.connect(self.serve_model)
        self.plan.applied.connect(self.serve_config)
        if self.tray is not None:
            self.tray.set_library(self.library)
            self.tray.openChatRequested.connect(self.open_chat)
            self.tray.openWindowRequested.connect(self.open_window)
            self.tray.quitRequested.connect(self.quit)

    def start(self, show: bool = True, first_run: bool = False) -> None:
        """Show the window and start the sampler; on a first run open the wizard, else start the engine if so set."""
        if show:
            self.window.show()
        self.sampler.start()
        self.nodes.refresh(discover=False)  # the LAN is browsed when the worker PCs page opens
        self.library.refresh()
        if first_run:
            self.open_wizard()
        elif self.settings.autostart_engine:
            self.engine.start()

    def open_wizard(self) -> SetupWizard:
        if self.wizard is None:
            self.wizard = SetupWizard(self._make_wizard())
            self.wizard.setupDone.connect(self._on_setup_done)
            self.wizard.rejected.connect(self._on_setup_skipped)
            self.wizard.finished.connect(self._forget_wizard)
        self.wizard.show()
        self.wizard.raise_()
        return self.wizard

    def _forget_wizard(self) -> None:
        if self.wizard is not None:
            self.wizard.deleteLater()
        self.wizard = None

    def _on_setup_done(self, config: str, start_now: bool) -> None:
        self.apply_settings(self.settings.with_changes(config=config, model="", wizard_done=True))
        self.window.settings_page.load(self.settings)
        if start_now:
            self.engine.restart()

    def _on_setup_skipped(self) -> None:
        if not self.settings.wizard_done and not self._quitting:
            self.apply_settings(self.settings.with_changes(wizard_done=True))
            if self.settings.autostart_engine:
                self.engine.start()

    def open_window(self) -> None:
        self.window.showNormal()
        self.window.raise_()
        self.window.activateWindow()

    def open_chat(self) -> ChatWindow:
        if self.chat_window is None:
            self.chat_window = ChatWindow(self.chat, self.engine, self.library)
        self.chat_window.showNormal()
        self.chat_window.raise_()
        self.chat_window.activateWindow()
        return self.chat_window

    def apply_settings(self, settings: AppSettings) -> None:
        self.settings = settings
        try:
            self._save(settings)
        except OSError as e:
            self.window.show_message(
                f"the settings could not be saved ({e}): check the config folder's permissions"
            )
        self.engine.apply_settings(settings)
        self.window.refresh()  # the top bar: the new address and model, or that a restart applies them

    def _served_model(self) -> str:
        """The model file the engine serves or will serve: the settings' model, their config's, strata-setup's,
        else the embedded chat model ("" where none of these can be told)."""
        s = self.settings
        if s.model:
            return s.model
        cfg = s.config or str(default_config() or "")
        if cfg:
            try:
                return read_config(Path(cfg)).model
            except (ConfigError, OSError):
                return ""
        try:
            return str(default_model.CHAT.path(assemble=False))
        except default_model.DefaultModelMissing:
            return ""

    def serve_model(self, path: str) -> None:
        """Serve `path` from now on (saved as the model; a config's split no longer applies): the engine restarts
        on it, or starts."""
        self.apply_settings(self.settings.with_changes(model=path, config=""))
        if self.engine.running:
            self.engine.restart()
        else:
            self.engine.start()
        self.library.changed.emit()

    def serve_config(self, path: str) -> None:
        """Serve the config at `path` from now on (written by the worker PCs' plan): the engine restarts on it."""
        self.apply_settings(self.settings.with_changes(config=path, model=""))
        self.window.settings_page.load(self.settings)
        self.plan.changed.emit()  # "Stop using worker PCs" follows the config now served
        if self.engine.running:
            self.engine.restart()
        else:
            self.engine.start()

    def quit(self) -> None:
        self.shutdown()
        self.exit_app()

    def shutdown(self) -> None:
        """Stop everything this app started (engine, sampler thread, GPU streams, node agent); safe to call twice."""
        self._quitting = True
        self.engine.shutdown()
        self.sampler.stop()
        self.remote_gpus.stop()
        self.node_client.shutdown()
        if self.chat_window is not None:
            self.chat_window.close()
        if self.wizard is not None:
            self.wizard.ctl.cancel_download()
            self.wizard.close()
        if self.tray is not None:
            self.tray.hide()

    def _on_state(self, state: str) -> None:
        if state == EngineState.STARTING:
            self.charts.clear()
        if self.tray is not None and state in (EngineState.READY, EngineState.CRASHED):
            if state == EngineState.READY:
                self.tray.notify("PolyStrata is ready", f"{self.engine.model_name} at {self.engine.api_url}")
            else:
                self.tray.notify("The engine stopped", self.engine.message)

    def _on_hidden(self) -> None:
        if self.tray is not None and not self._told_tray:
            self._told_tray = True
            self.tray.notify(
                "PolyStrata keeps running", "The server stays up in the tray; Quit is in its menu."
            )


def run(args: argparse.Namespace) -> int:
    app = QApplication.instance() or QApplication([])
    app.setApplicationName("PolyStrata")
    app.setWindowIcon(app_icon())
    problem = ""
    try:
        settings, existed = load_settings()
    except SettingsError as e:
        settings, existed, problem = AppSettings(), True, str(e)
    if args.model:
        settings = settings.with_changes(model=args.model)
    strata = StrataApp(settings)
    has_tray = strata.tray is not None
    app.setQuitOnLastWindowClosed(not has_tray)
    app.aboutToQuit.connect(strata.shutdown)
    strata.start(first_run=not existed and not args.model and not args.quit_after)
    if problem:
        strata.window.show_message(problem)
    if args.quit_after:
        QTimer.singleShot(int(args.quit_after * 1000), strata.quit)
    return app.exec()

"""The main window's Settings tab: how the engine is started (model file, device, port, context, API key)."""

from PySide6.QtCore import Signal
from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QFileDialog,
    QFormLayout,
    QGroupBox,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QPushButton,
    QSpinBox,
    QVBoxLayout,
    QWidget,
)

from app.settings import DEVICES, AppSettings

HOSTS = ("127.0.0.1", "0.0.0.0")


class SettingsPage(QWidget):
    saved = Signal(object)
    """The new AppSettings (valid), after Save."""
    wizardRequested = Signal()

    def __init__(self, settings: AppSettings, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.settings = settings
        box = QGroupBox("Engine")
        form = QFormLayout(box)
        self.model = QLineEdit()
        self.model.setPlaceholderText(
            "empty: the setup config's model, else the embedded Qwen2.5-Coder-0.5B-Instruct"
        )
        browse = QPushButton("Choose…")
        browse.clicked.connect(self._browse)
        model_row = QHBoxLayout()
        model_row.addWidget(self.model, 1)
        model_row.addWidget(browse)
        form.addRow("Model file (GGUF):", model_row)
        self.config = QLineEdit()
        self.config.setPlaceholderText("none: written by the setup wizard (cards, layer split, model)")
        form.addRow("Setup config:", self.config)
        self.device = QComboBox()
        self.device.addItems(DEVICES)
        form.addRow("Device:", self.device)
        self.host = QComboBox()
        self.host.addItems(HOSTS)
        self.host.setToolTip("0.0.0.0 makes the API reachable from other PCs; it then needs an API key")
        form.addRow("Listen on:", self.host)
        self.port = QSpinBox()
        self.port.setRange(1, 65535)
        form.addRow("Port:", self.port)
        self.context = QSpinBox()
        self.context.setRange(0, 1 << 20)
        self.context.setSingleStep(1024)
        self.context.setSpecialValueText("from the config, else the engine's default (4096)")
        form.addRow("Context (tokens):", self.context)
        self.api_key = QLineEdit()
        self.api_key.setEchoMode(QLineEdit.EchoMode.PasswordEchoOnEdit)
        self.api_key.setPlaceholderText("none (only this PC can reach the API)")
        form.addRow("API key:", self.api_key)
        self.autostart = QCheckBox("Start the engine when the app opens")
        form.addRow("", self.autostart)
        self.problems = QLabel("")
        self.problems.setWordWrap(True)
        self.problems.setStyleSheet("color: #b00020;")
        buttons = QHBoxLayout()
        self.save_button = QPushButton("Save")
        self.save_button.clicked.connect(self.save)
        wizard = QPushButton("Run the setup wizard…")
        wizard.clicked.connect(self.wizardRequested)
        buttons.addWidget(self.save_button)
        buttons.addStretch(1)
        buttons.addWidget(wizard)
        note = QLabel("Changes take effect at the next start of the engine (Restart applies them now).")
        note.setWordWrap(True)
        layout = QVBoxLayout(self)
        layout.addWidget(box)
        layout.addWidget(note)
        layout.addWidget(self.problems)
        layout.addLayout(buttons)
        layout.addStretch(1)
        self.load(settings)

    def load(self, s: AppSettings) -> None:
        self.settings = s
        self.model.setText(s.model)
        self.config.setText(s.config)
        self.device.setCurrentText(s.device)
        self.host.setCurrentText(s.host if s.host in HOSTS else HOSTS[0])
        self.port.setValue(s.port)
        self.context.setValue(s.max_context)
        self.api_key.setText(s.api_key)
        self.autostart.setChecked(s.autostart_engine)
        self.problems.clear()

    def current(self) -> AppSettings:
        return self.settings.with_changes(
            model=self.model.text().strip(),
            config=self.config.text().strip(),
            device=self.device.currentText(),
            host=self.host.currentText(),
            port=self.port.value(),
            max_context=self.context.value(),
            api_key=self.api_key.text().strip(),
            autostart_engine=self.autostart.isChecked(),
        )

    def save(self) -> bool:
        s = self.current()
        problems = s.validate()
        self.problems.setText("\n".join(problems))
        if problems:
            return False
        self.settings = s
        self.saved.emit(s)
        return True

    def _browse(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Choose a GGUF model", self.model.text(), "GGUF (*.gguf)")
        if path:
            self.model.setText(path)

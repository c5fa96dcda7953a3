"""The first-run wizard: GPUs, model, download, split preview, done. All work is in `WizardController`."""

import html

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QFontDatabase, QKeyEvent
from PySide6.QtWidgets import (
    QButtonGroup,
    QCheckBox,
    QFileDialog,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QListWidget,
    QListWidgetItem,
    QProgressBar,
    QPushButton,
    QRadioButton,
    QSpinBox,
    QVBoxLayout,
    QWidget,
    QWizard,
    QWizardPage,
)

from app.controllers.wizard import WizardController, size_text
from app.ui.icons import app_icon
from app.ui.split_picture import Segment, SplitPicture
from installer.catalog import CatalogEntry, LocalModel
from installer.config import ConfigError
from installer.download import DownloadEvent, DownloadState


def _wrap(text: str = "") -> QLabel:
    label = QLabel(text)
    label.setWordWrap(True)
    return label


class GpuPage(QWizardPage):
    def __init__(self, ctl: WizardController) -> None:
        super().__init__()
        self.ctl = ctl
        self.setTitle("Your GPUs")
        self.setSubTitle("PolyStrata splits a model's layers over the NVIDIA cards that can share it.")
        self.listing = _wrap("Looking for GPUs…")
        self.listing.setTextFormat(Qt.TextFormat.RichText)
        self.message = _wrap()
        self.message.setStyleSheet("color: #8a5a00;")
        self.group = QButtonGroup(self)
        self.options = QVBoxLayout()
        layout = QVBoxLayout(self)
        layout.addWidget(self.listing)
        layout.addWidget(self.message)
        layout.addSpacing(8)
        layout.addWidget(QLabel("<b>Which GPUs?</b>"))
        layout.addLayout(self.options)
        layout.addStretch(1)
        ctl.probed.connect(self._show)
        self.group.idToggled.connect(self._on_toggled)

    def initializePage(self) -> None:
        if self.ctl.probing:
            self.ctl.probe()
        else:
            self._show()

    def isComplete(self) -> bool:
        return not self.ctl.probing

    def _show(self) -> None:
        rows = [
            f"<span style='color:{'#2a7a3a' if c.usable else '#a33'}'>{'✔' if c.usable else '✖'}</span> "
            f"{html.escape(c.text)}"
            for c in self.ctl.cards
        ]
        self.listing.setText("<br>".join(rows) if rows else "No NVIDIA GPU found.")
        self.message.setText(self.ctl.gpu_message)
        for b in self.group.buttons():
            self.group.removeButton(b)
            b.deleteLater()
        for n, choice in enumerate(self.ctl.choices):
            b = QRadioButton(f"{n + 1}) {choice.label}" + ("   (recommended)" if choice.recommended else ""))
            self.group.addButton(b, n)
            self.options.addWidget(b)
        cpu = QRadioButton(f"{len(self.ctl.choices) + 1}) CPU mode (no GPU; slow)")
        self.group.addButton(cpu, len(self.ctl.choices))
        self.options.addWidget(cpu)
        self.group.button(0).setChecked(True)
        self.completeChanged.emit()

    def _on_toggled(self, n: int, on: bool) -> None:
        if on:
            self.ctl.choose_gpus(n if n < len(self.ctl.choices) else None)


class EnterField(QLineEdit):
    """A line edit whose Enter acts on the field (returnPressed) and goes no further: in a wizard it would also
    press Next, which on the model page starts a download."""

    def keyPressEvent(self, event: QKeyEvent) -> None:
        super().keyPressEvent(event)
        if event.key() in (Qt.Key.Key_Return, Qt.Key.Key_Enter):
            event.accept()


class ModelPage(QWizardPage):
    def __init__(self, ctl: WizardController) -> None:
        super().__init__()
        self.ctl = ctl
        self.setTitle("Model")
        self.setSubTitle(
            "Choose a model from the catalog, a GGUF file on this PC, or a Hugging Face repo and file."
        )
        self.list = QListWidget()
        self.list.currentItemChanged.connect(self._on_item)
        self.other = EnterField()
        self.other.setPlaceholderText("or: /path/to/model.gguf, or owner/repo:file.gguf")
        self.other.returnPressed.connect(self._use_other)
        browse = QPushButton("Choose file…")
        browse.clicked.connect(self._browse)
        use = QPushButton("Use")
        use.clicked.connect(self._use_other)
        row = QHBoxLayout()
        row.addWidget(self.other, 1)
        row.addWidget(browse)
        row.addWidget(use)
        self.context = QSpinBox()
        self.context.setRange(256, 1 << 20)
        self.context.setSingleStep(4096)
        self.context.valueChanged.connect(ctl.set_context)
        ctx_row = QHBoxLayout()
        ctx_row.addWidget(QLabel("Context (tokens):"))
        ctx_row.addWidget(self.context)
        ctx_row.addStretch(1)
        self.fit = _wrap()
        self.fit.setFont(QFontDatabase.systemFont(QFontDatabase.SystemFont.FixedFont))
        self.error = _wrap()
        self.error.setStyleSheet("color: #b00020;")
        layout = QVBoxLayout(self)
        layout.addWidget(self.list, 1)
        layout.addLayout(row)
        layout.addLayout(ctx_row)
        layout.addWidget(QLabel("<b>Fit estimate</b>"))
        layout.addWidget(self.fit)
        layout.addWidget(self.error)
        ctl.modelChanged.connect(self._show_fit)

    def initializePage(self) -> None:
        self._fill()
        if self.ctl.model is None and self.list.count():
            self.list.setCurrentRow(0)  # those that fit this PC come first
        self._show_fit()

    def _fill(self) -> None:
        """The catalog with each model's fit on this PC and the chosen cards (they may have changed)."""
        chosen = self.ctl.model.id if isinstance(self.ctl.model, CatalogEntry) else None
        self.list.blockSignals(True)
        self.list.clear()
        for e, fit in self.ctl.catalog_fits():
            experts = f"{e.experts_used} of {e.experts} experts" if e.experts else "dense"
            item = QListWidgetItem(
                f"{e.display_name}  ·  {size_text(e.size_bytes)}  ·  {e.layers} layers, {experts}  ·  {fit.label}"
            )
            item.setData(Qt.ItemDataRole.UserRole, e.id)
            item.setToolTip("\n".join(fit.lines))
            if not fit.fits:
                item.setForeground(Qt.GlobalColor.gray)
            self.list.addItem(item)
            if e.id == chosen:
                self.list.setCurrentItem(item)
        self.list.blockSignals(False)

    def isComplete(self) -> bool:
        return self.ctl.model is not None

    def validatePage(self) -> bool:
        try:
            self.ctl.check_config()  # written once the model is in place
        except (ConfigError, OSError) as e:
            self.error.setText(f"The config could not be written: {e}")
            return False
        return True

    def _on_item(self, item: QListWidgetItem | None) -> None:
        if item is not None:
            self._choose(str(item.data(Qt.ItemDataRole.UserRole)))

    def _use_other(self) -> None:
        if self.other.text().strip():
            self.list.clearSelection()
            self._choose(self.other.text().strip())

    def _choose(self, text: str) -> None:
        problem = self.ctl.choose_model(text)
        self.error.setText(problem or "")
        self.context.blockSignals(True)
        self.context.setValue(self.ctl.context)
        self.context.blockSignals(False)
        self.completeChanged.emit()

    def _browse(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Choose a GGUF model", "", "GGUF (*.gguf)")
        if path:
            self.other.setText(path)
            self._use_other()

    def _show_fit(self) -> None:
        self.fit.setText("\n".join(self.ctl.fit_lines()))


class DownloadPage(QWizardPage):
    def __init__(self, ctl: WizardController) -> None:
        super().__init__()
        self.ctl = ctl
        self.setTitle("Download")
        self.setSubTitle(
            "Resumes after a stall, a crash or a restart; every file is checked against its sha256."
        )
        self.what = _wrap()
        self.bar = QProgressBar()
        self.bar.setRange(0, 1000)
        self.status = _wrap()
        self.error = _wrap()
        self.error.setStyleSheet("color: #b00020;")
        self.cancel = QPushButton("Cancel the download")
        self.cancel.clicked.connect(ctl.cancel_download)
        self.retry = QPushButton("Try again")
        self.retry.clicked.connect(self._start)
        self.retry.hide()
        self.embedded = QPushButton("Use the model that comes with PolyStrata")
        self.embedded.setToolTip("Qwen2.5-Coder 0.5B Instruct: small, nothing to download")
        self.embedded.clicked.connect(self._use_embedded)
        self.embedded.hide()
        buttons = QHBoxLayout()
        buttons.addWidget(self.cancel)
        buttons.addWidget(self.retry)
        buttons.addWidget(self.embedded)
        buttons.addStretch(1)
        layout = QVBoxLayout(self)
        layout.addWidget(self.what)
        layout.addWidget(self.bar)
        layout.addWidget(self.status)
        layout.addWidget(self.error)
        layout.addLayout(buttons)
        layout.addStretch(1)
        ctl.downloadProgress.connect(self._on_progress)
        ctl.downloadFinished.connect(self._on_finished)
        ctl.downloadFailed.connect(self._on_failed)

    def initializePage(self) -> None:
        m = self.ctl.model
        if isinstance(m, LocalModel):
            self.what.setText(f"Nothing to download: the model is the file {m.path} on this PC.")
        elif isinstance(m, CatalogEntry) and m.package:
            self.what.setText(
                f"{m.display_name} comes with PolyStrata (package {m.package}): it is written out, not downloaded."
            )
        else:
            self.what.setText(
                f"Downloading {self.ctl.model_name} into {self.ctl.model_path.parent if self.ctl.model_path else '?'}"
            )
        if not self.ctl.downloaded:
            self._start()
        else:
            self._on_finished(str(self.ctl.model_path))

    def isComplete(self) -> bool:
        return self.ctl.downloaded

    def _start(self) -> None:
        self.error.clear()
        self.retry.hide()
        self.cancel.show()
        self.status.setText("Starting…")
        self.ctl.start_download()

    def _on_progress(self, e: object) -> None:
        if not isinstance(e, DownloadEvent):
            return
        if e.all_total:
            self.bar.setValue(int(1000 * e.all_done / e.all_total))
        rate = f"{e.rate / 1e6:.1f} MB/s" if e.rate else "–"
        eta = f"{int(e.eta_s) // 60} min {int(e.eta_s) % 60:02d} s" if e.eta_s is not None else "–"
        total = size_text(e.all_total) if e.all_total else "?"
        line = f"[{e.file_index + 1}/{e.file_count}] {e.file}: {size_text(e.all_done)} of {total} · {rate} · ETA {eta} · {e.state.value}"
        if e.message and e.state in (DownloadState.STALLED, DownloadState.RETRYING, DownloadState.STARTING):
            line += f" – {e.message}"
        self.status.setText(line)

    def _on_finished(self, path: str) -> None:
        self.bar.setValue(1000)
        self.cancel.hide()
        self.status.setText(f"Ready: {path}")
        self.completeChanged.emit()

    def _on_failed(self, message: str) -> None:
        self.cancel.hide()
        self.retry.show()
        self.embedded.setVisible(not self.ctl.is_embedded)
        self.error.setText(f"{message[:1].upper()}{message[1:]}")
        self.completeChanged.emit()

    def _use_embedded(self) -> None:
        problem = self.ctl.use_embedded()
        if problem:
            self.error.setText(problem)
            return
        self.embedded.hide()
        self.initializePage()


class SplitPage(QWizardPage):
    def __init__(self, ctl: WizardController) -> None:
        super().__init__()
        self.ctl = ctl
        self.setTitle("Split preview")
        self.setSubTitle(
            "Which layers sit on which card (an estimate; the engine logs the real split when it loads)."
        )
        self.picture = SplitPicture()
        self.lines = _wrap()
        self.lines.setFont(QFontDatabase.systemFont(QFontDatabase.SystemFont.FixedFont))
        layout = QVBoxLayout(self)
        layout.addWidget(self.picture)
        layout.addWidget(self.lines)
        layout.addStretch(1)

    def initializePage(self) -> None:
        fit = self.ctl.fit()
        m = self.ctl.model
        if fit is not None and isinstance(m, CatalogEntry):
            segs = [
                Segment(
                    c.begin,
                    c.end,
                    f"GPU {c.gpu.index} · {c.gpu.name.removeprefix('NVIDIA ').removeprefix('GeForce ')}",
                    f"experts in VRAM {c.experts_in_vram} of {c.experts_total}"
                    if c.experts_total
                    else "dense",
                    head=c.last,
                )
                for c in fit.cards
            ]
            self.picture.set_split(m.layers, segs)
        elif isinstance(m, CatalogEntry) and not self.ctl.gpus:
            self.picture.set_split(
                m.layers, [Segment(0, m.layers, "CPU (host RAM)", "all layers", head=True)]
            )
        else:
            self.picture.set_split(0, [])
            self.picture.empty_text = "The engine plans the split of this file when it loads it."
        self.lines.setText("\n".join(self.ctl.fit_lines()))


class DonePage(QWizardPage):
    def __init__(self, ctl: WizardController) -> None:
        super().__init__()
        self.ctl = ctl
        self.setTitle("Done")
        self.summary = _wrap()
        self.summary.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.start = QCheckBox("Start the engine now")
        self.start.setChecked(True)
        layout = QVBoxLayout(self)
        layout.addWidget(self.summary)
        layout.addWidget(self.start)
        layout.addStretch(1)

    def initializePage(self) -> None:
        cards = " + ".join(g.short for g in self.ctl.gpus) or "the CPU (no GPU)"
        self.summary.setText(
            f"Model: {self.ctl.model_name}\nFile: {self.ctl.model_path}\nRuns on: {cards}\n"
            f"Config: {self.ctl.config_path}\n\n"
            "The engine serves an OpenAI-compatible API on this PC; the tray icon and the main window start and stop "
            "it, and the chat window talks to it. You can run this wizard again from Settings."
        )


class SetupWizard(QWizard):
    setupDone = Signal(str, bool)
    """The config written, and whether to start the engine now."""

    def __init__(self, ctl: WizardController, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.ctl = ctl
        self.setWindowTitle("PolyStrata setup")
        self.setWindowIcon(app_icon())
        self.setWizardStyle(QWizard.WizardStyle.ModernStyle)
        self.gpu_page = GpuPage(ctl)
        self.model_page = ModelPage(ctl)
        self.download_page = DownloadPage(ctl)
        self.split_page = SplitPage(ctl)
        self.done_page = DonePage(ctl)
        for page in (self.gpu_page, self.model_page, self.download_page, self.split_page, self.done_page):
            self.addPage(page)
        self.resize(820, 600)
        self.accepted.connect(self._on_accepted)
        self.rejected.connect(ctl.cancel_download)

    def _on_accepted(self) -> None:
        self.setupDone.emit(str(self.ctl.config_path or ""), self.done_page.start.isChecked())

"""The Models tab: the models on this PC with size, architecture, quantization, fit here and where they are; serve
one (the engine restarts on it), show it in its folder, delete it; more come from the setup wizard's catalog."""

from PySide6.QtCore import Qt, QUrl, Signal
from PySide6.QtGui import QDesktopServices
from PySide6.QtWidgets import (
    QAbstractItemView,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QMessageBox,
    QPushButton,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from app.controllers.library import LibraryController
from app.controllers.wizard import size_text
from installer import library

COLUMNS = ("Model", "Architecture", "Quant", "Size", "Fit on this PC", "Where")


class LibraryPage(QWidget):
    wizardRequested = Signal()  # "Get more models": the setup wizard's catalog and download

    def __init__(self, lib: LibraryController, ask: bool = True) -> None:
        super().__init__()
        self.lib = lib
        self._ask = ask  # confirm deletes (tests answer for the user)
        self.table = QTableWidget(0, len(COLUMNS))
        self.table.setHorizontalHeaderLabels(COLUMNS)
        self.table.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
        self.table.setSelectionMode(QAbstractItemView.SelectionMode.SingleSelection)
        self.table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.table.verticalHeader().hide()
        header = self.table.horizontalHeader()
        header.setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
        header.setSectionResizeMode(len(COLUMNS) - 1, QHeaderView.ResizeMode.Stretch)
        self.table.itemSelectionChanged.connect(self._update_buttons)
        self.table.itemDoubleClicked.connect(lambda _i: self._serve())
        self.serve_button = QPushButton("Serve this model")
        self.reveal_button = QPushButton("Show in folder")
        self.delete_button = QPushButton("Delete…")
        self.refresh_button = QPushButton("Look again")
        self.more_button = QPushButton("Get more models…")
        self.serve_button.clicked.connect(self._serve)
        self.reveal_button.clicked.connect(self._reveal)
        self.delete_button.clicked.connect(self._delete)
        self.refresh_button.clicked.connect(lib.refresh)
        self.more_button.clicked.connect(self.wizardRequested)
        self.status = QLabel()
        self.status.setWordWrap(True)
        buttons = QHBoxLayout()
        for b in (self.serve_button, self.reveal_button, self.delete_button):
            buttons.addWidget(b)
        buttons.addStretch(1)
        buttons.addWidget(self.refresh_button)
        buttons.addWidget(self.more_button)
        layout = QVBoxLayout(self)
        layout.addWidget(self.table, 1)
        layout.addLayout(buttons)
        layout.addWidget(self.status)
        lib.changed.connect(self.refresh)
        self.refresh()

    def selected(self) -> library.ModelFile | None:
        rows = self.table.selectionModel().selectedRows()
        return self.lib.models[rows[0].row()] if rows and rows[0].row() < len(self.lib.models) else None

    def refresh(self) -> None:
        lib = self.lib
        keep = self.selected()
        served = lib.served
        self.table.setRowCount(len(lib.models))
        for r, m in enumerate(lib.models):
            fit = lib.fits.get(m.path)
            name = m.name + ("  (serving)" if served is not None and m.path == served else "")
            cells = (name, m.architecture, m.quant, size_text(m.size), lib.fit_label(m), str(m.path.parent))
            for c, text in enumerate(cells):
                item = QTableWidgetItem(text)
                if c == 4 and fit is not None:
                    item.setToolTip("\n".join(fit.lines))
                    if not fit.fits:
                        item.setForeground(Qt.GlobalColor.darkRed)
                self.table.setItem(r, c, item)
            if keep is not None and m.path == keep.path:
                self.table.selectRow(r)
        if lib.problem:
            self.status.setText(lib.problem[:1].upper() + lib.problem[1:])
        elif lib.scanning:
            self.status.setText("Looking for models…")
        elif not lib.models:
            self.status.setText(
                "No model files in the models folder yet: the engine serves the embedded one. Get more models "
                "from the catalog."
            )
        else:
            self.status.setText(f"{len(lib.models)} model(s). Double-click one to serve it.")
        self._update_buttons()

    def _update_buttons(self) -> None:
        m = self.selected()
        for b in (self.serve_button, self.reveal_button, self.delete_button):
            b.setEnabled(m is not None)

    def _serve(self) -> None:
        m = self.selected()
        if m is not None:
            self.lib.serve(m)
            self.status.setText(f"Serving {m.name}: the engine restarts on it.")

    def _reveal(self) -> None:
        m = self.selected()
        if m is not None:
            QDesktopServices.openUrl(QUrl.fromLocalFile(str(m.path.parent)))

    def _delete(self) -> None:
        m = self.selected()
        if m is None:
            return
        if self._ask:
            answer = QMessageBox.question(
                self, "Delete the model?", f"Delete {m.path.name} ({size_text(m.size)}) from this PC?"
            )
            if answer != QMessageBox.StandardButton.Yes:
                return
        problem = self.lib.delete(m)
        self.status.setText(problem[:1].upper() + problem[1:] if problem else f"Deleted {m.path.name}.")

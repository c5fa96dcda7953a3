"""`LibraryController`: the models on this PC (installer.library) with each one's fit here, and the actions on them:
serve one (the engine restarts on it), delete one, show where it is. The Models page, the chat window's picker and
the tray's Model menu all use it."""

from collections.abc import Callable
from pathlib import Path

from PySide6.QtCore import QObject, Signal

from app.controllers.background import run_in_thread
from installer import library, recommend, rules
from installer.catalog import Catalog, geometry, load_catalog
from installer.gpus import GpuInfo, ProbeResult, probe
from installer.paths import data_dir, models_dir

FIT_CONTEXT = 8192  # the context the fit labels assume


class LibraryController(QObject):
    changed = Signal()
    serveRequested = Signal(str)  # a model file's path: the app saves it as the model and restarts the engine

    def __init__(
        self,
        served: Callable[[], str],
        probe_fn: Callable[[], ProbeResult] = probe,
        catalog: Catalog | None = None,
        folders: Callable[[], list[Path]] = lambda: [models_dir()],
        ram_bytes: Callable[[], int] = recommend.this_pc_ram,
        parent: QObject | None = None,
    ) -> None:
        super().__init__(parent)
        self._served = served
        self._probe_fn = probe_fn
        self.catalog = catalog or load_catalog()
        self._folders = folders
        self._ram_bytes = ram_bytes
        self.models: list[library.ModelFile] = []
        self.fits: dict[Path, recommend.PcFit | None] = {}
        self.gpus: tuple[GpuInfo, ...] = ()
        self.scanning = False
        self.problem = ""

    @property
    def served(self) -> Path | None:
        """The model file the engine serves (or is set to serve), None for the embedded default."""
        got = self._served()
        return Path(got).resolve() if got else None

    def refresh(self) -> None:
        """Scan the models folder (and the served file) in the background; `changed` when done."""
        if self.scanning:
            return
        self.scanning = True
        served = self.served
        run_in_thread(
            lambda: self._scan([served] if served is not None else []), self._on_scan, self._on_failed
        )

    def _scan(self, extra: list[Path]) -> tuple[list[library.ModelFile], tuple[GpuInfo, ...]]:
        result = self._probe_fn()
        choices = recommend.choices(rules.assess(result.gpus)) if result.ok else []
        gpus = choices[0].gpus if choices else ()
        return library.scan(self._folders(), self.catalog, extra, data_dir() / library.INDEX), gpus

    def _on_scan(self, got: object) -> None:
        self.scanning = False
        self.models, self.gpus = got  # type: ignore[misc]
        ram = self._ram_bytes()
        self.fits = {}
        for m in self.models:
            entry = library.catalog_entry(m, self.catalog)
            self.fits[m.path] = (
                recommend.pc_fit(geometry(entry), m.size, self.gpus, ram, min(entry.context, FIT_CONTEXT))
                if entry is not None
                else None
            )
        self.problem = ""
        self.changed.emit()

    def _on_failed(self, message: str) -> None:
        self.scanning = False
        self.problem = f"the models folder could not be read: {message}"
        self.changed.emit()

    def fit_label(self, model: library.ModelFile) -> str:
        fit = self.fits.get(model.path)
        return fit.label if fit is not None else "fit checked when it loads"

    def serve(self, model: library.ModelFile) -> None:
        """Make `model` the one the engine serves (the app saves it and restarts the engine on it)."""
        self.serveRequested.emit(str(model.path))

    def delete(self, model: library.ModelFile) -> str | None:
        """Remove the model's files; refused (with the reason) for the one being served."""
        if self.served is not None and model.path == self.served:
            return f"{model.path.name} is the model being served: serve another one first"
        try:
            library.delete(model)
        except OSError as e:
            return f"{model.path} could not be deleted ({e})"
        self.models = [m for m in self.models if m.path != model.path]
        self.fits.pop(model.path, None)
        self.changed.emit()
        return None

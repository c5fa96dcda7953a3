"""`WorkerPlanController`: putting a model's later layers on worker PCs from the main PC's window.

The user ticks this PC's card and one card on each paired worker PC; the plan (installer.pc_plan.plan_pcs, the
engine's placement) shows each PC's layers and experts in VRAM. "Apply" ships each worker PC the layers it needs
(`strata-node ship`, resumable, verified by SHA-256, a progress line per percent), writes the config with its
"workers", and hands the config to the app, which restarts the engine: the engine controller starts the stages
on the worker PCs first (app/controllers/worker_stages.py). "Stop using worker PCs" writes the config without them.

With `tune` on, Apply runs the tuner instead of the plain copy (`strata-node tune --json`: it ships each worker PC
the layers of every split it tries, then measures the plan's split and its neighbours with the tuner's workload),
shows its progress and log, and keeps its report; the config it writes holds the fastest split.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from PySide6.QtCore import QObject, QProcess, Signal

from app.clients.node_client import AgentInfo, NodeClient
from app.controllers.nodes import NodesController
from installer.config import ConfigError, StrataConfig, config_path, read_config, write_config
from installer.gguf_geometry import GeometryError, file_geometry
from installer.pc_plan import PcCard, PcPlan, PlanError, agent_cards, plan_pcs, tune_splits
from installer.placement import MIN_CC
from installer.recommend import ModelGeometry

PLAN_CONTEXT = 8192  # the context the plan prices where the settings name none


@dataclass(frozen=True)
class CardChoice:
    card: PcCard
    agent: AgentInfo | None  # None: this PC
    chosen: bool

    @property
    def key(self) -> tuple[str, int]:
        return (self.card.host, self.card.gpu.index)


class WorkerPlanController(QObject):
    changed = Signal()
    applied = Signal(str)
    """The config that was written (its path): the engine is to be restarted on it."""
    tuned = Signal(str)
    """The tuner's report (its path), once a tuning run has ended."""

    def __init__(
        self,
        nodes: NodesController,
        client: NodeClient,
        model: Callable[[], str],
        config: Callable[[], str],
        context: Callable[[], int] = lambda: 0,
        on_cpu: Callable[[], bool] = lambda: False,
        tune_args: list[str] | None = None,
        parent: QObject | None = None,
    ) -> None:
        super().__init__(parent)
        self.nodes = nodes
        self.client = client
        self._model = model
        self._config = config
        self._context = context
        self._on_cpu = on_cpu
        self._chosen: list[tuple[str, int]] = []
        self._geometry: tuple[str, ModelGeometry | str] | None = None
        self.plan: PcPlan | None = None
        self.problem = ""
        self.busy = ""
        """What Apply is doing now ("" when idle)."""
        self.percent = -1
        self._steps: list[tuple[AgentInfo, int, int]] = []
        self._ship: QProcess | None = None
        self._ship_ok = False
        self._plan_applied: PcPlan | None = None
        self.tune = False
        """Apply measures splits around the plan first (the tuner) and keeps the fastest."""
        self.tune_args = list(tune_args or [])
        """More `strata-node tune` flags: its workload (--chunk, --mix, --answer-tokens), then -- and worker flags."""
        self.tune_shifts = 2
        """How far each boundary moves either way among the splits measured (installer.pc_plan.tune_splits)."""
        self.tune_log: list[str] = []
        self.report = ""
        """The last tuning run's report (a Markdown file), "" before one."""
        self.warnings: list[str] = []
        """The last tuning run's warnings (a Windows worker PC whose clocks are not locked, ...)."""
        self._tune_result: dict = {}
        self.clock_notes: dict[tuple[str, int], str] = {}
        """Per card (host, index): what the last clock lock said."""
        nodes.changed.connect(self.replan)

    # -- what can be chosen ------------------------------------------------------------------------------------

    def choices(self) -> list[CardChoice]:
        """This PC's cards, then each paired, included worker PC's cards, each with whether it is ticked (cards
        older than the engine supports are left out)."""
        out = [CardChoice(PcCard("this PC", g), None, False) for g in self.nodes.gpus]
        for a in self.nodes.agents:
            if a.paired and a.included and a.reachable:
                host = a.host or a.address.rsplit(":", 1)[0].strip("[]")
                out += [CardChoice(c, a, False) for c in agent_cards(a.name, host, a.port, a.cards)]
        out = [c for c in out if c.card.gpu.compute_capability >= MIN_CC]
        keys = self._chosen_keys(out)
        return [CardChoice(c.card, c.agent, c.key in keys) for c in out]

    def _chosen_keys(self, choices: list[CardChoice]) -> list[tuple[str, int]]:
        there = {c.key for c in choices}
        keys = [k for k in self._chosen if k in there]
        if not any(k[0] == "" for k in keys):  # this PC's first card unless another is ticked
            local = next((c.key for c in choices if c.agent is None), None)
            keys = ([local] if local else []) + keys
        return keys

    def set_chosen(self, choice: CardChoice, on: bool) -> None:
        """Tick or untick a card: one card per PC (ticking another card of the same PC moves the tick)."""
        keys = [k for k in self._chosen_keys(self.choices()) if k[0] != choice.card.host]
        if on:
            keys.append(choice.key)
        local = [k for k in keys if k[0] == ""]
        self._chosen = local + [k for k in keys if k[0] != ""]  # this PC runs the first layers
        self.replan()

    def chosen_cards(self) -> list[PcCard]:
        """The ticked cards in stage order (this PC's first, then the worker PCs as they were ticked)."""
        choices = self.choices()
        by_key = {c.key: c.card for c in choices}
        return [by_key[k] for k in self._chosen_keys(choices)]

    # -- the plan ----------------------------------------------------------------------------------------------

    def model_path(self) -> str:
        return self._model()

    def geometry(self) -> ModelGeometry | str:
        """The served model's geometry, or why it cannot be planned (read once per file)."""
        path = self.model_path()
        if not path or not Path(path).is_file():
            return "choose a model file first (Models tab): the built-in model runs on this PC only"
        if self._geometry is None or self._geometry[0] != path:
            try:
                self._geometry = (path, file_geometry(Path(path)))
            except GeometryError as e:
                self._geometry = (path, str(e))
        return self._geometry[1]

    def replan(self) -> None:
        self.plan, self.problem = None, ""
        cards = self.chosen_cards()
        if len(cards) > 1:
            g = self.geometry()
            if isinstance(g, str):
                self.problem = g
            else:
                try:
                    self.plan = plan_pcs(g, cards, self._context() or PLAN_CONTEXT)
                except (PlanError, ValueError) as e:
                    self.problem = str(e)
        self.changed.emit()

    def using_workers(self) -> bool:
        """Whether the config the engine runs names worker PCs."""
        cfg = self._read_config()
        return cfg is not None and bool(cfg.workers)

    def _read_config(self) -> StrataConfig | None:
        path = self._config()
        if not path or not Path(path).is_file():
            return None
        try:
            return read_config(Path(path))
        except ConfigError:
            return None

    # -- apply -------------------------------------------------------------------------------------------------

    def apply(self) -> bool:
        """Ship each worker PC its layers, then write the config (`applied`). False when there is nothing to
        apply (no plan, one that does not fit, or Apply already running)."""
        plan = self.plan
        if plan is None or self.busy:
            return False
        if not plan.fits:
            self.problem = "the model does not fit these cards at this context: tick another card or PC"
            self.changed.emit()
            return False
        agents = {(c.card.host, c.card.gpu.index): c.agent for c in self.choices() if c.agent is not None}
        self._steps = [(agents[(s.card.host, s.card.gpu.index)], s.begin, s.end) for s in plan.stages[1:]]  # type: ignore[misc]
        self._plan_applied = plan
        self.problem = ""
        if self.tune:
            self._start_tuner(plan, [a for a, _, _ in self._steps])
        else:
            self._next_step()
        return True

    def _start_tuner(self, plan: PcPlan, agents: list[AgentInfo]) -> None:
        """The plan's config first (the tuner keeps its card, KV type and flags), then `strata-node tune`."""
        self._steps = []
        target = self._target()
        try:
            write_config(plan.config(self.model_path(), self._read_config(), self._on_cpu()), target)
        except (ConfigError, OSError) as e:
            self._fail(f"the config {target} could not be written ({e})")
            return
        args = [
            "tune",
            "--model",
            self.model_path(),
            "--config",
            str(target),
            "--max-context",
            str(plan.context),
        ]
        for a in agents:
            args += ["--node", a.fingerprint or a.name]
        for split in tune_splits(plan, self.tune_shifts):
            args += ["--split", ",".join(map(str, split))]
        if self._on_cpu():
            args += ["--device", "cpu"]
        self.tune_log, self.report, self.warnings = [], "", []
        self.busy, self.percent = "Measuring the splits…", 0
        self._tune_result = {}
        self.changed.emit()
        self._ship = self.client.stream_json(args + self.tune_args, self._on_tune_line, self._on_tune_end)

    def _on_tune_line(self, data: dict) -> None:
        if isinstance(data.get("log"), str):
            self.tune_log.append(data["log"])
            if len(self.tune_log) > 500:
                del self.tune_log[:100]
        p = data.get("progress")
        if isinstance(p, dict) and p.get("total"):
            pct = int(p.get("done", 0)) * 100 // max(int(p["total"]), 1)
            if p.get("what") == "ship":
                self.busy = "Sending the layers the splits need…"
            else:
                self.busy = f"Measuring the splits ({p.get('done')} of {p.get('total')} measurements)…"
            self.percent = pct
        if "best_split" in data:
            self._tune_result = data
        self.changed.emit()

    def _on_tune_end(self, message: str) -> None:
        self._ship = None
        res = self._tune_result
        self.report = str(res.get("report") or "")
        self.warnings = [str(w) for w in res.get("warnings") or []]
        if self.report:
            self.tuned.emit(self.report)
        if not res.get("best_split") or not res.get("config"):
            self._fail(f"tuning failed: {message}" + (f" (report: {self.report})" if self.report else ""))
            return
        self.busy, self.percent = "", -1
        self.changed.emit()
        self.applied.emit(str(res["config"]))

    def _next_step(self) -> None:
        if not self._steps:
            self._write(self._plan_applied)
            return
        agent, begin, end = self._steps.pop(0)
        self.busy = f"Sending layers {begin}-{end - 1} to {agent.name}…"
        self.percent = 0
        self._ship_ok = False
        self.changed.emit()
        args = ["ship", agent.fingerprint or agent.name, "--model", self.model_path()]
        args += ["--begin", str(begin), "--end", str(end)]
        self._ship = self.client.stream_json(args, self._on_ship_line, self._on_ship_end)

    def _on_ship_line(self, data: dict) -> None:
        p = data.get("progress")
        if isinstance(p, dict) and p.get("total"):
            self.percent = int(p.get("done", 0)) * 100 // max(int(p["total"]), 1)
            self.changed.emit()
        elif isinstance(data.get("ship"), dict):
            self._ship_ok = True

    def _on_ship_end(self, message: str) -> None:
        self._ship = None
        if self._ship_ok:
            self._next_step()
            return
        self._fail(f"sending the layers failed: {message}")

    def _fail(self, message: str) -> None:
        self.busy, self.percent, self._steps = "", -1, []
        self.problem = message
        self.changed.emit()

    def cancel(self) -> None:
        if self._ship is not None:
            self.client.stop_stream(self._ship)
            self._ship = None
            self._fail("cancelled: Apply again to continue where it stopped (layers already sent are kept)")

    def _write(self, plan: PcPlan | None) -> None:
        """The config with the plan's workers (None: without workers), then `applied`."""
        model = self.model_path()
        base = self._read_config()
        if plan is None:
            cfg = dataclasses.replace(base, model=model, workers=()) if base else StrataConfig(model=model)
        else:
            cfg = plan.config(model, base, self._on_cpu())
        target = self._target()
        try:
            path = write_config(cfg, target)
        except (ConfigError, OSError) as e:
            self._fail(f"the config {target} could not be written ({e})")
            return
        self.busy, self.percent = "", -1
        self.changed.emit()
        self.applied.emit(str(path))

    # -- Windows worker PCs' clocks ----------------------------------------------------------------------------

    def windows_cards(self) -> list[CardChoice]:
        """The ticked cards on worker PCs that run Windows: Windows lowers an idle GPU's clocks between decode
        steps, so these are flagged with a one-click lock."""
        return [
            c
            for c in self.choices()
            if c.chosen and c.agent is not None and c.agent.os.lower().startswith("windows")
        ]

    def lock_clocks(self, choice: CardChoice) -> None:
        """Lock that card's clocks through its agent (`strata-node clocks NODE --lock`); `clock_notes` then says
        how it went (the agent needs administrator rights; the note says so where it has none)."""
        agent = choice.agent
        if agent is None:
            return
        key = choice.key
        self.clock_notes[key] = "locking…"
        self.changed.emit()

        def done(data: dict) -> None:
            self.clock_notes[key] = str((data.get("clocks") or {}).get("detail") or "locked")
            self.changed.emit()

        def failed(message: str) -> None:
            self.clock_notes[key] = message if "NOT locked" in message else f"NOT locked: {message}"
            self.changed.emit()

        self.client.set_clocks(agent.fingerprint or agent.name, choice.card.gpu.index, True, done, failed)

    def _target(self) -> Path:
        return Path(self._config()) if self._config() else config_path(self.model_path())

    def stop_using(self) -> None:
        """Run the model on this PC alone again: the config without its workers (`applied`)."""
        if not self.busy:
            self._write(None)

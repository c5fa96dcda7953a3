"""`RemoteGpus`: the worker PCs' GPU clock state for the charts, and locking a card's clocks (remote or local).

For each paired, included worker PC it keeps one `strata-node samples NODE --follow --json` running (the agent's own
encrypted client): a first line with the cards (name, top SM clock, VRAM), then one line per batch the agent
sampled (every 100 ms there), as soon as it has one. They become the same `GpuSample`s the local sampler makes,
with the PC's name as `host`. A stream that ends (PC off, agent stopped, network) is retried every few seconds and
its reason is shown. Locking goes through `strata-node clocks`: through the agent for a worker PC's card, through
NVML in a `--here` process for this PC's; a refusal (no administrator / root rights) comes back with what to do.
"""

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from PySide6.QtCore import QObject, QProcess, QTimer, Signal

from app.clients.node_client import AgentInfo, NodeClient
from app.controllers.gpu_sampler import CLOCK_EVENT_REASONS, GpuSample

RETRY_S = 5.0
# The agent's names for the clock-event reasons (engine/node/gpu.py), in NVML's bit order (CLOCK_EVENT_REASONS).
AGENT_REASONS = (
    "gpu_idle",
    "applications_clocks",
    "sw_power_cap",
    "hw_slowdown",
    "sync_boost",
    "sw_thermal",
    "hw_thermal",
    "hw_power_brake",
    "display_clocks",
)
_REASON_BIT = {name: bit for name, (bit, _) in zip(AGENT_REASONS, CLOCK_EVENT_REASONS, strict=True)}


def reason_mask(names: Any) -> int:
    """The agent's reason names -> NVML's bit mask (unknown names are left out)."""
    if not isinstance(names, list):
        return 0
    return sum(_REASON_BIT.get(str(n), 0) for n in set(names))


def _num(v: Any) -> int:
    return int(v) if isinstance(v, int | float) and not isinstance(v, bool) else 0


def samples_from(host: str, facts: dict[int, dict], batch: list[dict], now: float) -> list[GpuSample]:
    """One batch of an agent's samples as GpuSamples on this PC's clock: the newest sample counts as `now` (the agent
    answers as soon as it has one), the others keep their distance to it, so the two PCs' clocks need not agree."""
    rows = [x for x in batch if isinstance(x, dict) and isinstance(x.get("index"), int)]
    if not rows:
        return []
    newest = max(float(x.get("t") or 0.0) for x in rows)
    out = []
    for x in rows:
        f = facts.get(int(x["index"]), {})
        pstate = x.get("pstate")
        out.append(
            GpuSample(
                t=now - (newest - float(x.get("t") or newest)),
                index=int(x["index"]),
                name=str(f.get("name") or "GPU"),
                sm_mhz=_num(x.get("sm_mhz")),
                mem_mhz=_num(x.get("mem_mhz")),
                max_sm_mhz=_num(f.get("max_sm_mhz")),
                max_mem_mhz=0,  # the agent reports the top SM clock only
                pstate=int(pstate) if isinstance(pstate, int) and 0 <= pstate <= 15 else 32,
                reasons=reason_mask(x.get("reasons")),
                util=_num(x.get("util_gpu")),
                vram_used=_num(x.get("vram_used")),
                vram_total=_num(f.get("vram_total")),
                host=host,
            )
        )
    return out


def node_ref(agent: AgentInfo) -> str:
    """How `strata-node` finds a paired PC: its key fingerprint (unique), else its name."""
    return agent.fingerprint or agent.name


@dataclass
class _Watch:
    agent: AgentInfo
    proc: QProcess | None = None
    facts: dict[int, dict] = field(default_factory=dict)
    retry_at: float | None = None


class RemoteGpus(QObject):
    sampled = Signal(list)
    """list[GpuSample] of one worker PC."""
    problemsChanged = Signal(dict)
    """{PC name: why its GPUs are not shown} for every worker PC whose samples do not come."""
    clocksDone = Signal(str, bool, str)
    """(the card's sample key, locked or reset as asked, the agent's words)"""

    def __init__(
        self,
        client: NodeClient,
        clock: Callable[[], float] = time.monotonic,
        retry_s: float = RETRY_S,
        parent: QObject | None = None,
    ) -> None:
        super().__init__(parent)
        self.client = client
        self.clock = clock
        self.retry_s = retry_s
        self.watches: dict[str, _Watch] = {}
        self.problems: dict[str, str] = {}
        self._retry = QTimer(self)
        self._retry.setInterval(500)
        self._retry.timeout.connect(self._retry_due)

    # -- which PCs -------------------------------------------------------------------------------------------

    def watch(self, agents: list[AgentInfo]) -> None:
        """Follow the GPUs of the paired, included PCs among `agents`; stop following the others."""
        wanted = {node_ref(a): a for a in agents if a.paired and a.included}
        for ref in [r for r in self.watches if r not in wanted]:
            self._drop(ref)
        for ref, agent in wanted.items():
            w = self.watches.get(ref)
            if w is None:
                self.watches[ref] = _Watch(agent)
                self._start(ref)
            else:
                w.agent = agent
        if self.watches:
            self._retry.start()
        else:
            self._retry.stop()

    def stop(self) -> None:
        for ref in list(self.watches):
            self._drop(ref)
        self._retry.stop()

    def _drop(self, ref: str) -> None:
        w = self.watches.pop(ref)
        if w.proc is not None:
            self.client.stop_stream(w.proc)
        if self.problems.pop(w.agent.name, None) is not None:
            self.problemsChanged.emit(dict(self.problems))

    def _start(self, ref: str) -> None:
        w = self.watches[ref]
        w.retry_at = None
        w.proc = self.client.stream_json(
            ["samples", ref, "--follow"],
            lambda data, ref=ref: self._on_line(ref, data),
            lambda why, ref=ref: self._on_end(ref, why),
        )

    def _retry_due(self) -> None:
        now = self.clock()
        for ref, w in list(self.watches.items()):
            if w.proc is None and w.retry_at is not None and now >= w.retry_at:
                self._start(ref)

    # -- what the streams say --------------------------------------------------------------------------------

    def _on_line(self, ref: str, data: dict) -> None:
        w = self.watches.get(ref)
        if w is None:
            return
        if isinstance(data.get("gpus"), list):
            w.facts = {int(g["index"]): g for g in data["gpus"] if isinstance(g, dict) and "index" in g}
            why = "" if w.facts else f"no GPU to show: {data.get('message') or 'the agent reports none'}"
            self._set_problem(w.agent.name, why)
        if isinstance(data.get("samples"), list):
            got = samples_from(w.agent.name, w.facts, data["samples"], self.clock())
            if got:
                self._set_problem(w.agent.name, "")
                self.sampled.emit(got)

    def _on_end(self, ref: str, why: str) -> None:
        w = self.watches.get(ref)
        if w is None:
            return
        w.proc = None
        w.retry_at = self.clock() + self.retry_s
        self._set_problem(w.agent.name, f"no GPU samples from {w.agent.address}: {why}")

    def _set_problem(self, name: str, why: str) -> None:
        if self.problems.get(name, "") == why:
            return
        if why:
            self.problems[name] = why
        else:
            self.problems.pop(name, None)
        self.problemsChanged.emit(dict(self.problems))

    # -- locking clocks --------------------------------------------------------------------------------------

    def set_clocks(self, sample: GpuSample, lock: bool = True) -> None:
        """Lock (or reset) the clocks of the card `sample` came from; the answer comes as `clocksDone`."""
        key = sample.key
        ref: str | None = None
        if sample.host:
            ref = next((r for r, w in self.watches.items() if w.agent.name == sample.host), None)
            if ref is None:
                text = f"{sample.host} is no longer a paired, included worker PC: its clocks cannot be changed here"
                self.clocksDone.emit(key, False, text)
                return
        self.client.set_clocks(
            ref,
            sample.index,
            lock,
            lambda data: self.clocksDone.emit(
                key, True, str((data.get("clocks") or {}).get("detail") or "done")
            ),
            lambda message: self.clocksDone.emit(key, False, message),
        )

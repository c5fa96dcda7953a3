"""`NodesController`: the worker PCs page's state: this PC's cards, the node agent here (and whether it starts at
log-in), the worker PCs found."""

import platform
from collections.abc import Callable
from dataclasses import dataclass

from PySide6.QtCore import QObject, Signal

from app.clients.node_client import AgentInfo, NodeClient
from app.controllers.background import run_in_thread
from installer.autostart import Autostart, for_this_os
from installer.gpus import ProbeResult, probe
from installer.rules import assess, assess_others


@dataclass(frozen=True)
class CardLine:
    text: str
    usable: bool


def card_lines(result: ProbeResult) -> tuple[list[CardLine], str]:
    """The seed's listing (`GPU 0: ..., 16 GB VRAM - can be used`) and, where there is no card, the reason."""
    lines = [CardLine(a.line(), a.can_run_alone) for a in assess(result.gpus)]
    lines += [CardLine(o.line(), False) for o in assess_others(result.others, has_nvidia=bool(result.gpus))]
    return lines, ("" if result.ok else result.message)


class NodesController(QObject):
    changed = Signal()
    agentOutput = Signal(str)

    def __init__(
        self,
        client: NodeClient,
        probe_fn: Callable[[], ProbeResult] = probe,
        autostart: Autostart | None = None,
        parent: QObject | None = None,
    ) -> None:
        super().__init__(parent)
        self.client = client
        self._probe_fn = probe_fn
        self.autostart = autostart if autostart is not None else for_this_os()
        self.autostart_problem = ""
        self.host_name = platform.node() or "this PC"
        self.cards: list[CardLine] = []
        self.gpus: tuple = ()
        """This PC's cards (installer.gpus.GpuInfo), for planning a split across PCs."""
        self.cards_message = "Looking for GPUs…"
        self.agents: list[AgentInfo] = []
        self.problem = ""
        """The last worker-PC command's failure (pairing, include, discovery), shown on the page."""
        client.serveSupport.connect(lambda *_: self.changed.emit())
        client.localStateChanged.connect(lambda *_: self.changed.emit())
        client.localOutput.connect(self.agentOutput)
        client.agentsChanged.connect(self._on_agents)
        client.localInfoChanged.connect(lambda *_: self.changed.emit())
        client.commandFailed.connect(self._on_problem)

    @property
    def serve_supported(self) -> bool | None:
        return self.client.serve_supported

    @property
    def serve_detail(self) -> str:
        return self.client.serve_detail

    @property
    def local_state(self) -> str:
        return self.client.local_state

    @property
    def local_info(self) -> dict:
        return self.client.local_info

    @property
    def refreshing(self) -> bool:
        return self.client.refreshing

    def pair(self, address: str, code: str, fingerprint: str) -> str | None:
        """Pair with a worker PC; returns what is missing in the input, or None (the answer comes later)."""
        if not address.strip() or not code.strip() or not fingerprint.strip():
            return (
                "give the worker PC's address, the pairing code and the key fingerprint that its agent shows"
            )
        self.problem = ""
        self.client.pair(address.strip(), code.strip(), fingerprint.strip())
        return None

    def set_included(self, agent: AgentInfo, included: bool) -> None:
        self.client.set_included(agent.fingerprint or agent.name, included)

    def refresh(self, discover: bool = True) -> None:
        """This PC's cards and agent, the paired PCs, and (`discover`) the agents advertised on the LAN: an mDNS
        query, sent only when the user opens the worker PCs page or asks again, not at every start."""
        self.problem = ""
        self.client.check_serve_support()
        self.client.refresh_agents(2.0 if discover else None)
        run_in_thread(self._probe_fn, self._on_probe, self._on_probe_failed)

    def add_this_pc(self) -> bool:
        return self.client.start_local_agent()

    def stop_this_pc(self) -> None:
        self.client.stop_local_agent()

    # -- start the agent at log-in ----------------------------------------------------------------------------

    AGENT_ARGS = ("serve", "--host", "0.0.0.0")
    """What "add this PC as worker" runs: the agent on the LAN (it admits only its paired main PC)."""

    @property
    def autostart_on(self) -> bool:
        return self.autostart is not None and self.autostart.enabled()

    def autostart_text(self) -> str:
        """Where the log-in entry is, or why there is none."""
        if self.autostart is None:
            return "starting the agent at log-in is not supported on this system"
        note = self.autostart.note()
        text = f"entry: {self.autostart.where()}" if self.autostart_on else ""
        return "; ".join(t for t in (text, note) if t)

    def set_autostart(self, on: bool) -> bool:
        """Write or remove the log-in entry for `strata-node serve`; False (and `autostart_problem` says why) when
        the system refused."""
        self.autostart_problem = ""
        if self.autostart is None:
            self.autostart_problem = "starting the agent at log-in is not supported on this system"
        else:
            try:
                if on:
                    self.autostart.enable([*self.client.command(), *self.AGENT_ARGS])
                else:
                    self.autostart.disable()
            except OSError as e:
                what = "written" if on else "removed"
                self.autostart_problem = (
                    f"the log-in entry {self.autostart.where()} could not be {what} ({e}): check that folder's "
                    "permissions"
                )
        self.changed.emit()
        return not self.autostart_problem

    def _on_probe(self, result: object) -> None:
        if isinstance(result, ProbeResult):
            self.cards, self.cards_message = card_lines(result)
            self.gpus = tuple(result.gpus)
            self.changed.emit()

    def _on_probe_failed(self, message: str) -> None:
        self.cards, self.cards_message = [], f"the GPU probe failed: {message}"
        self.changed.emit()

    def _on_agents(self, agents: list) -> None:
        self.agents = list(agents)
        self.changed.emit()

    def _on_problem(self, message: str) -> None:
        self.problem = message
        self.changed.emit()

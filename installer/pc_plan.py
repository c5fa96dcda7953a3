"""A model's layers across PCs: this PC's card runs layer 0 on, each worker PC's card the next contiguous range,
priced by the engine's own placement (installer.recommend.estimate_fit, installer.placement.plan) as if the
cards sat in one PC, the stages in the order the user ticked them. A pure function of the cards, the model's
geometry and the context, so the app's preview and the config it writes come from one rule.

A worker PC's stage worker listens on its agent's first worker port (agent port + WORKER_PORT_OFFSET, see
docs/worker-pcs.md), which the config's "workers" entry names."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from installer.config import StrataConfig, Worker
from installer.gpus import GpuInfo
from installer.recommend import CardFit, ModelGeometry, estimate_fit

WORKER_PORT_OFFSET = 10
"""The agent starts stage workers on its port + 10 .. + 29 (engine/node/agent.py)."""


@dataclass(frozen=True)
class PcCard:
    """A card the plan may use: on this PC (`host` empty) or on a paired worker PC."""

    pc: str
    """The PC's name as the user knows it ("this PC", or the agent's name)."""
    gpu: GpuInfo
    host: str = ""
    """The worker PC's address (host only); empty for this PC."""
    agent_port: int = 0

    @property
    def local(self) -> bool:
        return not self.host

    @property
    def label(self) -> str:
        return (
            f"{self.pc} GPU {self.gpu.index} · {self.gpu.name.replace('NVIDIA ', '').replace('GeForce ', '')}"
        )


@dataclass(frozen=True)
class PcStage:
    card: PcCard
    fit: CardFit

    @property
    def begin(self) -> int:
        return self.fit.begin

    @property
    def end(self) -> int:
        return self.fit.end


@dataclass(frozen=True)
class PcPlan:
    stages: tuple[PcStage, ...]
    layers: int
    context: int

    @property
    def fits(self) -> bool:
        return not any(s.fit.shortfall for s in self.stages)

    @property
    def workers(self) -> tuple[Worker, ...]:
        """The config's "workers": every stage after this PC's, in chain order."""
        return tuple(
            Worker(s.card.host, s.card.agent_port + WORKER_PORT_OFFSET, s.begin, s.end)
            for s in self.stages[1:]
        )

    def lines(self) -> list[str]:
        """One line per stage, with the numbers behind it."""
        out = []
        for s in self.stages:
            f = s.fit
            held = (
                f"experts in VRAM {f.experts_in_vram} of {f.experts_total}"
                if f.experts_total
                else "dense layers"
            )
            text = f"{s.card.label}: layers {s.begin}-{s.end - 1}, {held}"
            if f.shortfall:
                text += f"; {f.shortfall / 2**30:.1f} GiB short"
            out.append(text)
        return out

    def config(self, model: str, base: StrataConfig | None = None, on_cpu: bool = False) -> StrataConfig:
        """The config that runs this plan: this PC's card (none `on_cpu`: the engine is told --device cpu), the
        workers; the rest kept from `base`."""
        gpu = () if on_cpu else (self.stages[0].card.gpu.index,)
        if base is None:
            return StrataConfig(model=model, gpu=gpu, workers=self.workers, max_context=self.context)
        return dataclasses.replace(
            base, model=model, gpu=gpu, layer_split="auto", workers=self.workers, max_context=self.context
        )


class PlanError(ValueError):
    """The cards chosen cannot run the model as stages; the message says what to change."""


def plan_pcs(g: ModelGeometry, cards: Sequence[PcCard], context: int, kv: str = "bf16") -> PcPlan:
    """The stages of `cards` (this PC's card first, then one card per worker PC, in order). Raises PlanError on a
    choice the engine cannot run: no card of this PC first, two cards of one worker PC, a card of this PC later."""
    if not cards or not cards[0].local:
        raise PlanError("tick one card of this PC: it runs the first layers and serves the API")
    if any(c.local for c in cards[1:]):
        raise PlanError(
            "tick one card of this PC: with worker PCs, this PC runs its layers on one card (several cards of one "
            "PC and a worker PC together are not supported yet)"
        )
    hosts = [c.host for c in cards[1:]]
    if len(set(hosts)) != len(hosts):
        raise PlanError("tick one card per worker PC: a worker PC runs one stage")
    # The placement keys cards by index: number them by position, then map back.
    gpus = [dataclasses.replace(c.gpu, index=i) for i, c in enumerate(cards)]
    fit = estimate_fit(g, gpus, context, kv, layer_split="auto")
    stages = tuple(
        PcStage(cards[cf.gpu.index], dataclasses.replace(cf, gpu=cards[cf.gpu.index].gpu)) for cf in fit.cards
    )
    return PcPlan(stages, g.layers, context)


def agent_cards(name: str, host: str, agent_port: int, gpus: Sequence[Mapping[str, Any]]) -> list[PcCard]:
    """A worker PC's cards as its agent reports them (`strata-node status --json`: nodes[].gpu.gpus)."""
    out = []
    for g in gpus:
        try:
            cc = g.get("compute_capability") or (0, 0)
            gpu = GpuInfo(
                index=int(g["index"]),
                uuid=str(g.get("uuid") or ""),
                name=str(g.get("name") or "?"),
                vram_total=int(g["vram_total"]),
                vram_free=int(g.get("vram_free") or g["vram_total"]),
                compute_capability=(int(cc[0]), int(cc[1])),
                driver=str(g.get("driver") or ""),
                sm_count=g.get("sm_count"),
                max_sm_clock_mhz=g.get("max_sm_mhz"),
            )
        except (KeyError, TypeError, ValueError, IndexError):
            continue  # an entry without its VRAM cannot be planned with
        out.append(PcCard(name, gpu, host, agent_port))
    return out


def tune_splits(plan: PcPlan, shifts: int = 2) -> list[tuple[int, ...]]:
    """The splits the tuner measures for `plan` (strata-node tune --split): the plan's own first, then each
    boundary moved `shifts` times by a step of about 1/16 of the layers either way, keeping every PC at least one
    layer. The placement prices memory; the tuner measures speed around it."""
    own = tuple(s.begin for s in plan.stages[1:])
    step = max(1, plan.layers // 16)
    out = [own]
    for i in range(len(own)):
        for k in range(1, shifts + 1):
            for sign in (-1, 1):
                b = list(own)
                b[i] += sign * k * step
                edges = [0, *b, plan.layers]
                if all(edges[j] < edges[j + 1] for j in range(len(edges) - 1)) and tuple(b) not in out:
                    out.append(tuple(b))
    return out

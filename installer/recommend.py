"""Which cards together, in which order, and how much of a model fits: pure functions, no hardware access.

- `choices()`: the numbered list of the setup dialogue. With two or more cards that can share a model, the two best
  (most VRAM, then newest generation, then faster) together come first and are recommended; the newest generation
  of the pair is the main card (listed first). With three or more such cards, "all together" follows; then every
  card that can run alone, biggest first.
- `stage_order()`: under `"gpu_order": "auto"` the faster card (SMs x max SM clock) goes last unless it is within
  5% of the last one; `"as_given"` keeps the order.
- `estimate_fit()`: per card, in bytes: dense weights of its layers, KV cache at the chosen context, room left for
  experts and how many routed experts that holds; "fits fully / partly / does not fit" only summarizes those numbers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import psutil

from installer import placement
from installer.engine_options import cpu_float_budget
from installer.gpus import GIB, GpuInfo
from installer.placement import (
    DEFAULT_OVERHEAD_BYTES,
    DEFAULT_RESERVE_BYTES,
    Card,
)
from installer.rules import CardAssessment, OtherAssessment

MIB = 1024**2
KV_BYTES_SCALE: dict[str, float] = {
    "bf16": 1.0,
    "int8": (1.0 + 2.0 / 32.0) / 2.0,
    "q4_0": (0.5 + 2.0 / 32.0) / 2.0,
}
"""KV bytes relative to bf16: int8 keeps one byte per value plus (at most) a 2-byte scale per 32 values, q4_0 half a
byte per value plus a 2-byte scale per 32."""


# ---------------------------------------------------------------------------------------------------------------
# Choices and listing


def _rank_key(gpu: GpuInfo) -> tuple[int, tuple[int, int], float, int]:
    return (
        -gpu.vram_gb,
        (-gpu.compute_capability[0], -gpu.compute_capability[1]),
        -(gpu.speed_score or 0.0),
        gpu.index,
    )


def main_first(gpus: Sequence[GpuInfo]) -> tuple[GpuInfo, ...]:
    """Newest generation first (it becomes the main card), then more VRAM, then NVML order."""
    return tuple(
        sorted(
            gpus, key=lambda g: ((-g.compute_capability[0], -g.compute_capability[1]), -g.vram_gb, g.index)
        )
    )


@dataclass(frozen=True)
class Choice:
    gpus: tuple[GpuInfo, ...]
    """Main card first: the order written to the config's "gpu" list."""
    recommended: bool = False

    @property
    def indices(self) -> tuple[int, ...]:
        return tuple(g.index for g in self.gpus)

    @property
    def label(self) -> str:
        if len(self.gpus) == 1:
            return f"{self.gpus[0].short} only"
        return " + ".join(g.short for g in self.gpus) + " together"


def choices(assessments: Sequence[CardAssessment]) -> list[Choice]:
    joiners = [a.gpu for a in assessments if a.can_join]
    singles = sorted((a.gpu for a in assessments if a.can_run_alone), key=_rank_key)
    out: list[Choice] = []
    if len(joiners) >= 2:
        best_two = sorted(joiners, key=_rank_key)[:2]
        out.append(Choice(main_first(best_two), recommended=True))
        if len(joiners) >= 3:
            out.append(Choice(main_first(joiners)))
    for gpu in singles:
        out.append(Choice((gpu,), recommended=not out))
    return out


def format_listing(
    assessments: Sequence[CardAssessment], others: Sequence[OtherAssessment] = ()
) -> list[str]:
    lines = ["  Your NVIDIA GPUs:"]
    lines += [f"    {a.line()}" for a in assessments]
    if others:
        lines.append("  Other graphics adapters:")
        lines += [f"    {o.line()}" for o in others]
    return lines


def format_choices(options: Sequence[Choice]) -> list[str]:
    return [
        f"  {n}) {c.label}" + ("   (recommended)" if c.recommended else "") for n, c in enumerate(options, 1)
    ]


# ---------------------------------------------------------------------------------------------------------------
# Card order


@dataclass(frozen=True)
class StageOrder:
    gpus: tuple[GpuInfo, ...]
    changed: bool
    note: str


def as_card(gpu: GpuInfo) -> Card:
    """A card as the engine's placement sees it (NVML's free VRAM, as the engine reads it at load)."""
    return Card(
        index=gpu.index,
        name=gpu.name,
        free_bytes=gpu.vram_free,
        total_bytes=gpu.vram_total,
        compute_capability=gpu.compute_capability,
        sm_count=gpu.sm_count,
        max_clock_mhz=gpu.max_sm_clock_mhz,
    )


def stage_order(gpus: Sequence[GpuInfo], gpu_order: Literal["auto", "as_given"] = "auto") -> StageOrder:
    """The order of the stages, by the engine's rule (installer.placement.order_cards): the last card runs the
    head, the draft layer and the verify, so the faster goes last. The note names the cards as setup lists them."""
    given = tuple(gpus)
    ordered, moved = placement.order_cards([as_card(g) for g in given], gpu_order)
    by_index = {g.index: g for g in given}
    order = tuple(by_index[c.index] for c in ordered)
    if moved is None:
        return StageOrder(given, False, "card order as given")
    fastest, last = order[-1], given[-1]
    fast, slow = fastest.speed_score or 0.0, last.speed_score or 1.0
    note = (
        f"card order: GPU {fastest.index} goes last ({fastest.sm_count} SMs x {fastest.max_sm_clock_mhz} MHz, "
        f"{fast / slow - 1.0:.0%} faster than GPU {last.index})"
    )
    return StageOrder(order, True, note)


# ---------------------------------------------------------------------------------------------------------------
# Model geometry and fit


@dataclass(frozen=True)
class ModelGeometry:
    """What the fit estimate needs to know of a model, in bytes of the file's own block formats.

    Filled from the catalog (an estimate from the file size) or from GGUF metadata by the engine (exact).
    """

    layers: int
    experts: int
    """Routed experts per MoE layer; 0 for a dense model."""
    experts_used: int
    expert_bytes: int
    """One routed expert of one layer (all its projections)."""
    dense_bytes_per_layer: int
    """Attention, norms, router and shared expert of one layer."""
    kv_bytes_per_token_layer: int
    """K and V of one token in one full-attention layer, at bf16."""
    head_bytes: int
    """Output head and final norm: on the last card."""
    embedding_bytes: int = 0
    """An untied token table (0 when tied to the head): on the first card, where the engine keeps it."""
    first_dense_layers: int = 0
    """Leading layers without routed experts (GLM-4.5: 1)."""
    full_attention_interval: int = 1
    """Every n-th layer keeps a KV cache; the others are linear attention with a fixed state (Qwen3-Next: 4)."""
    sliding_window: int = 0
    sliding_window_pattern: int = 0
    """Every n-th layer is global, the others keep only `sliding_window` tokens (gpt-oss: 2, Gemma 3: 6)."""
    recurrent_state_bytes: int = 0
    """State of one linear-attention layer (per sequence)."""
    draft_bytes: int = 0
    """The draft (MTP / NextN) layer, whole, on the last card."""

    def __post_init__(self) -> None:
        for key, value in self.__dict__.items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"ModelGeometry.{key} must be a non-negative integer, got {value!r}")
        if self.layers < 1:
            raise ValueError("ModelGeometry.layers must be at least 1")
        if self.experts and (self.expert_bytes == 0 or not 0 < self.experts_used <= self.experts):
            raise ValueError(
                "ModelGeometry: a model with experts needs expert_bytes > 0 and 0 < experts_used <= experts"
            )
        if self.full_attention_interval < 1:
            raise ValueError("ModelGeometry.full_attention_interval must be at least 1")

    def has_experts(self, layer: int) -> bool:
        return self.experts > 0 and layer >= self.first_dense_layers

    def linear(self, layer: int) -> bool:
        """A linear-attention layer: a fixed state, no KV cache (Qwen3-Next: all but every n-th)."""
        return self.full_attention_interval > 1 and (layer + 1) % self.full_attention_interval != 0

    def sliding(self, layer: int) -> bool:
        """A sliding-window layer: it keeps at most `sliding_window` tokens."""
        return bool(self.sliding_window and self.sliding_window_pattern) and (
            (layer + 1) % self.sliding_window_pattern != 0
        )

    def kv_tokens(self, layer: int, context: int) -> int:
        """Tokens this layer keeps in its KV cache at the given context."""
        if self.linear(layer):
            return 0
        if self.sliding(layer):
            return min(context, self.sliding_window)
        return context

    def layer_kv_bytes(self, layer: int, context: int, kv: str = "bf16") -> int:
        tokens = self.kv_tokens(layer, context)
        if tokens == 0 and self.full_attention_interval > 1:
            return self.recurrent_state_bytes
        return int(tokens * self.kv_bytes_per_token_layer * KV_BYTES_SCALE[kv])

    def to_placement(self, kv: str = "bf16") -> placement.Geometry:
        """The geometry the engine's placement prices, laid out as the engine lays a model out: the token table
        on the first card (for a tied head too), the head and the draft layer on the last, the KV per token of
        each layer (a sliding window's layers capped at the window), a linear-attention layer's fixed state."""
        n = self.layers
        scale = KV_BYTES_SCALE[kv]
        per_token, window, state = [], [], []
        for i in range(n):
            linear = self.linear(i)
            per_token.append(0 if linear else int(self.kv_bytes_per_token_layer * scale))
            window.append(self.sliding_window if self.sliding(i) and not linear else 0)
            state.append(self.recurrent_state_bytes if linear else 0)
        return placement.Geometry(
            n_layer=n,
            n_expert=self.experts,
            dense_bytes=(self.dense_bytes_per_layer,) * n,
            expert_bytes=tuple(self.expert_bytes if self.has_experts(i) else 0 for i in range(n)),
            kv_bytes_per_token=tuple(per_token),
            kv_window=tuple(window) if any(window) else (),
            embed_bytes=self.embedding_bytes or self.head_bytes,
            head_bytes=self.head_bytes,
            draft_bytes=self.draft_bytes,
            state_bytes=tuple(state) if any(state) else (),
        )

    @property
    def moe_layers(self) -> int:
        return sum(1 for i in range(self.layers) if self.has_experts(i))

    @property
    def routed_experts_total(self) -> int:
        return self.moe_layers * self.experts

    @property
    def total_bytes(self) -> int:
        return (
            self.dense_bytes_per_layer * self.layers
            + self.routed_experts_total * self.expert_bytes
            + self.head_bytes
            + self.embedding_bytes
            + self.draft_bytes
        )


@dataclass(frozen=True)
class CardFit:
    gpu: GpuInfo
    begin: int
    end: int
    last: bool
    vram_free: int
    reserve_bytes: int
    overhead_bytes: int
    dense_bytes: int
    kv_bytes: int
    expert_room: int
    """Bytes left for the expert cache (0 when even the dense weights and KV do not fit)."""
    experts_total: int
    experts_in_vram: int
    shortfall: int
    """Bytes missing for dense weights + KV + overhead (0 when they fit)."""

    def line(self, context: int, kv: str) -> str:
        layers = f"layers {self.begin}-{self.end - 1}" + (" + head" if self.last else "")
        text = (
            f"GPU {self.gpu.index} ({self.gpu.name}), {layers}: dense weights {_gib(self.dense_bytes)}, "
            f"KV {_gib(self.kv_bytes)} ({context} tokens, {kv}), "
        )
        if self.experts_total:
            text += f"room for experts {_gib(self.expert_room)}, experts in VRAM {self.experts_in_vram} of {self.experts_total}"
        else:
            text += f"free after loading {_gib(self.expert_room)}"
        if self.shortfall:
            text += f", short by {_gib(self.shortfall)}"
        return text


FitSummary = Literal["fits fully", "fits partly", "does not fit"]


@dataclass(frozen=True)
class FitEstimate:
    cards: tuple[CardFit, ...]
    context: int
    kv: str
    layer_split: tuple[int, ...]
    """First layer of each card after the first (the config's "layer_split")."""

    @property
    def experts_total(self) -> int:
        return sum(c.experts_total for c in self.cards)

    @property
    def experts_in_vram(self) -> int:
        return sum(c.experts_in_vram for c in self.cards)

    def host_expert_bytes(self, geometry: ModelGeometry) -> int:
        """Experts no card holds: computed from host RAM."""
        return (self.experts_total - self.experts_in_vram) * geometry.expert_bytes

    @property
    def summary(self) -> FitSummary:
        if any(c.shortfall for c in self.cards):
            return "does not fit"
        if self.experts_in_vram == self.experts_total:
            return "fits fully"
        return "fits partly"

    def summary_text(self) -> str:
        if self.summary == "does not fit":
            short = ", ".join(
                f"GPU {c.gpu.index} lacks {_gib(c.shortfall)}" for c in self.cards if c.shortfall
            )
            return f"does not fit: {short} for its dense weights, KV cache and buffers"
        if self.experts_total == 0:
            return "fits fully (dense model)"
        share = f"{self.experts_in_vram} of {self.experts_total} routed experts in VRAM"
        if self.summary == "fits fully":
            return f"fits fully: {share}"
        return f"fits partly: {share}, the rest computed from host RAM"

    def lines(self) -> list[str]:
        return [c.line(self.context, self.kv) for c in self.cards] + [self.summary_text()]


def _gib(n: int) -> str:
    return f"{n / GIB:.1f} GiB"


def _stage_fit(
    pg: placement.Geometry, st: placement.StageFit, gpu: GpuInfo, context: int, budget: placement.Budget
) -> CardFit:
    kv_bytes = sum(pg.kv_bytes(i, context) for i in range(st.begin, st.end))
    return CardFit(
        gpu=gpu,
        begin=st.begin,
        end=st.end,
        last=st.last,
        vram_free=gpu.vram_free,
        reserve_bytes=budget.reserve(0 if st.first else 1),
        overhead_bytes=budget.overhead,
        dense_bytes=st.fixed_bytes - kv_bytes - budget.overhead,
        kv_bytes=kv_bytes,
        expert_room=max(st.usable_bytes - st.fixed_bytes, 0),
        experts_total=st.pairs,
        experts_in_vram=st.held,
        shortfall=st.shortfall,
    )


def even_split(layers: int, n_cards: int) -> list[int]:
    return [round(layers * i / n_cards) for i in range(1, n_cards)]


def _plan(
    g: ModelGeometry,
    gpus: Sequence[GpuInfo],
    context: int,
    kv: str,
    layer_split: Literal["auto"] | Sequence[int],
    reserve_bytes: int,
    overhead_bytes: int,
) -> tuple[placement.Placement, placement.Geometry, placement.Budget]:
    """The engine's placement (installer.placement.plan) of these cards, in the order given (already the stage
    order: `stage_order`), with the shortfalls of a model that does not fit kept for the preview to show; the
    geometry and budget it priced."""
    budget = placement.Budget(context, reserve_first=reserve_bytes, overhead=overhead_bytes)
    pg = g.to_placement(kv)
    cards = [as_card(gpu) for gpu in gpus]
    p = placement.plan(cards, pg, budget, layer_split, gpu_order="as_given", allow_shortfall=True)
    return p, pg, budget


def auto_split(
    g: ModelGeometry,
    gpus: Sequence[GpuInfo],
    context: int,
    kv: str = "bf16",
    reserve_bytes: int = DEFAULT_RESERVE_BYTES,
    overhead_bytes: int = DEFAULT_OVERHEAD_BYTES,
) -> tuple[int, ...]:
    """The first layer of each card after the first under `"layer_split": "auto"`: the engine's rule."""
    if len(gpus) <= 1:
        return ()
    return _plan(g, gpus, context, kv, "auto", reserve_bytes, overhead_bytes)[0].starts


def estimate_fit(
    g: ModelGeometry,
    gpus: Sequence[GpuInfo],
    context: int,
    kv: str = "bf16",
    layer_split: Literal["auto"] | Sequence[int] = "auto",
    reserve_bytes: int = DEFAULT_RESERVE_BYTES,
    overhead_bytes: int = DEFAULT_OVERHEAD_BYTES,
) -> FitEstimate:
    """The fit of a model on these cards, in stage order (see `stage_order`), split as the engine splits it.
    Raises ValueError (PlacementError is one) on bad input: a split that does not suit the cards, too few layers
    for the cards, an unknown KV type."""
    if not gpus:
        raise ValueError("estimate_fit needs at least one card")
    if kv not in KV_BYTES_SCALE:
        raise ValueError(f"kv type {kv!r} is not one of {sorted(KV_BYTES_SCALE)}")
    if context < 1:
        raise ValueError(f"context must be at least 1 token, got {context}")
    p, pg, budget = _plan(g, gpus, context, kv, layer_split, reserve_bytes, overhead_bytes)
    by_index = {gpu.index: gpu for gpu in gpus}
    cards = tuple(_stage_fit(pg, st, by_index[st.card.index], context, budget) for st in p.stages)
    return FitEstimate(cards=cards, context=context, kv=kv, layer_split=p.starts)


# ---- the fit on this PC: cards, RAM and disk --------------------------------------------------------------------

RUNTIME_BYTES = 1 << 30
"""The engine process beside its weights (torch, the tokenizer, buffers)."""
OS_RESERVE_BYTES = 2 << 30
"""RAM the rest of the PC keeps: not counted as room for the model."""
FLOAT_COPY_FACTOR = 7
"""float32 bytes per byte of ~4.5-bit blocks: the CPU path's float copies, at most."""
PcFitKind = Literal["all in VRAM", "experts in VRAM", "CPU only", "does not fit"]


@dataclass(frozen=True)
class PcFit:
    """How a model runs on this PC, as a label (`label`: all in VRAM / N% of experts in VRAM / CPU only / does
    not fit) with the numbers behind it (`lines`)."""

    kind: PcFitKind
    label: str
    lines: tuple[str, ...]
    vram_share: float = 0.0
    """Of the routed experts, the share in VRAM (1.0 for all in VRAM; 0 on the CPU)."""

    @property
    def fits(self) -> bool:
        return self.kind != "does not fit"

    @property
    def rank(self) -> tuple[int, float]:
        """Smaller first: what runs fastest here (all in VRAM, then most experts in VRAM, then the CPU)."""
        order = {"all in VRAM": 0, "experts in VRAM": 1, "CPU only": 2, "does not fit": 3}
        return order[self.kind], -self.vram_share


def this_pc_ram() -> int:
    """This PC's RAM, in bytes."""
    return int(psutil.virtual_memory().total)


def pc_fit(
    g: ModelGeometry,
    file_bytes: int,
    gpus: Sequence[GpuInfo],
    ram_bytes: int,
    context: int,
    kv: str = "bf16",
    disk_free: int | None = None,
    cpu_float_bytes: int | None = None,
) -> PcFit:
    """The fit of a model on this PC: its cards (none: CPU mode), its RAM (total) and, for a model still to be
    downloaded, the free disk. With cards the dense weights and KV must fit in VRAM (estimate_fit) and the
    experts no card holds must fit in RAM; on the CPU the whole file, its KV, the float copies the CPU path keeps
    (`cpu_float_bytes`, default the engine's automatic budget) and the runtime must fit in RAM."""
    gib = _gib
    room = max(ram_bytes - OS_RESERVE_BYTES, 0)
    lines: list[str] = []
    if disk_free is not None and disk_free < file_bytes:
        return PcFit("does not fit", "does not fit: disk", (
            f"the download needs {gib(file_bytes)} of disk; {gib(disk_free)} is free there",))  # fmt: skip
    if gpus:
        fit = estimate_fit(g, stage_order(gpus, "auto").gpus, context, kv)
        lines += fit.lines()
        if fit.summary == "does not fit":
            return PcFit("does not fit", "does not fit: VRAM", tuple(lines))
        host = fit.host_expert_bytes(g) + RUNTIME_BYTES
        lines.append(f"RAM: experts in host memory {gib(fit.host_expert_bytes(g))} + runtime {gib(RUNTIME_BYTES)} "
                     f"= {gib(host)} of {gib(room)} (RAM {gib(ram_bytes)} less {gib(OS_RESERVE_BYTES)} for the PC)")  # fmt: skip
        if host > room:
            return PcFit("does not fit", "does not fit: RAM", tuple(lines))
        share = fit.experts_in_vram / fit.experts_total if fit.experts_total else 1.0
        if share >= 1.0:
            return PcFit("all in VRAM", "all in VRAM", tuple(lines), 1.0)
        return PcFit("experts in VRAM", f"{int(share * 100)}% of experts in VRAM", tuple(lines), share)
    kv_bytes = sum(g.layer_kv_bytes(i, context, kv) for i in range(g.layers))
    budget = cpu_float_budget(ram_bytes) if cpu_float_bytes is None else cpu_float_bytes
    # float32 copies of the weights used, up to the budget: about 7x the blocks of a ~4.5-bit file
    floats = min(budget, FLOAT_COPY_FACTOR * file_bytes)
    need = file_bytes + kv_bytes + floats + RUNTIME_BYTES
    lines.append(
        f"CPU mode, RAM: weights {gib(file_bytes)} + KV {gib(kv_bytes)} ({context} tokens, {kv}) + float copies "
        f"{gib(floats)} + runtime {gib(RUNTIME_BYTES)} = {gib(need)} of {gib(room)} (RAM {gib(ram_bytes)} less "
        f"{gib(OS_RESERVE_BYTES)} for the PC)"
    )
    if need > room:
        if floats and need - floats <= room:
            lines.append(f"without float copies (--cpu-weights-mib 0) it needs {gib(need - floats)}: it fits, "
                         "but runs slower")  # fmt: skip
        return PcFit("does not fit", "does not fit: RAM", tuple(lines))
    return PcFit("CPU only", "CPU only", tuple(lines))

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

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from installer.gpus import GIB, GpuInfo
from installer.rules import CardAssessment, OtherAssessment

TIE_FRACTION = 0.05
MAX_EXHAUSTIVE_CARDS = 4
MIN_LAYERS_PER_CARD = 3
MIB = 1024**2
DEFAULT_RESERVE_BYTES = 512 * MIB
"""Headroom per card left to the display, the driver and fragmentation (the engine's --vram-reserve-mib)."""
DEFAULT_OVERHEAD_BYTES = 1024 * MIB
"""Per card: CUDA context, cuBLAS workspace, activations and prompt buffers (an estimate)."""

KV_BYTES_SCALE: dict[str, float] = {"bf16": 1.0, "int8": (1.0 + 2.0 / 32.0) / 2.0}
"""KV bytes relative to bf16: int8 keeps one byte per value plus a 2-byte scale per 32 values."""


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


def stage_order(gpus: Sequence[GpuInfo], gpu_order: Literal["auto", "as_given"] = "auto") -> StageOrder:
    """The order of the stages: the last card runs the head, the draft layer and the verify, so the faster goes last."""
    given = tuple(gpus)
    if gpu_order == "as_given" or len(given) < 2:
        return StageOrder(given, False, "card order as given")
    scored = [g for g in given if g.speed_score is not None]
    if len(scored) != len(given):
        return StageOrder(given, False, "card order as given (speed of some card unknown)")
    fastest = max(given, key=lambda g: (g.speed_score or 0.0, -given.index(g)))
    last = given[-1]
    fast, slow = fastest.speed_score or 0.0, last.speed_score or 0.0
    if fastest is last or fast <= slow * (1.0 + TIE_FRACTION):
        return StageOrder(given, False, "card order as given (the last card is the fastest or within 5%)")
    order = (*tuple(g for g in given if g is not fastest), fastest)
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
    """An untied token table: looked up in host RAM, not counted on a card (0 when tied to the head)."""
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

    def kv_tokens(self, layer: int, context: int) -> int:
        """Tokens this layer keeps in its KV cache at the given context."""
        if self.full_attention_interval > 1 and (layer + 1) % self.full_attention_interval != 0:
            return 0
        if (
            self.sliding_window
            and self.sliding_window_pattern
            and (layer + 1) % self.sliding_window_pattern != 0
        ):
            return min(context, self.sliding_window)
        return context

    def layer_kv_bytes(self, layer: int, context: int, kv: str = "bf16") -> int:
        tokens = self.kv_tokens(layer, context)
        if tokens == 0 and self.full_attention_interval > 1:
            return self.recurrent_state_bytes
        return int(tokens * self.kv_bytes_per_token_layer * KV_BYTES_SCALE[kv])

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


class _Prefix:
    """Prefix sums over layers so that one placement is priced in O(cards)."""

    def __init__(self, g: ModelGeometry, context: int, kv: str) -> None:
        self.kv = [0]
        self.experts = [0]
        for i in range(g.layers):
            self.kv.append(self.kv[-1] + g.layer_kv_bytes(i, context, kv))
            self.experts.append(self.experts[-1] + (g.experts if g.has_experts(i) else 0))


def _card_fit(
    g: ModelGeometry,
    p: _Prefix,
    gpu: GpuInfo,
    begin: int,
    end: int,
    last: bool,
    reserve: int,
    overhead: int,
) -> CardFit:
    dense = g.dense_bytes_per_layer * (end - begin) + ((g.head_bytes + g.draft_bytes) if last else 0)
    kv_bytes = p.kv[end] - p.kv[begin]
    room = gpu.vram_free - reserve - overhead - dense - kv_bytes
    total = p.experts[end] - p.experts[begin]
    held = min(total, max(room, 0) // g.expert_bytes) if g.expert_bytes and total else 0
    return CardFit(
        gpu=gpu,
        begin=begin,
        end=end,
        last=last,
        vram_free=gpu.vram_free,
        reserve_bytes=reserve,
        overhead_bytes=overhead,
        dense_bytes=dense,
        kv_bytes=kv_bytes,
        expert_room=max(room, 0),
        experts_total=total,
        experts_in_vram=held,
        shortfall=max(-room, 0),
    )


def _fits(
    g: ModelGeometry, p: _Prefix, gpus: Sequence[GpuInfo], starts: Sequence[int], reserve: int, overhead: int
) -> tuple[CardFit, ...]:
    bounds = [0, *starts, g.layers]
    return tuple(
        _card_fit(g, p, gpu, bounds[i], bounds[i + 1], i == len(gpus) - 1, reserve, overhead)
        for i, gpu in enumerate(gpus)
    )


def _score(cards: Sequence[CardFit], expert_bytes: int) -> tuple[int, int, int]:
    """Fewest bytes missing, then most experts in VRAM, then the most room left on the fullest card."""
    left = min(c.expert_room - c.experts_in_vram * expert_bytes for c in cards)
    return (-sum(c.shortfall for c in cards), sum(c.experts_in_vram for c in cards), left)


def check_layer_split(split: Sequence[int], n_cards: int, layers: int) -> tuple[int, ...]:
    """A manual split: one rising first layer per card after the first, each inside the model."""
    starts = tuple(split)
    if len(starts) != n_cards - 1:
        raise ValueError(
            f"layer split {list(starts)} has {len(starts)} numbers for {n_cards} cards: give the first layer "
            f"of each card after the first ({n_cards - 1} rising numbers)"
        )
    prev = 0
    for s in starts:
        if s <= prev or s >= layers:
            raise ValueError(
                f"layer split {list(starts)}: each number must rise and lie between 1 and {layers - 1} "
                f"(the model has {layers} layers), e.g. {even_split(layers, n_cards)}"
            )
        prev = s
    return starts


def even_split(layers: int, n_cards: int) -> list[int]:
    return [round(layers * i / n_cards) for i in range(1, n_cards)]


def auto_split(
    g: ModelGeometry,
    gpus: Sequence[GpuInfo],
    context: int,
    kv: str = "bf16",
    reserve_bytes: int = DEFAULT_RESERVE_BYTES,
    overhead_bytes: int = DEFAULT_OVERHEAD_BYTES,
) -> tuple[int, ...]:
    """Every placement for up to four cards (at least 3 layers each where the model allows), best by `_score`;
    beyond four, layers in proportion to each card's free VRAM."""
    n = len(gpus)
    if n <= 1:
        return ()
    min_layers = MIN_LAYERS_PER_CARD if g.layers >= MIN_LAYERS_PER_CARD * n else 1
    if g.layers < n:
        raise ValueError(
            f"the model has {g.layers} layers, fewer than the {n} cards chosen: choose fewer cards"
        )
    p = _Prefix(g, context, kv)
    if n > MAX_EXHAUSTIVE_CARDS:
        avail = [max(gpu.vram_free - reserve_bytes - overhead_bytes, 1) for gpu in gpus]
        total, acc, starts = sum(avail), 0, []
        for i in range(n - 1):
            acc += avail[i]
            lo = (starts[-1] if starts else 0) + min_layers
            hi = g.layers - min_layers * (n - 1 - i)
            starts.append(min(max(round(g.layers * acc / total), lo), hi))
        return tuple(starts)
    best: tuple[int, ...] | None = None
    best_score: tuple[int, int, int] | None = None
    for starts in itertools.combinations(range(min_layers, g.layers - min_layers + 1), n - 1):
        if any(b - a < min_layers for a, b in itertools.pairwise((0, *starts, g.layers))):
            continue
        score = _score(_fits(g, p, gpus, starts, reserve_bytes, overhead_bytes), g.expert_bytes)
        if best_score is None or score > best_score:
            best, best_score = starts, score
    assert best is not None  # min_layers * n <= layers guarantees one placement
    return best


def estimate_fit(
    g: ModelGeometry,
    gpus: Sequence[GpuInfo],
    context: int,
    kv: str = "bf16",
    layer_split: Literal["auto"] | Sequence[int] = "auto",
    reserve_bytes: int = DEFAULT_RESERVE_BYTES,
    overhead_bytes: int = DEFAULT_OVERHEAD_BYTES,
) -> FitEstimate:
    """The fit of a model on these cards, in stage order (see `stage_order`). Raises ValueError on bad input."""
    if not gpus:
        raise ValueError("estimate_fit needs at least one card")
    if kv not in KV_BYTES_SCALE:
        raise ValueError(f"kv type {kv!r} is not one of {sorted(KV_BYTES_SCALE)}")
    if context < 1:
        raise ValueError(f"context must be at least 1 token, got {context}")
    if layer_split == "auto":
        starts = auto_split(g, gpus, context, kv, reserve_bytes, overhead_bytes)
    else:
        starts = check_layer_split(layer_split, len(gpus), g.layers)
    cards = _fits(g, _Prefix(g, context, kv), gpus, starts, reserve_bytes, overhead_bytes)
    return FitEstimate(cards=cards, context=context, kv=kv, layer_split=starts)

"""Placement of layer ranges on the cards of one PC (seed 002): a pure function of (cards, model geometry, profile),
torch-free, so that the engine (engine/pipeline/split.py) and the previews of the setup wizard and strata-setup
(installer/recommend.py) run this one rule and show the split the engine will run.

- `order_cards`: under `"gpu_order": "auto"` the faster card (SMs x max clock) goes last - it runs the head and a
  prompt chunk waits on it - unless its score is within 5% of the last card's; `"as_given"` and a manual split keep
  the order written.
- `plan`: a manual split is checked and priced; `auto` tries every placement for up to four cards (proportional to
  each card's room beyond that), keeps the one whose expert caches hold the most of the usage profile (each pair
  weighted by its count, so the hottest count most), with at least 3 layers per card; on two cards it first asks for
  a placement in which each card owns at least its share of the layers by its room for experts (#2644: an unequal
  pair otherwise leaves one card a handful of layers and idles it); ties go to the placement that leaves the
  fullest card the most room. `split_skip_if_fits` runs on the first card alone when it holds everything.

Each card holds its layers' dense weights and KV, the first card the token table, the last card the head and the
draft layer; whatever VRAM is left (less the reserve and a working overhead) is its expert cache, filled with the
hottest pairs of its own layers.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from installer.engine_options import D as OPTION_DEFAULTS

GIB = 1024**3
MIB = 1024**2
TIE_FRACTION = 0.05  # a card within 5% of the fastest counts as fast as it
MAX_EXHAUSTIVE_CARDS = 4
MIN_LAYERS_PER_CARD = 3
DEFAULT_RESERVE_BYTES = OPTION_DEFAULTS.vram_reserve_mib * MIB
"""Headroom per card left to the display, the driver and fragmentation (the engine's --vram-reserve-mib)."""
DEFAULT_OVERHEAD_BYTES = 1024 * MIB
"""Per card: CUDA context, cuBLAS workspace, activations and prompt buffers (an estimate)."""
MIN_CC = (7, 5)
MIN_LAST_LAYERS = 2  # a manual split's last card keeps two layers at least

GpuOrder = Literal["auto", "as_given"]


class PlacementError(ValueError):
    """A split that cannot be used; the message says what is wrong and how to fix it."""


@dataclass(frozen=True)
class Card:
    """One CUDA card as the placement sees it. `index` is the number nvidia-smi gives it."""

    index: int
    name: str
    free_bytes: int
    total_bytes: int = 0
    compute_capability: tuple[int, int] = (0, 0)
    sm_count: int | None = None
    max_clock_mhz: int | None = None

    @property
    def label(self) -> str:
        return f"CUDA{self.index}"

    @property
    def speed(self) -> float | None:
        """SMs x max SM clock: the seed's measure of which card is faster."""
        if not self.sm_count or not self.max_clock_mhz:
            return None
        return float(self.sm_count * self.max_clock_mhz)


@dataclass(frozen=True)
class Geometry:
    """What the placement needs of a model, in bytes of the file's own block formats.

    Per-layer tuples have `n_layer` entries. `kv_bytes_per_token` is K and V of one token at the chosen KV type;
    `kv_window` the tokens a sliding-window layer keeps (0: the whole context)."""

    n_layer: int
    n_expert: int
    dense_bytes: tuple[int, ...]
    expert_bytes: tuple[
        int, ...
    ]  # one routed expert of the layer (all its projections); 0: no routed experts
    kv_bytes_per_token: tuple[int, ...]
    kv_window: tuple[int, ...] = ()
    embed_bytes: int = 0  # the token table, on the first card
    head_bytes: int = 0  # output norm and head, on the last card
    draft_bytes: int = 0  # the draft (MTP) layer, on the last card
    state_bytes: tuple[int, ...] = ()  # a fixed state per layer whatever the context (linear attention)

    def __post_init__(self) -> None:
        if self.n_layer < 1:
            raise ValueError("Geometry.n_layer must be at least 1")
        for name in ("dense_bytes", "expert_bytes", "kv_bytes_per_token"):
            if len(getattr(self, name)) != self.n_layer:
                raise ValueError(f"Geometry.{name} needs one entry per layer ({self.n_layer})")
        for name in ("kv_window", "state_bytes"):
            if getattr(self, name) and len(getattr(self, name)) != self.n_layer:
                raise ValueError(f"Geometry.{name} needs one entry per layer ({self.n_layer}) or none")

    def kv_bytes(self, layer: int, context: int) -> int:
        window = self.kv_window[layer] if self.kv_window else 0
        tokens = min(context, window) if window else context
        return tokens * self.kv_bytes_per_token[layer] + (self.state_bytes[layer] if self.state_bytes else 0)


def host_kv_layers(g: Geometry, layers: Sequence[int], context: int, resident: int | None) -> frozenset[int]:
    """The layers of `layers` whose KV lives in page-locked host RAM under `--kv-resident resident`: VRAM keeps at
    most the KV of `resident` positions of each sequence, as whole layers (a layer's KV is one block of memory that
    every kernel reads in place), the layers of largest KV going first, the later of equal ones. Reading a position's
    KV costs the same wherever its layer lies, so which layers go does not change a step's bytes over PCIe: that is
    (context used) x (the host layers' share of a position). None, or `resident` >= `context`: none. Pure."""
    if resident is None or resident >= context:
        return frozenset()
    kv = {i: g.kv_bytes(i, context) - (g.state_bytes[i] if g.state_bytes else 0) for i in layers}
    allowed = sum(
        g.kv_bytes(i, max(resident, 0)) - (g.state_bytes[i] if g.state_bytes else 0) for i in layers
    )
    held, out = sum(kv.values()), set()
    for i in sorted((i for i in kv if kv[i] > 0), key=lambda i: (-kv[i], -i)):
        if held <= allowed:
            break
        out.add(i)
        held -= kv[i]
    return frozenset(out)


def auto_kv_resident(
    g: Geometry, context: int, sequences: int, free_bytes: int, reserve: int = DEFAULT_RESERVE_BYTES,
    overhead: int = DEFAULT_OVERHEAD_BYTES,
) -> tuple[int | None, str]:  # fmt: skip
    """--kv-resident auto on one card: every position's KV in VRAM where the dense weights, the KV of `sequences`
    slots of `context` positions, the working buffers, the experts' staging area (a prompt chunk stages one
    layer's experts at a time) and the reserve fit the card's `free_bytes` (the experts then take what is left, or
    none); else the positions whose KV fits beside the rest (the other layers' KV in host RAM),
    so that the context runs rather than failing at start. None where everything fits, or where even with all of
    the KV in host RAM the dense weights do not. -> (positions, the reason, for the log)."""
    dense = sum(g.dense_bytes) + g.embed_bytes + g.head_bytes + g.draft_bytes
    dense += sum(g.state_bytes) * max(1, sequences) if g.state_bytes else 0
    dense += max(g.expert_bytes) * g.n_expert  # the prompt chunks' staging area: one layer's experts
    per = sum(g.kv_bytes_per_token) * max(1, sequences)  # a position of every layer and slot
    kv = sum(g.kv_bytes(i, context) for i in range(g.n_layer)) * max(1, sequences)
    kv -= sum(g.state_bytes) * max(1, sequences) if g.state_bytes else 0
    room = free_bytes - reserve - overhead - dense
    if kv <= room or per <= 0:
        return None, ""
    if room <= 0:
        return None, ""
    fits = int(room // per) // CONTEXT_STEP * CONTEXT_STEP
    return fits, (
        f"the KV of {context} positions x {max(1, sequences)} slot(s) ({kv / GIB:.1f} GiB) does not fit beside the "
        f"dense weights on the card ({room / GIB:.1f} GiB left after them, the experts' staging area, the reserve "
        f"and working buffers): the KV of {fits} positions stays in VRAM and the other layers' KV lives in host RAM, "
        "read across PCIe at every step (a shorter --max-context, fewer --parallel slots or a smaller --kv type keep "
        "it all in VRAM)"
    )


MAX_PARALLEL = 64  # --parallel: slots one server runs at most
AUTO_PARALLEL = 16  # --parallel left out: at most this many slots on a card (a decode step takes 16 rows)
CPU_PARALLEL = 4  # and on the CPU, where host RAM holds the KV


def auto_parallel(
    slot_kv_bytes: int, free_bytes: int | None, host_bytes: int | None = None
) -> tuple[int, str]:
    """--parallel left out: the slots (requests decoded together) whose KV caches take at most an eighth of the
    card's free VRAM (or of --vram-budget-mib), 1 to AUTO_PARALLEL (the rest goes to the weights and the expert
    cache); where no card runs the model (`free_bytes` None), up to CPU_PARALLEL within an eighth of the host RAM
    available (`host_bytes`). -> (slots, the reason, for the log)."""
    per = max(1, slot_kv_bytes)
    if free_bytes is None:
        if host_bytes is None:
            return CPU_PARALLEL, f"{CPU_PARALLEL} on the CPU"
        n = max(1, min(CPU_PARALLEL, host_bytes // 8 // per))
        return int(n), (
            f"{n} slot(s) of {slot_kv_bytes / GIB:.2f} GiB of KV each on the CPU, within an eighth of the "
            f"{host_bytes / GIB:.1f} GiB of RAM available"
        )
    n = max(1, min(AUTO_PARALLEL, free_bytes // 8 // per))
    return int(n), (
        f"{n} slot(s) of {slot_kv_bytes / GIB:.2f} GiB of KV each, within an eighth of the {free_bytes / GIB:.1f} GiB "
        "free on the card"
    )


CONTEXT_STEP = 1024  # --max-context auto grows in steps of this many positions


def context_floor(n_ctx_train: int, base: int) -> int:
    """The least --max-context auto gives: the fixed default, or the trained length where that is shorter (0:
    not in the file)."""
    return min(base, n_ctx_train) if n_ctx_train > 0 else base


def auto_context(
    geometry: Geometry, n_ctx_train: int, free_bytes: int | None, slots: int, base: int
) -> tuple[int, str]:
    """--max-context auto (serve's default): from `base` (the engine's fixed default) up to the positions the model
    was trained for, the most whose KV, for every slot, stays within an eighth of the card's free VRAM (the share
    --parallel auto gives the slots; the rest goes to the weights and the expert cache). Never below `base` (or the
    trained length, where that is shorter); on the CPU (`free_bytes` None) `base`, since a CPU reads a long prompt
    in minutes and its KV is allocated up front in RAM. -> (positions, the reason, for the log)."""
    floor = context_floor(n_ctx_train, base)
    if free_bytes is None:
        return floor, f"{floor} on the CPU; --max-context N gives more"
    if n_ctx_train <= floor:
        return floor, f"{floor}, the length the model was trained for"

    def kv(context: int) -> int:
        return max(1, slots) * sum(geometry.kv_bytes(i, context) for i in range(geometry.n_layer))

    room = free_bytes // 8
    if kv(n_ctx_train) <= room:
        best = n_ctx_train
    else:
        best = floor
        lo, hi = floor // CONTEXT_STEP + 1, n_ctx_train // CONTEXT_STEP  # steps above the floor, bisected
        while lo <= hi:
            mid = (lo + hi) // 2
            if kv(mid * CONTEXT_STEP) <= room:
                best, lo = mid * CONTEXT_STEP, mid + 1
            else:
                hi = mid - 1
    return best, (
        f"{best} of the {n_ctx_train} trained: the KV of {slots} slot(s) at {best} positions is "
        f"{kv(best) / GIB:.2f} GiB, within an eighth of the {free_bytes / GIB:.1f} GiB free on the card"
        if best > floor
        else f"{best}: the KV of {slots} slot(s) at more positions would pass an eighth of the "
        f"{free_bytes / GIB:.1f} GiB free on the card"
    )


@dataclass(frozen=True)
class Budget:
    """How much of each card the placement may plan with."""

    context: int
    reserve_first: int = DEFAULT_RESERVE_BYTES  # --vram-reserve-mib: headroom on the first card
    reserve_later: int | None = None  # --vram-reserve-later-mib (default: reserve_first)
    overhead: int = DEFAULT_OVERHEAD_BYTES  # CUDA context, activations and prompt buffers per card
    sequences: int = 1  # --parallel: KV caches of `context` positions each
    kv_resident: int | None = None  # --kv-resident: positions of each cache's KV in VRAM (None: all)

    @property
    def kv_positions(self) -> int:
        """The positions of KV a card holds per sequence (the rest lives in host RAM)."""
        return self.context if self.kv_resident is None else min(self.context, max(self.kv_resident, 0))

    def reserve(self, stage: int) -> int:
        if stage == 0 or self.reserve_later is None:
            return self.reserve_first
        return self.reserve_later


@dataclass(frozen=True)
class StageFit:
    card: Card
    begin: int
    end: int
    first: bool
    last: bool
    fixed_bytes: int  # dense weights, KV, token table / head, overhead
    usable_bytes: int  # free VRAM less the reserve
    capacity: int  # routed experts the cache has room for
    pairs: int  # routed (layer, expert) pairs of its layers
    held: int  # pairs its cache holds (the hottest of its layers)
    profiled_held: int  # of those, pairs the profile saw used
    weight_held: float  # their profile weight
    kv_bytes: int = 0  # of fixed_bytes: the KV of its layers at the context, for every sequence

    @property
    def layers(self) -> int:
        return self.end - self.begin

    @property
    def shortfall(self) -> int:
        return max(self.fixed_bytes - self.usable_bytes, 0)

    def fill(self, expert_bytes: int) -> float:
        """Share of the card's usable VRAM in use once its cache holds `held` experts."""
        used = self.fixed_bytes + self.held * expert_bytes
        return used / self.usable_bytes if self.usable_bytes > 0 else math.inf


@dataclass(frozen=True)
class Placement:
    cards: tuple[Card, ...]  # stage order
    starts: tuple[int, ...]  # first layer of each card after the first
    stages: tuple[StageFit, ...]
    rule: Literal["single", "manual", "share", "profile", "proportional", "skip"]
    n_layer: int
    pairs_profiled: int
    pairs_held: int
    fullest: float
    order_note: str | None = None
    notes: tuple[str, ...] = field(default=())

    @property
    def ranges(self) -> tuple[range, ...]:
        bounds = (0, *self.starts, self.n_layer)
        return tuple(range(a, b) for a, b in itertools.pairwise(bounds))

    def log_lines(self) -> list[str]:
        """The seed's start-up lines: the card order when it changed, the auto choice, and who runs what."""
        out: list[str] = []
        if self.order_note:
            out.append(f"layer split: {self.order_note}")
        out.extend(self.notes)
        if self.rule in ("share", "profile", "proportional"):
            k = ",".join(str(s) for s in self.starts)
            why = {
                "share": "; each card owns at least its share of the layers by its room for experts (#2644 rule)",
                "profile": "; the placement whose caches hold the most of the profile",
                "proportional": "; layers in proportion to each card's room (more than four cards)",
            }[self.rule]
            out.append(
                f"layer split auto: K={k} - the caches hold {self.pairs_held} of {self.pairs_profiled} profiled "
                f"pairs (fullest device {self.fullest:.0%}){why}"
            )
        if len(self.stages) > 1:
            parts = ", ".join(f"{s.begin}-{s.end - 1} ({s.card.label})" for s in self.stages)
            out.append(f"layer split: layers {parts}, one hand-off per window")
        return out


# ---------------------------------------------------------------------------------------------------------------
# Card order


def order_cards(
    cards: Sequence[Card], gpu_order: GpuOrder = "auto", manual: bool = False
) -> tuple[tuple[Card, ...], str | None]:
    """The stage order and, when it differs from the order given, the log note saying why."""
    given = tuple(cards)
    if gpu_order == "as_given" or manual or len(given) < 2:
        return given, None
    if any(c.speed is None for c in given):
        return given, None
    fastest = max(given, key=lambda c: (c.speed or 0.0, -given.index(c)))  # the first of equals
    last = given[-1]
    fast, slow = fastest.speed or 0.0, last.speed or 0.0
    if fastest is last or fast <= slow * (1.0 + TIE_FRACTION):
        return given, None
    order = (*(c for c in given if c is not fastest), fastest)
    note = (
        f"card order {', '.join(c.label for c in order)} - {fastest.label} ({fastest.name}, {fastest.sm_count} SMs "
        f"x {fastest.max_clock_mhz} MHz) is {fast / slow - 1.0:.0%} faster than {last.label} and goes last "
        '(it runs the head); "gpu_order": "as_given" keeps your order'
    )
    return order, note


# ---------------------------------------------------------------------------------------------------------------
# Pricing one placement


class _Pricer:
    """Prices card j holding layers [a, b): prefix sums over layers and, with a profile, the top-k weights of a
    range (memoized: an exhaustive search over four cards asks for each (card, range) many times)."""

    def __init__(
        self, g: Geometry, profile: np.ndarray | None, budget: Budget, cards: Sequence[Card]
    ) -> None:
        self.g, self.budget, self.cards = g, budget, tuple(cards)
        n = g.n_layer
        self.dense = np.concatenate([[0], np.cumsum(g.dense_bytes, dtype=np.int64)])
        self.kv = np.concatenate(
            [
                [0],
                np.cumsum(
                    [g.kv_bytes(i, budget.kv_positions) * budget.sequences for i in range(n)], dtype=np.int64
                ),
            ]
        )
        has = [1 if g.expert_bytes[i] else 0 for i in range(n)]
        self.expert_layers = np.concatenate([[0], np.cumsum(has, dtype=np.int64)])
        moe = [b for b in g.expert_bytes if b]
        self.expert_bytes = max(moe) if moe else 0  # the cache's slot size
        if profile is not None:
            w = np.asarray(profile, dtype=np.float64)
            if w.shape != (n, g.n_expert):
                raise PlacementError(
                    f"the expert profile has shape {tuple(w.shape)}, the model {n} layers x {g.n_expert} experts: "
                    "it belongs to another model; delete it and let the engine record a new one"
                )
            w = np.where(np.asarray(has, dtype=bool)[:, None], np.maximum(w, 0.0), 0.0)
        else:
            w = np.asarray(has, dtype=np.float64)[:, None] * np.ones(
                (n, max(g.n_expert, 1))
            )  # every pair alike
        self.weights = w  # [L, E]
        self.profiled = w > 0  # [L, E]
        self._memo: dict[tuple[int, int, int, int], StageFit] = {}

    def pairs_profiled(self) -> int:
        return int(self.profiled.sum())

    def fixed(self, a: int, b: int, first: bool, last: bool) -> int:
        g = self.g
        out = int(self.dense[b] - self.dense[a]) + int(self.kv[b] - self.kv[a]) + self.budget.overhead
        if first:
            out += g.embed_bytes
        if last:
            out += g.head_bytes + g.draft_bytes
        return out

    def usable(self, stage: int, card: Card) -> int:
        return card.free_bytes - self.budget.reserve(stage)

    def stage(self, j: int, a: int, b: int, n_stages: int) -> StageFit:
        key = (j, a, b, n_stages)
        hit = self._memo.get(key)
        if hit is not None:
            return hit
        card = self.cards[j]
        first, last = j == 0, j == n_stages - 1
        fixed = self.fixed(a, b, first, last)
        usable = self.usable(j, card)
        room = max(usable - fixed, 0)
        capacity = room // self.expert_bytes if self.expert_bytes else 0
        pairs = int(self.expert_layers[b] - self.expert_layers[a]) * self.g.n_expert
        held = min(capacity, pairs)
        if held == 0:
            weight, profiled = 0.0, 0
        else:
            w = self.weights[a:b].ravel()
            if held >= w.size:
                weight, profiled = float(w.sum()), int(np.count_nonzero(w))
            else:
                top = np.partition(w, w.size - held)[w.size - held :]  # the `held` hottest pairs
                weight, profiled = float(top.sum()), int(np.count_nonzero(top))
        kv = int(self.kv[b] - self.kv[a])
        fit = StageFit(card, a, b, first, last, fixed, usable, capacity, pairs, held, profiled, weight, kv)
        self._memo[key] = fit
        return fit

    def stages(self, starts: Sequence[int]) -> tuple[StageFit, ...]:
        bounds = (0, *starts, self.g.n_layer)
        n = len(bounds) - 1
        return tuple(self.stage(j, bounds[j], bounds[j + 1], n) for j in range(n))


def _fullest(stages: Sequence[StageFit], expert_bytes: int) -> float:
    return max(s.fill(expert_bytes) for s in stages)


def _score(stages: Sequence[StageFit], expert_bytes: int) -> tuple[float, int, float]:
    """Most profile weight held, then most pairs held, then the most room left on the fullest card."""
    return (
        sum(s.weight_held for s in stages),
        sum(s.held for s in stages),
        -_fullest(stages, expert_bytes),
    )


def _shortfall_error(stages: Sequence[StageFit], context: int, what: str) -> PlacementError:
    worst = max(stages, key=lambda s: s.shortfall)
    return PlacementError(
        f"{what}: {worst.card.label} ({worst.card.name}) needs {worst.fixed_bytes / GIB:.1f} GiB for layers "
        f"{worst.begin}-{worst.end - 1} (dense weights, the KV of {context} tokens and working buffers"
        f"{', the head' if worst.last else ''}) but has {worst.usable_bytes / GIB:.1f} GiB free after the reserve: "
        f"move the split, add a card, or lower --max-context or --vram-reserve-mib{_kv_way_out(worst, context)}"
    )


def _kv_way_out(fit: StageFit, context: int) -> str:
    """Where the KV is what does not fit: the context that fits with this KV type, and that a smaller type gives.
    (Experts give way to KV first: the cache holds whatever room is left, since every position's KV is read at
    every step and an expert only when a token chooses it; KV moves to host RAM only with --kv-resident.)"""
    if not fit.kv_bytes or fit.kv_bytes < fit.shortfall:
        return ""
    per = fit.kv_bytes / max(context, 1)
    fits = int((fit.kv_bytes - fit.shortfall) / per) // CONTEXT_STEP * CONTEXT_STEP if per else 0
    where = f" (the KV of {context} tokens is {fit.kv_bytes / GIB:.1f} GiB of it"
    where += f"; --max-context {fits} fits)" if fits >= CONTEXT_STEP else ")"
    return (
        f"{where}; a smaller KV type holds more: --kv int8 half of bf16's bytes, --kv q4_0 about 0.28 of them; or "
        f"keep part of the KV in host RAM (slower decode): --kv-resident {max(fits, 0)}"
    )


# ---------------------------------------------------------------------------------------------------------------
# Validation


def check_manual_split(
    starts: Sequence[int], n_stages: int, n_layer: int, source: str = "--layer-split"
) -> None:
    """A manual split: one rising first layer per card after the first, the last card keeping two layers."""
    nums = list(starts)
    example = ",".join(str(round(n_layer * i / n_stages)) for i in range(1, n_stages)) if n_stages > 1 else ""
    if len(nums) != n_stages - 1:
        raise PlacementError(
            f"{source} {','.join(map(str, nums))} has {len(nums)} number(s) for {n_stages} card(s): give the first "
            f"layer of each card after the first ({n_stages - 1} rising numbers), e.g. {example or 'none'}"
        )
    prev = 0
    for s in nums:
        if s <= prev:
            raise PlacementError(
                f"{source} {','.join(map(str, nums))} does not rise: each number is the first layer of the next card "
                f"(not a count of layers), each above the one before and above 0, e.g. {example}"
            )
        prev = s
    if nums and nums[-1] >= n_layer:
        raise PlacementError(
            f"{source} {','.join(map(str, nums))}: the model has {n_layer} layers (0-{n_layer - 1}), every number "
            f"must be below {n_layer}, e.g. {example}"
        )
    if nums and n_layer - nums[-1] < MIN_LAST_LAYERS:
        raise PlacementError(
            f"{source} {','.join(map(str, nums))} leaves the last card {n_layer - nums[-1]} layer (layer "
            f"{n_layer - 1}); it keeps {MIN_LAST_LAYERS} at least: use {n_layer - MIN_LAST_LAYERS} or lower, e.g. {example}"
        )


def check_cards(cards: Sequence[Card]) -> None:
    """Cards a split can use: compute capability 7.5 or newer, each named once."""
    seen: set[int] = set()
    for c in cards:
        if c.index in seen:
            raise PlacementError(f"{c.label} is named twice: name each card once, e.g. --gpus 0,1")
        seen.add(c.index)
    old = [c for c in cards if c.compute_capability < MIN_CC]
    if old:
        ok = [c.label for c in cards if c.compute_capability >= MIN_CC]
        bad = ", ".join(
            f"{c.label} ({c.name}, compute capability {c.compute_capability[0]}.{c.compute_capability[1]})"
            for c in old
        )
        instead = f"; use {', '.join(ok)}" if ok else ""
        raise PlacementError(
            f"{bad} is older than the RTX 20 series: the engine needs compute capability 7.5 or newer{instead}"
        )


# ---------------------------------------------------------------------------------------------------------------
# The plan


def _single(
    pr: _Pricer, card: Card, rule: Literal["single", "skip"], notes: tuple[str, ...] = ()
) -> Placement:
    st = (pr.stage(0, 0, pr.g.n_layer, 1),)
    return Placement(
        (card,), (), st, rule, pr.g.n_layer, pr.pairs_profiled(), st[0].profiled_held,
        _fullest(st, pr.expert_bytes), None, notes,
    )  # fmt: skip


def _fits_alone(g: Geometry, pr: _Pricer, card: Card) -> tuple[bool, int, int]:
    """Does the first card hold every profiled expert, the dense weights, the KV, head, draft and the reserve?"""
    need = pr.fixed(0, g.n_layer, True, True) + pr.pairs_profiled() * pr.expert_bytes
    have = pr.usable(0, card)
    return need <= have, need, have


def _proportional(g: Geometry, pr: _Pricer, n: int) -> tuple[int, ...]:
    rooms = [
        max(pr.usable(j, c) - pr.budget.overhead - (g.embed_bytes if j == 0 else 0), 1)
        for j, c in enumerate(pr.cards)
    ]
    total, acc, starts = sum(rooms), 0, []
    for j in range(n - 1):
        acc += rooms[j]
        lo = (starts[-1] if starts else 0) + MIN_LAYERS_PER_CARD
        hi = g.n_layer - MIN_LAYERS_PER_CARD * (n - 1 - j)
        starts.append(min(max(round(g.n_layer * acc / total), lo), hi))
    return tuple(starts)


def _share_minimums(g: Geometry, pr: _Pricer) -> tuple[int, int]:
    """#2644: each of two cards' share of the layers by its room for experts (free less reserve, overhead,
    the token table on the first and the head and draft on the last)."""
    rooms = []
    for j, c in enumerate(pr.cards):
        room = pr.usable(j, c) - pr.budget.overhead
        room -= g.embed_bytes if j == 0 else g.head_bytes + g.draft_bytes
        rooms.append(max(room, 0))
    total = sum(rooms)
    if total == 0:
        return (0, 0)
    return (math.floor(g.n_layer * rooms[0] / total), math.floor(g.n_layer * rooms[1] / total))


def plan(
    cards: Sequence[Card],
    geometry: Geometry,
    budget: Budget,
    layer_split: Literal["auto"] | Sequence[int] = "auto",
    profile: np.ndarray | None = None,
    gpu_order: GpuOrder = "auto",
    skip_if_fits: bool = False,
    allow_shortfall: bool = False,
) -> Placement:
    """Where each card's layers go. `cards` in the order the user gave them (the first is the main card);
    `profile` [n_layer, n_expert] counts of expert selections, or None (every pair alike). A placement that does
    not fit raises PlacementError, or with `allow_shortfall` (a preview) is returned with its `shortfall`s: the
    one missing the fewest bytes under auto."""
    if not cards:
        raise PlacementError("no card to place the model on: name one with --gpu N or --gpus 0,1")
    check_cards(cards)
    g = geometry
    manual = layer_split != "auto"
    ordered, note = order_cards(cards, gpu_order, manual)
    n = len(ordered)
    pr = _Pricer(g, profile, budget, ordered)
    if n == 1:
        if manual and list(layer_split):
            check_manual_split(list(layer_split), 1, g.n_layer)
        p = _single(pr, ordered[0], "single")
        if p.stages[0].shortfall and not allow_shortfall:
            raise _shortfall_error(p.stages, budget.context, "the model does not fit the card")
        return p
    if manual:
        starts = tuple(int(s) for s in layer_split)  # type: ignore[union-attr]
        check_manual_split(starts, n, g.n_layer)
        stages = pr.stages(starts)
        if any(s.shortfall for s in stages) and not allow_shortfall:
            raise _shortfall_error(
                stages, budget.context, f"--layer-split {','.join(map(str, starts))} does not fit"
            )
        held = sum(s.profiled_held for s in stages)
        return Placement(
            ordered, starts, stages, "manual", g.n_layer, pr.pairs_profiled(), held,
            _fullest(stages, pr.expert_bytes), note,
        )  # fmt: skip

    if skip_if_fits:
        first = cards[0]  # the main card, before any reordering
        single = _Pricer(g, profile, budget, (first,))
        fits, need, have = _fits_alone(g, single, first)
        if fits:
            line = (
                f"layer split auto: {first.label} holds every profiled expert ({single.pairs_profiled()} pairs), the "
                f"KV of {budget.context} tokens and the reserve ({need / GIB:.1f} of {have / GIB:.1f} GiB): running on "
                "it alone (split_skip_if_fits)"
            )
            return _single(single, first, "skip", (line,))
        notes: tuple[str, ...] = (
            f"split_skip_if_fits: {first.label} would need {need / GIB:.1f} GiB for everything and has "
            f"{have / GIB:.1f} GiB after the reserve: the split stays",
        )
    else:
        notes = ()

    if g.n_layer < MIN_LAYERS_PER_CARD * n:
        raise PlacementError(
            f"layer split auto gives each card {MIN_LAYERS_PER_CARD} layers at least, and the model has {g.n_layer} "
            f"layers for {n} cards: use fewer cards (--gpus) or give the split yourself (--layer-split)"
        )
    if n > MAX_EXHAUSTIVE_CARDS:
        starts = _proportional(g, pr, n)
        stages = pr.stages(starts)
        if any(s.shortfall for s in stages) and not allow_shortfall:
            raise _shortfall_error(stages, budget.context, "the model does not fit these cards")
        return Placement(
            ordered, starts, stages, "proportional", g.n_layer, pr.pairs_profiled(),
            sum(s.profiled_held for s in stages), _fullest(stages, pr.expert_bytes), note, notes,
        )  # fmt: skip

    share = _share_minimums(g, pr) if n == 2 else None
    best: dict[str, tuple[tuple[float, int, float], tuple[int, ...]]] = {}
    worst_short: tuple[StageFit, ...] | None = None
    lo, hi = MIN_LAYERS_PER_CARD, g.n_layer - MIN_LAYERS_PER_CARD
    for starts in itertools.combinations(range(lo, hi + 1), n - 1):
        bounds = (0, *starts, g.n_layer)
        if any(b - a < MIN_LAYERS_PER_CARD for a, b in itertools.pairwise(bounds)):
            continue
        stages = pr.stages(starts)
        if any(s.shortfall for s in stages):
            if worst_short is None or sum(s.shortfall for s in stages) < sum(
                s.shortfall for s in worst_short
            ):
                worst_short = stages
            continue
        score = _score(stages, pr.expert_bytes)
        rules = ["profile"]
        if share is not None and all(s.layers >= m for s, m in zip(stages, share, strict=True)):
            rules.append("share")
        for rule in rules:
            if rule not in best or score > best[rule][0]:
                best[rule] = (score, starts)
    if not best:
        assert worst_short is not None
        if not allow_shortfall:
            raise _shortfall_error(
                worst_short, budget.context, "the model does not fit these cards with any split"
            )
        starts = tuple(s.begin for s in worst_short[1:])
        return Placement(
            ordered, starts, worst_short, "profile", g.n_layer, pr.pairs_profiled(),
            sum(s.profiled_held for s in worst_short), _fullest(worst_short, pr.expert_bytes), note, notes,
        )  # fmt: skip
    rule: Literal["share", "profile"] = "share" if "share" in best else "profile"
    starts = best[rule][1]
    stages = pr.stages(starts)
    return Placement(
        ordered, starts, stages, rule, g.n_layer, pr.pairs_profiled(),
        sum(s.profiled_held for s in stages), _fullest(stages, pr.expert_bytes), note, notes,
    )  # fmt: skip

"""How many experts each card keeps in VRAM: from `--expert-cache N`, a VRAM budget, or the free VRAM."""

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from engine.experts.cache import MAX_STEP_ROWS, ExpertCache
from engine.experts.capacity import LAYER_MISS_COST, plan_capacity
from engine.experts.prefetch import AREAS, PREFETCH_MODES, PrefetchError
from engine.kernels import int8_activations
from installer.engine_options import D as OPTION_DEFAULTS


class PlacedModel(Protocol):
    """What the cache is built from: a model's layers (each with its `experts`), its card and its config."""

    layers: Mapping[int, Any]
    device: torch.device
    cfg: Any


log = logging.getLogger("strata.engine")
MiB = 1 << 20
GiB = 1 << 30
MISS_PATHS = ("direct", "copy")
EVICTIONS = ("profile", "lru", "lfu")
# Room kept for activations, the dequantized tiles of prompt chunks and CUDA graphs.
WORKSPACE_BYTES = 768 * MiB
STAGE_ROWS = 8  # decode rows whose misses the staging area holds (decode_stage_slots)


@dataclass(frozen=True)
class ExpertPolicy:
    slots: int | None = None  # --expert-cache N: experts in VRAM on this card (all layers together)
    vram_budget_mib: int | None = None  # make the card behave like one of this size (tests, shared cards)
    # --vram-reserve-mib: left free for the desktop and other programs
    reserve_mib: int = OPTION_DEFAULTS.vram_reserve_mib
    kv_bytes: int = 0  # the KV cache still to be allocated
    profile: torch.Tensor | None = None  # usage counts [n_layer, n_expert] to fill the cache hottest first
    miss_path: str = (
        "copy"  # --expert-misses: "copy" (staged in VRAM first) or "direct" (kernels read host memory)
    )
    # --cpu-experts F: of the experts in host RAM, the fraction the CPU may compute on a miss. None: every expert
    # of the layers whose blocks the CPU reads in place (Q4_K, engine/experts/cpu_q4k.py), none elsewhere.
    cpu_share: float | None = None
    cpu_ratio: float | None = None  # the CPU's share of a step's misses, fixed (None: tuned while serving)
    # --expert-policy: "profile" (the profile's hottest, filled at start and kept), or "lru" / "lfu":
    # decode steps admit their misses on the card (engine/kernels/expert_lru.py)
    eviction: str = "profile"
    lfu_decay: float = 0.9
    rows: int = 1  # decode rows a step at most (--parallel): the staging area holds their misses
    # what a layer that misses costs beyond its missed experts, in missed experts' worth (capacity.py); None: fill
    # the profile's hottest (layer, expert) pairs whatever the layer
    layer_miss_cost: float | None = LAYER_MISS_COST
    # --expert-prefetch: "router" stages the next MoE layer's predicted misses while a layer computes
    # (engine/experts/prefetch.py; its two areas come out of the budget), "off"
    prefetch: str = "off"


def check_prefetch(policy: ExpertPolicy) -> None:
    """--expert-prefetch's value, and the flags it works with (PrefetchError says which to change)."""
    if policy.prefetch not in PREFETCH_MODES:
        raise PrefetchError(f"--expert-prefetch {policy.prefetch!r}: use one of {', '.join(PREFETCH_MODES)}")
    if policy.prefetch != "off" and (policy.miss_path != "copy" or policy.eviction != "profile"):
        raise PrefetchError(
            f"--expert-prefetch {policy.prefetch} stages predicted misses beside a step's own copies: use it with "
            "--expert-misses copy and --expert-policy profile (the defaults)"
        )


def expert_budget(device: torch.device, policy: ExpertPolicy) -> int:
    """Bytes of VRAM left for expert slots once what is loaded, the KV cache and the workspace are counted."""
    held = torch.cuda.memory_allocated(device)
    if policy.vram_budget_mib is not None:
        room = policy.vram_budget_mib * MiB - held
    else:
        free, _total = torch.cuda.mem_get_info(device)
        room = free
    return room - policy.reserve_mib * MiB - policy.kv_bytes - WORKSPACE_BYTES


def stage_bytes(per_expert: dict[int, int], n_expert: int) -> int:
    """VRAM a prompt chunk's staging area takes at most: one layer's experts (ExpertCache.prompt_tables)."""
    return max(per_expert.values(), default=0) * n_expert


def decode_stage_slots(k: int, rows: int, slot_bytes: int = 0, budget: int = 0) -> int:
    """Experts a decode step's staging area holds: every miss of up to STAGE_ROWS rows (a step that misses more
    distinct experts reads the rest in place, over PCIe), but no more than an eighth of the experts' `budget` in
    `slot_bytes` slots beyond one row's k (large experts on a small card keep their room for cached ones). Pure."""
    slots = k * max(1, min(rows, STAGE_ROWS))
    if slot_bytes > 0:
        slots = min(slots, max(k, budget // 8 // slot_bytes // k * k))
    return slots


def build_expert_cache(model: PlacedModel, policy: ExpertPolicy) -> ExpertCache:
    experts = {i: lw.experts for i, lw in model.layers.items() if lw.experts is not None}
    per_expert = {i: sum(q.raw[0].numel() for q in (ew.gate, ew.up, ew.down)) for i, ew in experts.items()}
    budget = expert_budget(model.device, policy)
    n_expert = model.cfg.n_expert
    all_in = budget >= n_expert * sum(per_expert.values()) and (
        policy.slots is None or policy.slots >= n_expert * len(per_expert)
    )
    stage_slots = decode_stage_slots(model.cfg.n_expert_used, policy.rows)
    if not all_in:  # prompt chunks and decode steps stage the experts left in host memory: keep their room
        budget -= stage_bytes(per_expert, n_expert)
        if policy.miss_path == "copy" and experts:
            stride = max(q.raw[0].numel() for ew in experts.values() for q in (ew.gate, ew.up, ew.down))
            slot_bytes = 3 * -(-stride // 8) * 8  # a slot of kernels.stage_copy.Stager's area
            stage_slots = decode_stage_slots(model.cfg.n_expert_used, policy.rows, slot_bytes, budget)
            budget -= stage_slots * slot_bytes
            if policy.prefetch != "off":  # the prefetch's two areas of as many slots (prefetch.AREAS)
                budget -= AREAS * stage_slots * slot_bytes
    # a recency cache (lru, lfu) fills by heat alone: its hits come from reuse the profile's counts do not show
    capacity = plan_capacity(
        per_expert, n_expert, budget, policy.profile, max_pairs=policy.slots, top_k=model.cfg.n_expert_used,
        layer_cost=policy.layer_miss_cost if policy.eviction == "profile" else None,
    )  # fmt: skip
    if policy.kv_bytes > 0 and not all_in and per_expert:
        # KV and experts share the card: say what the context costs in experts, and how to get them back
        each = sum(per_expert.values()) / len(per_expert)
        log.info(
            "the KV cache still to come (%.2f GiB for the context and slots, with any later stage's share of this "
            "card) takes the room of %d experts on %s; a shorter "
            "--max-context, fewer --parallel slots or a smaller --kv type (int8: half of bf16's bytes) give it back",
            policy.kv_bytes / GiB, min(int(policy.kv_bytes // each), n_expert * len(per_expert)), _label(model.device),
        )  # fmt: skip
    if budget <= 0:
        log.warning(
            "no VRAM left for experts on %s (budget %.0f MiB): every expert is read from host RAM",
            model.device,
            budget / MiB,
        )
    if policy.miss_path not in MISS_PATHS:
        raise ValueError(f"--expert-misses {policy.miss_path!r}: use one of {', '.join(MISS_PATHS)}")
    if policy.eviction not in EVICTIONS:
        raise ValueError(f"--expert-policy {policy.eviction!r}: use one of {', '.join(EVICTIONS)}")
    check_prefetch(policy)
    cache = ExpertCache(
        experts,
        model.device,
        capacity,
        policy.profile,
        device_label=_label(model.device),
        miss_path=policy.miss_path,
        eviction=policy.eviction if model.device.type == "cuda" else "profile",
        lfu_decay=policy.lfu_decay,
        max_selections=MAX_STEP_ROWS * model.cfg.n_expert_used,
        stage_slots=stage_slots,
    )
    auto = policy.cpu_share is None
    if auto and (
        policy.miss_path != "copy"
        or model.device.type != "cuda"
        or not int8_activations()  # --activations float: exact products, and the CPU's kernels round
        or not cache.streams_prompts  # every expert in VRAM: no misses
    ):
        return cache  # the hand-off is for a card's decode misses; nothing to share here
    if auto or policy.cpu_share > 0:
        if policy.miss_path != "copy":
            raise ValueError("--cpu-experts works with --expert-misses copy (the default)")
        from engine.experts.cpu_misses import CpuMisses  # lazy: its mailboxes are Triton kernels (optional)

        cm = CpuMisses(
            cache, 1.0 if auto else policy.cpu_share, model.cfg.n_expert_used, model.cfg.activation,
            policy.profile, in_place_only=auto, **({} if policy.cpu_ratio is None else {"ratio": policy.cpu_ratio}),
        )  # fmt: skip
        cache.cpu_misses = cm if cm.layers else None
    return cache


def _label(device: torch.device) -> str:
    return f"CUDA{device.index if device.index is not None else torch.cuda.current_device()}"

"""From the split options (`--gpus`, `--gpu`, `--layer-split`, `--split-device`, `--gpu-order`, the reserves) to the
stages of one PC: which layers on which device, checked before anything is loaded, then built.

`plan_stages` is pure (cards come in as data, so every rule is tested without a GPU); `visible_cards` asks the
driver; `build_model` loads each stage's layers on its device.
"""

from __future__ import annotations

import itertools
import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch

from engine.experts.policy import WORKSPACE_BYTES, ExpertPolicy
from engine.gguf import names
from engine.gguf.model_config import ModelConfig
from engine.gguf.reader import GGUFFile, block_index
from engine.layers.kv_cache import kv_bytes_per_token
from engine.models.decoder import DecoderLM
from engine.pipeline.handoff import HandoffMode
from engine.pipeline.loader import build
from engine.pipeline.prefill import device_chunk, device_span
from engine.pipeline.stages import LocalStage, SplitModel
from installer.engine_options import D as OPTION_DEFAULTS
from installer.gpus import probe
from installer.placement import (
    MIB,
    Budget,
    Card,
    Geometry,
    GpuOrder,
    Placement,
    PlacementError,
    check_cards,
    check_manual_split,
    host_kv_layers,
    plan,
)

log = logging.getLogger("strata.engine")

LayerSplitArg = Literal["auto"] | tuple[int, ...] | None
_EXPERT_PARTS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps", "ffn_gate_up_exps")


@dataclass(frozen=True)
class SplitOptions:
    """The split flags as given (the CLI and the config fill it; `plan_stages` checks it)."""

    device: str = "auto"  # --device: auto, cpu, cuda, cuda:N
    gpu: int | None = None  # --gpu N: one card
    gpus: tuple[int, ...] | Literal["all"] | None = None  # --gpus 0,2 | all
    layer_split: LayerSplitArg = None  # --layer-split auto | K1,K2 (None: auto when several cards)
    split_device: tuple[str, ...] = ()  # --split-device D1,D2: later stages' devices (card numbers or cpu)
    gpu_order: GpuOrder = "auto"
    reserve_mib: int = OPTION_DEFAULTS.vram_reserve_mib
    reserve_later_mib: int | None = None
    skip_if_fits: bool = False
    handoff: HandoffMode = "auto"
    pipeline: bool | None = None  # prompt pieces overlapped across stages (None: when the devices differ)
    pipe_chunk: int = 512
    remote: str | None = None  # --remote-stage HOST:PORT: layers [K, end) on worker PCs
    remote_key: str | None = (
        None  # --remote-stage-key: the worker's public key (else from STRATA_STAGE_TOKEN)
    )
    stage_key: str | None = None  # --stage-key: this side's key file
    remote_timing: bool = False  # STRATA_REMOTE_TIMING=1
    remote_stall_s: float = 3.0
    expert_slots: int | None = None  # --expert-cache N: routed experts in VRAM on each card
    vram_budget_mib: int | None = None  # --vram-budget-mib: each card behaves as one of this size
    expert_misses: str = "copy"  # --expert-misses copy|direct: how a decode step reads experts in host memory
    expert_policy: str = (
        "profile"  # --expert-policy profile|lru|lfu: which experts stay in VRAM as decode goes
    )
    expert_prefetch: str = "off"  # --expert-prefetch off|router (engine/experts/prefetch.py)
    cpu_share: float | None = None  # --cpu-experts F (None: auto, engine/experts/policy.py)
    cpu_ratio: float | None = None  # --cpu-ratio R: the CPU's share of a step's misses (None: the default)
    cpu_weights_mib: int | None = None  # --cpu-weights-mib: float copies of CPU layers' weights (None: auto)
    profile: str | None = None  # --profile PATH: the usage profile to read (default: the data dir's)
    use_profile: bool = True  # --no-profile: fill the caches and place the layers without one
    kv_resident: int | None = None  # --kv-resident N: positions of KV in VRAM (None: all)


@dataclass(frozen=True)
class StagePlan:
    ranges: tuple[range, ...]
    devices: tuple[int | None, ...]  # card number as nvidia-smi gives it, or None for the CPU
    placement: Placement | None = None
    lines: tuple[str, ...] = field(default=())

    @property
    def labels(self) -> tuple[str, ...]:
        return tuple("CPU" if d is None else f"CUDA{d}" for d in self.devices)

    @property
    def split(self) -> bool:
        return len(self.ranges) > 1


# ---------------------------------------------------------------------------------------------------------------
# Parsing the flags


def parse_gpus(text: str) -> tuple[int, ...] | Literal["all"]:
    t = text.strip().lower()
    if t == "all":
        return "all"
    parts = [p.strip() for p in t.split(",")]
    if not t or not all(re.fullmatch(r"\d+", p) for p in parts):
        raise PlacementError(
            f"--gpus {text!r}: expected card numbers as nvidia-smi numbers them, e.g. 0,2, or all"
        )
    nums = tuple(int(p) for p in parts)
    if len(set(nums)) != len(nums):
        raise PlacementError(f"--gpus {text}: a card is named twice; name each card once, e.g. 0,2")
    return nums


def parse_layer_split(value: str | Sequence[int] | None) -> LayerSplitArg:
    """`auto`, `24,36` or [24, 36] (the first layer of each later card); None stays None."""
    if value is None:
        return None
    if isinstance(value, str):
        t = value.strip()
        if t.lower() == "auto":
            return "auto"
        parts = [p.strip() for p in t.split(",")]
        if not t or not all(re.fullmatch(r"\d+", p) for p in parts):
            raise PlacementError(
                f"--layer-split {value!r}: expected auto or the first layer of each later card, e.g. 24 or 24,36"
            )
        return tuple(int(p) for p in parts)
    return tuple(int(v) for v in value)


def parse_split_device(text: str | None) -> tuple[str, ...]:
    if not text:
        return ()
    parts = tuple(p.strip().lower() for p in text.split(","))
    for p in parts:
        if p != "cpu" and not re.fullmatch(r"(cuda:)?\d+", p):
            raise PlacementError(
                f"--split-device {text!r}: expected the later stages' card numbers (or cpu), e.g. 1 or 0,0"
            )
    return tuple(p.removeprefix("cuda:") for p in parts)


def _device_card(device: str, cards: Sequence[Card]) -> int | None:
    """--device as a card number (None: the CPU)."""
    d = device.strip().lower()
    if d == "cpu":
        return None
    if d == "auto":
        return cards[0].index if cards else None
    m = re.fullmatch(r"cuda(?::(\d+))?", d)
    if not m:
        raise PlacementError(f"--device {device!r} is not supported: use cpu, cuda or cuda:N")
    if not cards:
        raise PlacementError(
            f"--device {device} was asked for but no CUDA device is available: use --device cpu"
        )
    return int(m.group(1)) if m.group(1) else cards[0].index


# ---------------------------------------------------------------------------------------------------------------
# The plan


def _card(cards: Sequence[Card], index: int, flag: str) -> Card:
    for c in cards:
        if c.index == index:
            return c
    have = ", ".join(f"GPU {c.index} ({c.name})" for c in cards) or "no CUDA card"
    raise PlacementError(
        f"{flag} names GPU {index}, which this PC does not have (it has {have}): name a listed card"
    )


def _plain_lines(ranges: Sequence[range], labels: Sequence[str], note: str = "") -> tuple[str, ...]:
    parts = ", ".join(f"{r.start}-{r.stop - 1} ({lab})" for r, lab in zip(ranges, labels, strict=True))
    return (f"layer split: layers {parts}, one hand-off per window{note}",)


def plan_stages(
    opts: SplitOptions,
    n_layer: int,
    cards: Sequence[Card],
    geometry: Geometry | None = None,
    context: int = 4096,
    profile: np.ndarray | None = None,
    sequences: int = 1,
) -> StagePlan:
    """Which layers run on which device. `cards`: the CUDA cards this PC shows (empty without CUDA).
    `geometry` is needed to price a split on cards (`auto`, and the memory check of a manual split)."""
    if opts.gpus is not None and opts.gpu is not None:
        raise PlacementError(
            "--gpus and --gpu are both given: --gpus 0,2 runs cards together, --gpu 0 one card; give one"
        )
    if opts.gpus is not None and opts.split_device:
        raise PlacementError(
            "--gpus and --split-device are both given: --gpus names every stage's card; --split-device only the later "
            "stages' (with --layer-split K); give one"
        )
    split = opts.layer_split
    budget = Budget(
        context,
        opts.reserve_mib * MIB,
        None if opts.reserve_later_mib is None else opts.reserve_later_mib * MIB,
        sequences=sequences,
        kv_resident=opts.kv_resident,
    )

    # --gpus: every stage's card.
    if opts.gpus is not None:
        if not cards:
            raise PlacementError(
                "--gpus was given but this PC shows no CUDA card: leave it out to run on the CPU"
            )
        if opts.gpus == "all":
            chosen = [c for c in cards if c.compute_capability >= (7, 5)]
            if not chosen:
                raise PlacementError(
                    "--gpus all: no card has compute capability 7.5 or newer; the CPU mode runs without"
                )
        else:
            chosen = [_card(cards, i, f"--gpus {','.join(map(str, opts.gpus))}") for i in opts.gpus]
        check_cards(chosen)
        if len(chosen) == 1:
            if isinstance(split, tuple) and split:
                raise PlacementError(
                    f"--layer-split {','.join(map(str, split))} needs {len(split) + 1} cards but --gpus names one: "
                    "name more cards, or add --split-device to run the stages on one card"
                )
            return StagePlan((range(n_layer),), (chosen[0].index,))
        if geometry is None:
            raise ValueError("plan_stages needs the model geometry to place layers on several cards")
        p = plan(
            chosen,
            geometry,
            budget,
            "auto" if split in (None, "auto") else split,
            profile,
            opts.gpu_order,
            opts.skip_if_fits,
        )
        return StagePlan(p.ranges, tuple(c.index for c in p.cards), p, tuple(p.log_lines()))

    # One main device, later stages from --split-device or the next visible cards.
    main = (
        _card(cards, opts.gpu, f"--gpu {opts.gpu}").index
        if opts.gpu is not None
        else _device_card(opts.device, cards)
    )
    if main is not None:
        check_cards([_card(cards, main, f"--device {opts.device}")])
    if split in (None, "auto") or (isinstance(split, tuple) and not split):
        if opts.split_device:
            raise PlacementError(
                "--split-device places the later stages of --layer-split K; give the split, e.g. --layer-split 24 "
                "--split-device 0"
            )
        return StagePlan((range(n_layer),), (main,))
    assert isinstance(split, tuple)
    n = len(split) + 1
    check_manual_split(split, n, n_layer)
    later: list[int | None]
    if opts.split_device:
        if len(opts.split_device) != n - 1:
            raise PlacementError(
                f"--split-device {','.join(opts.split_device)} names {len(opts.split_device)} device(s) for the "
                f"{n - 1} later stage(s) of --layer-split {','.join(map(str, split))}: give one per later stage"
            )
        later = []
        for d in opts.split_device:
            if d == "cpu":
                later.append(None)
            else:
                later.append(_card(cards, int(d), f"--split-device {','.join(opts.split_device)}").index)
    elif main is None:
        later = [None] * (n - 1)  # a CPU run keeps every stage on the CPU
    else:
        after = [c.index for c in cards if c.index > main] + [c.index for c in cards if c.index < main]
        if len(after) < n - 1:
            raise PlacementError(
                f"--layer-split {','.join(map(str, split))} needs {n} cards but this PC shows {len(cards)}: name the "
                f"later stages' cards with --split-device (--split-device {','.join([str(main)] * (n - 1))} runs "
                "them all on one card: the check of the hand-off, not a speed mode)"
            )
        later = list(after[: n - 1])
    devices = (main, *later)
    bounds = (0, *split, n_layer)
    ranges = tuple(range(a, b) for a, b in itertools.pairwise(bounds))
    gpu_devs = [d for d in devices if d is not None]
    if len(gpu_devs) == n and len(set(gpu_devs)) == n and geometry is not None:
        chosen = [_card(cards, d, "--split-device") for d in gpu_devs]
        check_cards(chosen)
        p = plan(chosen, geometry, budget, split, profile, "as_given")
        return StagePlan(ranges, devices, p, tuple(p.log_lines()))
    labels = tuple("CPU" if d is None else f"CUDA{d}" for d in devices)
    note = ""
    if len(set(devices)) < n:
        note = " (several stages on one device: the check of the hand-off, not a speed mode)"
    return StagePlan(ranges, devices, None, _plain_lines(ranges, labels, note))


# ---------------------------------------------------------------------------------------------------------------
# Facts from the file and from the driver


def geometry_from_gguf(gf: GGUFFile, cfg: ModelConfig, kv_type: str) -> Geometry:
    """Bytes per layer of the file's own blocks (what a stage keeps on its card), from the header only."""
    n = cfg.n_layer
    dense = [0] * n
    experts = [0] * n
    for name, info in gf.tensors.items():
        i = block_index(name)
        if i is None or i >= n:
            continue
        if any(f"blk.{i}.{part}." in name for part in _EXPERT_PARTS):
            experts[i] += info.nbytes
        else:
            dense[i] += info.nbytes
    if cfg.n_expert:
        experts = [e // cfg.n_expert for e in experts]
    kv_token = kv_bytes_per_token(cfg, kv_type)
    window = tuple(cfg.sliding_window if cfg.is_swa(i) else 0 for i in range(n))
    embd = gf.tensors.get(names.TOKEN_EMBD)
    out = gf.tensors.get(names.OUTPUT)
    norm = gf.tensors.get(names.OUTPUT_NORM)
    head = (out.nbytes if out else (embd.nbytes if embd else 0)) + (norm.nbytes if norm else 0)
    return Geometry(
        n_layer=n,
        n_expert=cfg.n_expert,
        dense_bytes=tuple(dense),
        expert_bytes=tuple(experts),
        kv_bytes_per_token=(kv_token,) * n,
        kv_window=window if any(window) else (),
        embed_bytes=embd.nbytes if embd else 0,
        head_bytes=head,
    )


@dataclass(frozen=True)
class VisibleCard:
    card: Card
    ordinal: int  # torch's cuda:N for it


def _torch_uuid(ordinal: int) -> str | None:
    try:
        u = getattr(torch.cuda.get_device_properties(ordinal), "uuid", None)
    except Exception:
        return None
    return str(u).lower().removeprefix("gpu-") if u is not None else None


def visible_cards() -> list[VisibleCard]:
    """The CUDA cards this process can use, numbered as nvidia-smi numbers them (NVML), each with its torch
    ordinal (matched by UUID: torch's own order follows CUDA_VISIBLE_DEVICES and CUDA_DEVICE_ORDER)."""
    if not torch.cuda.is_available():
        return []
    count = torch.cuda.device_count()
    by_uuid = {u: i for i in range(count) if (u := _torch_uuid(i))}
    out: list[VisibleCard] = []
    try:
        result = probe(others=())
        gpus = result.gpus if result.ok else ()
    except Exception:
        gpus = ()
    for g in gpus:
        ordinal = by_uuid.get(g.uuid.lower().removeprefix("gpu-"))
        if ordinal is None:
            continue  # hidden by CUDA_VISIBLE_DEVICES
        free = torch.cuda.mem_get_info(ordinal)[0]
        card = Card(
            g.index, g.name, int(free), g.vram_total, g.compute_capability, g.sm_count, g.max_sm_clock_mhz
        )
        out.append(VisibleCard(card, ordinal))
    if out:
        return out
    for i in range(count):  # no NVML: torch's order and facts
        props = torch.cuda.get_device_properties(i)
        clock = getattr(props, "clock_rate", None)
        free = torch.cuda.mem_get_info(i)[0]
        card = Card(
            i, props.name, int(free), int(props.total_memory), (props.major, props.minor),
            props.multi_processor_count, int(clock) // 1000 if clock else None,
        )  # fmt: skip
        out.append(VisibleCard(card, i))
    return out


# ---------------------------------------------------------------------------------------------------------------
# Building


def _policies(
    sp: StagePlan,
    geometry: Geometry,
    context: int,
    opts: SplitOptions,
    profile: np.ndarray | None,
    sequences: int = 1,
    host: Sequence[frozenset[int]] | None = None,
) -> list[ExpertPolicy]:
    """Each stage's expert-cache policy: its card's reserve (the first card's or the later cards' setting), its own
    KV still to come (less the layers in `host`, each stage's KV in host RAM: kv_host), and - for stages sharing a
    card - room kept for the later stages' weights, KV and work."""
    n = len(sp.ranges)
    prof = torch.as_tensor(profile) if profile is not None else None
    if host is None:
        host = [kv_host(geometry, sp, j, context, opts) for j in range(n)]
    kv = [
        sum(geometry.kv_bytes(i, context) for i in r if i not in host[j]) * sequences
        for j, r in enumerate(sp.ranges)
    ]
    fixed = [sum(geometry.dense_bytes[i] for i in r) + kv[j] for j, r in enumerate(sp.ranges)]
    later = opts.reserve_mib if opts.reserve_later_mib is None else opts.reserve_later_mib
    out = []
    for j in range(n):
        keep = sum(fixed[k] + WORKSPACE_BYTES for k in range(j + 1, n) if sp.devices[k] == sp.devices[j])
        if j < n - 1 and sp.devices[n - 1] == sp.devices[j]:
            keep += geometry.head_bytes
        out.append(
            ExpertPolicy(
                slots=opts.expert_slots,
                vram_budget_mib=opts.vram_budget_mib,
                reserve_mib=opts.reserve_mib if j == 0 else later,
                kv_bytes=kv[j] + keep,
                profile=prof,
                miss_path=opts.expert_misses,
                eviction=opts.expert_policy,
                prefetch=opts.expert_prefetch,
                cpu_share=opts.cpu_share,
                cpu_ratio=opts.cpu_ratio,
                rows=sequences,
            )
        )
    return out


def kv_host(geometry: Geometry, sp: StagePlan, j: int, context: int, opts: SplitOptions) -> frozenset[int]:
    """The layers of stage j whose KV lives in host RAM (--kv-resident; a card's stage only)."""
    if sp.devices[j] is None:
        return frozenset()
    return host_kv_layers(geometry, sp.ranges[j], context, opts.kv_resident)


def build_model(
    gf: GGUFFile,
    cfg: ModelConfig,
    sp: StagePlan,
    dtype: torch.dtype,
    ordinals: dict[int, int] | None = None,
    opts: SplitOptions | None = None,
    context: int = 4096,
    kv_type: str = "bf16",
    profile: np.ndarray | None = None,
    sequences: int = 1,
) -> DecoderLM | SplitModel:
    """One `DecoderLM` per stage on its device (each maps and loads only its own layers); one stage is returned
    as the plain model."""
    opts = opts or SplitOptions()
    ordinals = ordinals or {}

    def torch_device(d: int | None) -> torch.device:
        return torch.device("cpu") if d is None else torch.device("cuda", ordinals.get(d, d))

    geometry = geometry_from_gguf(gf, cfg, kv_type)
    host = [kv_host(geometry, sp, j, context, opts) for j in range(len(sp.ranges))]
    policies = _policies(sp, geometry, context, opts, profile, sequences, host)
    for j, h in enumerate(host):
        if h:
            log.info("%s", host_kv_line(geometry, sp.ranges[j], h, context, sequences, sp.labels[j], opts))
    if not sp.split:
        return build(gf, cfg, torch_device(sp.devices[0]), dtype, experts=policies[0], kv_host_layers=host[0])
    n = len(sp.ranges)
    stages = []
    for j, (r, d, label) in enumerate(zip(sp.ranges, sp.devices, sp.labels, strict=True)):
        dev = torch_device(d)
        m = build(gf, cfg, dev, dtype, layers=r, embed=j == 0, head=j == n - 1, experts=policies[j],
                  kv_host_layers=host[j])  # fmt: skip
        stages.append(LocalStage(m, label))
    model = SplitModel(cfg, stages, handoff=opts.handoff, pipeline=opts.pipeline, pipe_chunk=opts.pipe_chunk)
    for line in model.describe():
        log.info("%s", line)
    return model


def host_kv_line(
    g: Geometry,
    layers: range,
    host: frozenset[int],
    context: int,
    sequences: int,
    label: str,
    opts: SplitOptions,
) -> str:
    """The log's line for the KV a stage keeps in host RAM."""
    gib = sum(g.kv_bytes(i, context) for i in host) * sequences / 2**30
    vram = sum(g.kv_bytes(i, context) for i in layers if i not in host) * sequences / 2**30
    names = _ranges(sorted(host))
    return (
        f"--kv-resident {opts.kv_resident}: the KV of layer(s) {names} ({gib:.2f} GiB for {context} positions x "
        f"{sequences} slot(s)) lives in page-locked host RAM and is read across PCIe at every step, {vram:.2f} GiB "
        f"of KV stays in VRAM on {label}; decode slows as the context used grows (docs/performance.md)"
    )


def _ranges(nums: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    out: list[str] = []
    for n in nums:
        if out and n == int(out[-1].split("-")[-1]) + 1:
            out[-1] = f"{out[-1].split('-')[0]}-{n}"
        else:
            out.append(str(n))
    return ", ".join(out)


def prefill_chunk(
    model: object,
    arg: str = "auto",
    default: int = 512,
    max_ctx: int | None = None,
    kv_type: str = "bf16",
    budget_mib: int | None = None,
    reserve_mib: int = ExpertPolicy.reserve_mib,
    slots: int = 1,
) -> int:
    """The prompt chunk `Runner` reads per forward for `--prefill auto`: on a pipelined split, several pieces per
    chunk so that the stages overlap (2 x stages pieces of `pipe_chunk`); on one card, given `max_ctx`, the largest
    chunk whose temporaries fit in the VRAM left once the KV caches of `slots` sequences (--parallel) are counted
    (engine/pipeline/prefill.py); otherwise `default`."""
    if arg != "auto":
        return int(arg)
    if isinstance(model, SplitModel) and model.pipeline and len(model.stages) > 1:
        return model.pipe_chunk * 2 * len(model.stages)
    if max_ctx is not None and not isinstance(model, SplitModel):
        return device_chunk(model, max_ctx, kv_type, budget_mib, reserve_mib, slots)
    return default


# Chunks of a pipelined split's span: 4 x 4 pieces on two stages empty the pipeline once for 16 pieces (1.88x one
# stage's time at best) where chunk by chunk it emptied once for 4 (1.6x).
SPLIT_SPAN_CHUNKS = 4


def prefill_span(
    model: object,
    chunk: int,
    max_ctx: int,
    kv_type: str = "bf16",
    budget_mib: int | None = None,
    reserve_mib: int = ExpertPolicy.reserve_mib,
    slots: int = 1,
) -> int:
    """The tokens `Runner` reads per forward: layer by layer in chunks of `chunk` on one card that streams experts
    for its prompt chunks (engine/pipeline/prefill.py, span_tokens); as one pipeline of `SPLIT_SPAN_CHUNKS`
    chunks on a split whose stages read a prompt's pieces at once (SplitModel.forward_span); `chunk` elsewhere."""
    if isinstance(model, SplitModel):
        return min(max_ctx, chunk * SPLIT_SPAN_CHUNKS) if model.pipelines_prompts else chunk

    return device_span(model, chunk, max_ctx, kv_type, budget_mib, reserve_mib, slots)

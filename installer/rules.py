"""Which cards PolyStrata can use, and why not: pure functions over `GpuInfo` (seed 002, "Not supported").

- compute capability 7.5 or newer (RTX 20 series on);
- Pascal and Volta (6.0 to 7.2) only when the user names them (`--gpus`), experimental;
- older than Pascal: never;
- under 8 GB of VRAM: alone, not together with other cards, unless named (then the risk is said and asked);
- Intel GPUs, and AMD cards next to NVIDIA ones, cannot share a model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from installer.gpus import GpuInfo, OtherAdapter

MIN_CC = (7, 5)
NAMED_MIN_CC = (6, 0)
MIN_GB_TOGETHER = 8


class Status(StrEnum):
    USABLE = "usable"
    ALONE_ONLY = "alone_only"
    NAMED_ONLY = "named_only"
    UNSUPPORTED = "unsupported"


@dataclass(frozen=True)
class CardAssessment:
    gpu: GpuInfo
    status: Status
    reason: str | None = None
    """Why the card cannot be used (or not together); None when it can."""
    risk: str | None = None
    """What goes wrong if the user names it anyway; None when naming it is fine or impossible."""

    @property
    def can_join(self) -> bool:
        """Recommended together with other cards without asking."""
        return self.status == Status.USABLE

    @property
    def can_run_alone(self) -> bool:
        return self.status in (Status.USABLE, Status.ALONE_ONLY)

    def line(self) -> str:
        """`GPU 0: NVIDIA GeForce RTX 5080, 16 GB VRAM - can be used` (the seed's listing)."""
        head = f"GPU {self.gpu.index}: {self.gpu.name}, {self.gpu.vram_gb} GB VRAM - "
        if self.status == Status.USABLE:
            return head + "can be used"
        if self.status == Status.ALONE_ONLY:
            return head + f"can be used alone - {self.reason}"
        return head + f"not supported - {self.reason}"


@dataclass(frozen=True)
class OtherAssessment:
    adapter: OtherAdapter
    reason: str

    def line(self) -> str:
        return f"{self.adapter.name} ({self.adapter.vendor}) - not supported - {self.reason}"


def _old_reason(gpu: GpuInfo) -> str:
    return (
        f"older than the RTX 20 series (compute capability {gpu.cc_text}; PolyStrata needs "
        f"{MIN_CC[0]}.{MIN_CC[1]} or newer)"
    )


def _small_reason(gpu: GpuInfo) -> str:
    return (
        f"less than {MIN_GB_TOGETHER} GB of VRAM, so not together with other cards (each card holds a copy of "
        "the dense weights and its own prompt buffers)"
    )


def assess(gpus: Sequence[GpuInfo]) -> list[CardAssessment]:
    """One assessment per card, in NVML order. The 8 GB rule applies only when two or more cards qualify."""
    modern = [g for g in gpus if g.compute_capability >= MIN_CC]
    out = []
    for gpu in gpus:
        if gpu.compute_capability < NAMED_MIN_CC:
            out.append(CardAssessment(gpu, Status.UNSUPPORTED, _old_reason(gpu)))
        elif gpu.compute_capability < MIN_CC:
            risk = (
                f"GPU {gpu.index} ({gpu.name}) is a Pascal/Volta card (compute capability {gpu.cc_text}): "
                "it runs only on the experimental CUDA 12 engine"
            )
            out.append(CardAssessment(gpu, Status.NAMED_ONLY, _old_reason(gpu), risk))
        elif gpu.vram_gb < MIN_GB_TOGETHER and len(modern) > 1:
            risk = (
                f"GPU {gpu.index} ({gpu.name}) has {gpu.vram_gb} GB of VRAM: next to other cards it holds its own "
                "copy of the dense weights and prompt buffers and may run out of memory"
            )
            out.append(CardAssessment(gpu, Status.ALONE_ONLY, _small_reason(gpu), risk))
        else:
            out.append(CardAssessment(gpu, Status.USABLE))
    return out


def assess_others(others: Sequence[OtherAdapter], has_nvidia: bool) -> list[OtherAssessment]:
    out = []
    for adapter in others:
        vendor = adapter.vendor.lower()
        if vendor == "intel":
            reason = "Intel GPUs are not supported"
        elif vendor == "amd" and has_nvidia:
            reason = "a mix of NVIDIA and AMD cards cannot share a model; PolyStrata uses the NVIDIA cards"
        elif vendor == "amd":
            reason = "AMD cards are not supported; PolyStrata runs on NVIDIA cards"
        else:
            reason = "only NVIDIA cards are supported"
        out.append(OtherAssessment(adapter, reason))
    return out


@dataclass(frozen=True)
class NamedCheck:
    """The user's own choice (`--gpus 0,1`): refused with errors, or admitted with risks to confirm."""

    gpus: tuple[int, ...]
    errors: tuple[str, ...] = ()
    risks: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.errors

    @property
    def needs_confirmation(self) -> bool:
        return self.ok and bool(self.risks)


def parse_gpu_list(text: str, assessments: Sequence[CardAssessment]) -> tuple[int, ...]:
    """`"0,2"` -> (0, 2); `"all"` -> every card that can join others (in NVML order). ValueError says why not."""
    value = text.strip().lower()
    if value == "all":
        chosen = tuple(a.gpu.index for a in assessments if a.can_join)
        if not chosen:
            raise ValueError(
                "--gpus all: no card here can share a model (see the list above); name cards by number"
            )
        return chosen
    parts = [p.strip() for p in value.split(",") if p.strip()]
    if not parts:
        raise ValueError(f"--gpus {text!r}: expected card numbers like 0,2 or 'all'")
    out: list[int] = []
    for part in parts:
        if not part.isdigit():
            raise ValueError(f"--gpus {text!r}: {part!r} is not a card number; expected e.g. 0,2 or 'all'")
        idx = int(part)
        if idx in out:
            raise ValueError(f"--gpus {text!r}: GPU {idx} is named twice")
        out.append(idx)
    return tuple(out)


def check_named(named: Sequence[int], assessments: Sequence[CardAssessment]) -> NamedCheck:
    """Rules for cards the user names: Pascal/Volta and small cards are admitted with a risk to confirm.

    Only NVIDIA cards have numbers, so AMD or Intel adapters can never enter a named set."""
    by_index = {a.gpu.index: a for a in assessments}
    usable = [f"GPU {a.gpu.index}" for a in assessments if a.can_run_alone]
    instead = f"cards that can be used: {', '.join(usable)}" if usable else "no card here can be used"
    errors: list[str] = []
    risks: list[str] = []
    if not named:
        errors.append("no GPU named; name at least one card, e.g. --gpus 0")
    for idx in named:
        a = by_index.get(idx)
        if a is None:
            have = ", ".join(str(i) for i in sorted(by_index)) or "none"
            errors.append(f"GPU {idx} does not exist (cards here: {have}, numbered as nvidia-smi does)")
        elif a.status == Status.UNSUPPORTED:
            errors.append(f"GPU {idx} ({a.gpu.name}) is not supported - {a.reason}; {instead}")
        elif a.status == Status.NAMED_ONLY and a.risk:
            risks.append(a.risk + " (experimental)")
        elif a.status == Status.ALONE_ONLY and len(named) > 1 and a.risk:
            risks.append(a.risk)
    return NamedCheck(tuple(named), tuple(errors), tuple(risks))

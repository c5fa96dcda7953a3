"""The layer-split flags of `strata-engine generate|serve|logits|worker` and the config keys behind them.

Standard library only (`strata-engine --help` stays fast); `options_from_args` builds the `SplitOptions` that
`engine.pipeline.split.load_split_model` takes."""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING, Any

TIMING_ENV = "STRATA_REMOTE_TIMING"

if TYPE_CHECKING:
    from engine.pipeline.split import SplitOptions
    from installer.config import StrataConfig


def add_split_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("several cards (layer split)")
    g.add_argument(
        "--gpus",
        help="cards that run the model together, as nvidia-smi numbers them (e.g. 0,2), or all; the first is the main one",
    )
    g.add_argument("--gpu", type=int, help="run on this one card (nvidia-smi's number)")
    g.add_argument(
        "--layer-split",
        help="auto (default with --gpus) or the first layer of each later card, e.g. 24 or 16,32",
    )
    g.add_argument(
        "--split-device",
        help="the later stages' cards with --layer-split K (default: the next cards); 0 runs them on card 0 too "
        "(the check of the hand-off, not a speed mode); cpu for the CPU",
    )
    g.add_argument(
        "--gpu-order",
        choices=("auto", "as_given"),
        default="auto",
        help="auto: under --layer-split auto the faster card goes last (default); as_given keeps your order",
    )
    g.add_argument(
        "--vram-reserve-mib",
        type=int,
        default=512,
        help="VRAM left free on the first card for the desktop and other programs (default 512)",
    )
    g.add_argument(
        "--vram-reserve-later-mib",
        type=int,
        default=None,
        help="the same for the later cards (default: --vram-reserve-mib)",
    )
    g.add_argument(
        "--split-skip-if-fits",
        action="store_true",
        help="with --layer-split auto: run on the first card alone when it holds everything",
    )
    e = p.add_argument_group("experts in VRAM (CUDA)")
    e.add_argument(
        "--expert-cache",
        type=int,
        metavar="N",
        help="keep N routed experts in VRAM on each card (the most used first); default: as many as fit",
    )
    e.add_argument(
        "--vram-budget-mib",
        type=int,
        metavar="MIB",
        help="use at most this much of each card, as if it were that small (a shared card, or tests)",
    )
    e.add_argument(
        "--expert-misses",
        choices=("copy", "direct"),
        default="copy",
        help="how a decode step reads experts that are in host RAM: copy (first copied into VRAM with wide loads, "
        "one kernel a layer; the faster) or direct (the expert kernels read them over PCIe)",
    )
    e.add_argument(
        "--cpu-experts",
        type=float,
        default=None,
        metavar="F",
        help="of each layer's experts in host RAM, the fraction (0-1) the CPU may compute, beside the GPU's copies "
        "of the others, when a decode step misses them. Default: all of them where the CPU reads the blocks in "
        "place (Q4_K experts, AVX2), none elsewhere (other block types are repacked: more host RAM and load "
        "time, so give F to have them); 0: off",
    )
    e.add_argument(
        "--cpu-ratio",
        type=float,
        default=None,
        metavar="R",
        help="fixes the share (0-1) of a decode step's missed experts the CPU computes (default: tuned while "
        "serving, from 0.5; bench/engine_bench.py --cpu-ratio measures fixed ones)",
    )
    e.add_argument(
        "--profile",
        metavar="PATH",
        help="the usage profile that fills the caches and weighs --layer-split auto (default: the one saved for "
        "this file in the data dir)",
    )
    e.add_argument(
        "--no-profile",
        action="store_true",
        help="neither read nor save a usage profile (caches filled in expert order)",
    )
    c = p.add_argument_group("CPU")
    c.add_argument(
        "--cpu-weights-mib",
        type=int,
        metavar="MIB",
        help="RAM for float copies of the weights of layers on the CPU, made at first use (a CPU spends most of a "
        "token dequantizing blocks otherwise); 0: keep every weight in blocks; default: a quarter of the RAM, "
        "at most 8 GiB",
    )
    r = p.add_argument_group("several PCs (remote stage)")
    r.add_argument(
        "--remote-stage",
        metavar="HOST:PORT",
        help="layers K onward run on the worker there (with --layer-split K); keys from STRATA_STAGE_TOKEN",
    )
    r.add_argument(
        "--remote-stage-key", metavar="KEY", help="the worker's public key (Z85 or a certificate file)"
    )
    r.add_argument(
        "--stage-key", metavar="FILE", help="this side's key file (its public key on the worker's allow-list)"
    )


def options_from_args(args: argparse.Namespace) -> SplitOptions:
    """The split flags of a parsed command line (ValueError with the flag's name when one is malformed)."""
    from engine.experts.placement import PlacementError
    from engine.pipeline.split import SplitOptions, parse_gpus, parse_layer_split, parse_split_device

    if getattr(args, "vram_reserve_mib", 0) < 0:
        raise PlacementError(f"--vram-reserve-mib must be 0 or more, not {args.vram_reserve_mib}")
    later = getattr(args, "vram_reserve_later_mib", None)
    if later is not None and later < 0:
        raise PlacementError(f"--vram-reserve-later-mib must be 0 or more, not {later}")
    for flag, value in (("--expert-cache", getattr(args, "expert_cache", None)),
                        ("--vram-budget-mib", getattr(args, "vram_budget_mib", None)),
                        ("--cpu-weights-mib", getattr(args, "cpu_weights_mib", None))):  # fmt: skip
        if value is not None and value < 0:
            raise PlacementError(f"{flag} must be 0 or more, not {value}")
    share = getattr(args, "cpu_experts", None)
    if share is not None and not 0.0 <= share <= 1.0:
        raise PlacementError(f"--cpu-experts is a fraction from 0 to 1, not {share}")
    ratio = getattr(args, "cpu_ratio", None)
    if ratio is not None and not 0.0 <= ratio <= 1.0:
        raise PlacementError(f"--cpu-ratio is a fraction from 0 to 1, not {ratio}")
    gpus = getattr(args, "gpus", None)
    return SplitOptions(
        expert_slots=getattr(args, "expert_cache", None),
        vram_budget_mib=getattr(args, "vram_budget_mib", None),
        cpu_weights_mib=getattr(args, "cpu_weights_mib", None),
        expert_misses=getattr(args, "expert_misses", "copy"),
        cpu_share=share,
        cpu_ratio=ratio,
        device=getattr(args, "device", "auto"),
        gpu=getattr(args, "gpu", None),
        gpus=parse_gpus(gpus) if gpus else None,
        layer_split=parse_layer_split(getattr(args, "layer_split", None)),
        split_device=parse_split_device(getattr(args, "split_device", None)),
        gpu_order=getattr(args, "gpu_order", "auto"),
        reserve_mib=getattr(args, "vram_reserve_mib", 512),
        reserve_later_mib=later,
        skip_if_fits=bool(getattr(args, "split_skip_if_fits", False)),
        remote=getattr(args, "remote_stage", None),
        remote_key=getattr(args, "remote_stage_key", None),
        stage_key=getattr(args, "stage_key", None),
        remote_timing=os.environ.get(TIMING_ENV) == "1",
        profile=getattr(args, "profile", None),
        use_profile=not getattr(args, "no_profile", False),
    )


def config_args(cfg: StrataConfig) -> list[str]:
    """The config's split keys ("gpu", "layer_split", "gpu_order", "split_skip_if_fits") as the flags above, for a
    config reader to put before its "args": one card -> --gpu N; several -> --gpus and --layer-split."""
    out: list[str] = []
    if len(cfg.gpu) == 1:
        out += ["--gpu", str(cfg.gpu[0])]
    elif len(cfg.gpu) > 1:
        out += ["--gpus", ",".join(str(g) for g in cfg.gpu)]
        split: Any = cfg.layer_split
        out += ["--layer-split", split if split == "auto" else ",".join(str(k) for k in split)]
    if cfg.gpu_order != "auto":
        out += ["--gpu-order", cfg.gpu_order]
    if getattr(cfg, "split_skip_if_fits", False):
        out.append("--split-skip-if-fits")
    if (
        cfg.workers
    ):  # the main talks to the first worker; the others are chained by --stage-next on the workers
        w = cfg.workers[0]
        host = f"[{w.host}]" if ":" in w.host else w.host
        out += ["--remote-stage", f"{host}:{w.port}", "--layer-split", str(w.begin)]
    return out

"""The layer-split options of `strata-engine generate|serve|logits|profile` (installer.engine_options defines
the flags) as the `SplitOptions` that `engine.link.startup.load_split_model` takes."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.pipeline.split import SplitOptions, parse_gpus, parse_layer_split, parse_split_device
from installer.placement import PlacementError

if TYPE_CHECKING:
    from engine.pipeline.split import SplitOptions
    from installer.engine_options import EngineOptions


def options_from_args(args: EngineOptions) -> SplitOptions:
    """The split options (ValueError with the flag's name when one is malformed)."""
    if args.vram_reserve_mib < 0:
        raise PlacementError(f"--vram-reserve-mib must be 0 or more, not {args.vram_reserve_mib}")
    later = args.vram_reserve_later_mib
    if later is not None and later < 0:
        raise PlacementError(f"--vram-reserve-later-mib must be 0 or more, not {later}")
    for flag, value in (("--expert-cache", args.expert_cache), ("--vram-budget-mib", args.vram_budget_mib),
                        ("--cpu-weights-mib", args.cpu_weights_mib)):  # fmt: skip
        if value is not None and value < 0:
            raise PlacementError(f"{flag} must be 0 or more, not {value}")
    share = args.cpu_experts
    if share is not None and not 0.0 <= share <= 1.0:
        raise PlacementError(f"--cpu-experts is a fraction from 0 to 1, not {share}")
    ratio = args.cpu_ratio
    if ratio is not None and not 0.0 <= ratio <= 1.0:
        raise PlacementError(f"--cpu-ratio is a fraction from 0 to 1, not {ratio}")
    return SplitOptions(
        expert_slots=args.expert_cache,
        vram_budget_mib=args.vram_budget_mib,
        cpu_weights_mib=args.cpu_weights_mib,
        expert_misses=args.expert_misses,
        expert_policy=args.expert_policy,
        expert_prefetch=args.expert_prefetch,
        cpu_share=share,
        cpu_ratio=ratio,
        device=args.device,
        gpu=args.gpu,
        gpus=parse_gpus(args.gpus) if args.gpus else None,
        layer_split=parse_layer_split(args.layer_split),
        split_device=parse_split_device(args.split_device),
        gpu_order=args.gpu_order,
        reserve_mib=args.vram_reserve_mib,
        reserve_later_mib=later,
        skip_if_fits=args.split_skip_if_fits,
        remote=args.remote_stage,
        remote_key=args.remote_stage_key,
        stage_key=args.stage_key,
        remote_timing=args.remote_timing,
        profile=args.profile,
        use_profile=not args.no_profile,
        kv_resident=args.kv_resident,
    )

"""--expert-misses and --cpu-experts: the flags reach the expert policy (the staging kernel itself: test_kernels_interpreter.py on the
CPU, test_gpu_fast_path.py on a GPU)."""

import pytest

from engine.pipeline.split_args import options_from_args
from installer.engine_options import resolve


def _opts(argv: list[str]):  # type: ignore[no-untyped-def]
    return resolve(["serve", *argv], env={})


def test_the_flag_reaches_the_policy() -> None:
    assert options_from_args(_opts([])).expert_misses == "copy"  # measured the faster (docs/performance.md)
    assert options_from_args(_opts(["--expert-misses", "direct"])).expert_misses == "direct"
    with pytest.raises(SystemExit):
        _opts(["--expert-misses", "sometimes"])


def test_cpu_experts_flag_reaches_the_policy() -> None:

    from installer.placement import PlacementError

    assert options_from_args(_opts([])).cpu_share is None  # auto: the layers the CPU reads in place
    assert options_from_args(_opts(["--cpu-experts", "0"])).cpu_share == 0.0  # off
    assert options_from_args(_opts(["--cpu-experts", "0.5"])).cpu_share == 0.5
    with pytest.raises(PlacementError, match="--cpu-experts is a fraction from 0 to 1"):
        options_from_args(_opts(["--cpu-experts", "1.5"]))


def test_cpu_ratio_flag_reaches_the_policy() -> None:

    from installer.placement import PlacementError

    assert options_from_args(_opts([])).cpu_ratio is None  # the engine's default share
    assert options_from_args(_opts(["--cpu-experts", "1", "--cpu-ratio", "0.25"])).cpu_ratio == 0.25
    with pytest.raises(PlacementError, match="--cpu-ratio is a fraction from 0 to 1"):
        options_from_args(_opts(["--cpu-ratio", "-0.1"]))

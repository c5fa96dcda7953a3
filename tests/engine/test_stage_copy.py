"""--expert-misses: the flag reaches the expert policy (the staging kernel itself: test_kernels_interpreter.py on the
CPU, test_gpu_fast_path.py on a GPU)."""

import pytest

from engine.pipeline.split_args import add_split_args, options_from_args


def test_the_flag_reaches_the_policy() -> None:
    import argparse

    ap = argparse.ArgumentParser()
    add_split_args(ap)
    assert (
        options_from_args(ap.parse_args([])).expert_misses == "copy"
    )  # measured the faster (docs/performance.md)
    assert options_from_args(ap.parse_args(["--expert-misses", "direct"])).expert_misses == "direct"
    with pytest.raises(SystemExit):
        ap.parse_args(["--expert-misses", "sometimes"])

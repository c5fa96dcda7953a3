"""The split flags and config keys -> which layers run on which device, checked before anything loads; every
refusal says what is wrong and how to fix it. Cards are given as data (no GPU needed)."""

import logging
from pathlib import Path

import pytest

from engine.cli import main
from engine.pipeline.split import (
    SplitOptions,
    parse_gpus,
    parse_layer_split,
    parse_split_device,
    plan_stages,
)
from engine.pipeline.split_args import options_from_args
from engine.testing.tiny_models import write_tiny_model
from installer.config import ConfigError, parse_config
from installer.engine_options import config_args, resolve
from installer.placement import GIB, Card, Geometry, PlacementError

MIB = 1 << 20


def _card(i: int, gb: int = 24, sm: int = 82, clock: int = 1695, cc: tuple[int, int] = (8, 6)) -> Card:
    return Card(i, f"card{i}", gb * GIB - 300 * MIB, gb * GIB, cc, sm, clock)


CARDS = [_card(0), _card(1), _card(2, sm=128, clock=2520)]  # GPU 2 is much faster
GEOM = Geometry(48, 128, (40 * MIB,) * 48, (5 * MIB,) * 48, (4096,) * 48, (), 170 * MIB, 250 * MIB)


def test_cpu_split_puts_every_stage_on_the_cpu() -> None:
    sp = plan_stages(SplitOptions(device="cpu", layer_split=(2, 4)), 6, [])
    assert sp.ranges == (range(0, 2), range(2, 4), range(4, 6)) and sp.devices == (None, None, None)
    assert sp.lines == ("layer split: layers 0-1 (CPU), 2-3 (CPU), 4-5 (CPU), one hand-off per window (several stages "
                        "on one device: the check of the hand-off, not a speed mode)",)  # fmt: skip


def test_split_device_zero_runs_both_stages_on_card_zero() -> None:
    sp = plan_stages(SplitOptions(gpu=0, layer_split=(24,), split_device=("0",)), 48, CARDS, GEOM)
    assert sp.devices == (0, 0) and sp.labels == ("CUDA0", "CUDA0") and "check of the hand-off" in sp.lines[0]


def test_manual_split_defaults_to_the_next_cards_and_keeps_the_order() -> None:
    sp = plan_stages(SplitOptions(gpu=1, layer_split=(20, 30)), 48, CARDS, GEOM)
    assert sp.devices == (1, 2, 0)
    assert (
        sp.lines[-1]
        == "layer split: layers 0-19 (CUDA1), 20-29 (CUDA2), 30-47 (CUDA0), one hand-off per window"
    )


def test_gpus_auto_places_and_puts_the_faster_card_last() -> None:
    sp = plan_stages(SplitOptions(gpus=(2, 0)), 48, CARDS, GEOM, context=8192)
    assert sp.devices == (0, 2)
    assert sp.lines[0].startswith("layer split: card order CUDA0, CUDA2 - CUDA2")
    assert sp.lines[1].startswith(f"layer split auto: K={sp.ranges[1].start} - the caches hold")
    as_given = plan_stages(SplitOptions(gpus=(2, 0), gpu_order="as_given"), 48, CARDS, GEOM)
    assert as_given.devices == (2, 0)


def test_gpus_all_skips_old_cards_and_one_card_runs_alone() -> None:
    cards = [_card(0), _card(1, cc=(6, 1))]
    assert plan_stages(SplitOptions(gpus="all"), 48, cards, GEOM).devices == (0,)
    assert plan_stages(SplitOptions(gpus=(1,), device="cpu"), 48, CARDS, GEOM).devices == (1,)


@pytest.mark.parametrize(
    ("opts", "cards", "msg"),
    [
        (
            SplitOptions(gpus=(0, 5)),
            CARDS,
            r"names GPU 5, which this PC does not have \(it has GPU 0 \(card0\)",
        ),
        (SplitOptions(gpus=(0, 1), gpu=0), CARDS, "--gpus and --gpu are both given"),
        (SplitOptions(gpus=(0, 1), split_device=("0",)), CARDS, "--gpus and --split-device are both given"),
        (SplitOptions(gpus=(0, 1)), [], "shows no CUDA card: leave it out"),
        (
            SplitOptions(gpu=0, layer_split=(10, 20, 30)),
            CARDS,
            "needs 4 cards but this PC shows 3.*--split-device 0,0,0",
        ),
        (SplitOptions(device="cpu", split_device=("cpu",)), [], "give the split, e.g. --layer-split 24"),
        (SplitOptions(device="cpu", layer_split=(10,), split_device=("cpu", "cpu")), [], "names 2 device"),
        (SplitOptions(device="cpu", layer_split=(30, 20)), [], "does not rise"),
        (SplitOptions(device="cpu", layer_split=(47,)), [], "leaves the last card 1 layer"),
        (SplitOptions(gpus=(0, 1), layer_split=(10, 20)), CARDS, r"2 number\(s\) for 2 card"),
        (
            SplitOptions(gpus=(0, 1)),
            [_card(0), _card(1, cc=(6, 1))],
            "compute capability 6.1.*7.5 or newer.*use CUDA0",
        ),
        (SplitOptions(gpu=3), CARDS, "--gpu 3 names GPU 3"),
        (SplitOptions(device="cuda"), [], "no CUDA device is available: use --device cpu"),
    ],
)
def test_refusals_say_how_to_fix(opts: SplitOptions, cards: list[Card], msg: str) -> None:
    with pytest.raises(PlacementError, match=msg):
        plan_stages(opts, 48, cards, GEOM)


def test_flag_parsing() -> None:
    assert parse_gpus("0,2") == (0, 2) and parse_gpus("ALL") == "all"
    assert parse_layer_split("auto") == "auto" and parse_layer_split("24, 36") == (24, 36)
    assert parse_layer_split([24, 36]) == (24, 36) and parse_layer_split(None) is None
    assert parse_split_device("0,cuda:1,cpu") == ("0", "1", "cpu")
    for bad, fn in (
        ("0,0", parse_gpus),
        ("x", parse_gpus),
        ("a,b", parse_layer_split),
        ("gpu1", parse_split_device),
    ):
        with pytest.raises(PlacementError):
            fn(bad)  # type: ignore[operator]
    o = options_from_args(
        resolve(["serve", "--gpus", "0,2", "--layer-split", "auto", "--gpu-order", "as_given", "--vram-reserve-mib",
                 "300", "--vram-reserve-later-mib", "1800", "--split-skip-if-fits"], env={})
    )  # fmt: skip
    assert (o.gpus, o.layer_split, o.gpu_order, o.reserve_mib, o.reserve_later_mib, o.skip_if_fits) == (
        (0, 2), "auto", "as_given", 300, 1800, True,
    )  # fmt: skip


def test_config_keys_become_flags() -> None:
    c = parse_config({"model": "m.gguf", "gpu": [0, 2], "layer_split": [24, 36][:1], "gpu_order": "as_given"})
    assert config_args(c) == ["--gpus", "0,2", "--layer-split", "24", "--gpu-order", "as_given"]
    c = parse_config({"model": "m.gguf", "gpu": [1, 0], "layer_split": "auto", "split_skip_if_fits": True})
    assert config_args(c) == ["--gpus", "1,0", "--layer-split", "auto", "--split-skip-if-fits"]
    assert config_args(parse_config({"model": "m.gguf", "gpu": [3]})) == ["--gpu", "3"]
    with pytest.raises(ConfigError, match='works with "layer_split": "auto" only'):
        parse_config({"model": "m.gguf", "gpu": [0, 1], "layer_split": "20", "split_skip_if_fits": True})
    with pytest.raises(ConfigError, match="expected true or false"):
        parse_config({"model": "m.gguf", "split_skip_if_fits": "yes"})


def test_generate_cli_runs_a_cpu_split_and_refuses_a_bad_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    path = write_tiny_model(tmp_path / "m.gguf", "qwen3moe", qtype="Q8_0", seed=2, n_layer=4)
    common = [
        "generate",
        "-m",
        str(path),
        "--device",
        "cpu",
        "-p",
        "hello world",
        "-n",
        "6",
        "--max-context",
        "64",
    ]
    assert main(common) == 0
    plain = capsys.readouterr().out
    with caplog.at_level(logging.INFO, logger="strata.engine"):
        assert main([*common, "--layer-split", "2"]) == 0
    assert capsys.readouterr().out == plain
    assert "layer split: layers 0-1 (CPU), 2-3 (CPU), one hand-off per window" in caplog.text
    assert main([*common, "--layer-split", "3"]) == 1
    assert "--layer-split 3 leaves the last card 1 layer" in capsys.readouterr().err


def test_expert_cache_flags_reach_the_split_options() -> None:
    opts = options_from_args(
        resolve(["serve", "--expert-cache", "1536", "--vram-budget-mib", "16384"], env={})
    )
    assert (opts.expert_slots, opts.vram_budget_mib) == (1536, 16384)
    with pytest.raises(ValueError, match="--expert-cache must be 0 or more"):
        options_from_args(resolve(["serve", "--expert-cache", "-1"], env={}))

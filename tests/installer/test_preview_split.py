"""The wizard's and strata-setup's split preview is the split the engine runs: both call installer.placement.plan.

For the seed's card sets, the preview (recommend.stage_order, then recommend.estimate_fit, as app/controllers/wizard.py
and installer/setup_cli.py call them) is compared with the engine's own planning of the same cards from the
config's "gpu" list (engine.pipeline.split.plan_stages, as load_split_model calls it)."""

from __future__ import annotations

import pytest

from engine.pipeline.split import SplitOptions, plan_stages
from installer import recommend
from installer.catalog import geometry, load_catalog
from installer.gpus import GpuInfo
from tests.installer.fake_nvml import FakeCard, FakeNvml

MIB = 1024**2
RTX_3090 = FakeCard("NVIDIA GeForce RTX 3090", 24576, (8, 6), cores=10496, max_sm_clock=2100)
RTX_4090 = FakeCard("NVIDIA GeForce RTX 4090", 24564, (8, 9), cores=16384, max_sm_clock=2520)
RTX_4060_TI_16 = FakeCard("NVIDIA GeForce RTX 4060 Ti", 16380, (8, 9), cores=4352, max_sm_clock=2535)
RTX_3060_12 = FakeCard("NVIDIA GeForce RTX 3060", 12288, (8, 6), cores=3584, max_sm_clock=1777)
RTX_5080 = FakeCard("NVIDIA GeForce RTX 5080", 16303, (12, 0), cores=10752, max_sm_clock=3090)
RTX_3080 = FakeCard("NVIDIA GeForce RTX 3080", 10240, (8, 6), cores=8704, max_sm_clock=1710)
RTX_2080_TI = FakeCard("NVIDIA GeForce RTX 2080 Ti", 11264, (7, 5), cores=4352, max_sm_clock=1545)
RTX_2060_6 = FakeCard("NVIDIA GeForce RTX 2060", 6144, (7, 5), cores=1920, max_sm_clock=1680)

CARD_SETS = {
    "equal pair": [RTX_3090, RTX_3090],
    "fast small card": [RTX_3090, RTX_5080],
    "4060 Ti 16 GB + 3060 12 GB": [RTX_4060_TI_16, RTX_3060_12],
    "24 GiB + 12 GiB": [RTX_3090, RTX_3060_12],
    "three cards": [RTX_4090, RTX_3080, RTX_2080_TI],
    "four cards": [RTX_3090, RTX_4060_TI_16, RTX_3060_12, RTX_3080],
    "a card under 8 GB, with another": [RTX_3090, RTX_2060_6],
    "a card under 8 GB, alone": [RTX_2060_6],
}


def _gpus(fakes: list[FakeCard]) -> tuple[GpuInfo, ...]:
    from installer.gpus import probe

    return probe(FakeNvml(list(fakes)), others=[]).gpus


def _qwen3_30b():  # type: ignore[no-untyped-def]
    entry = next(e for e in load_catalog().entries if e.architecture == "qwen3moe")
    return geometry(entry)


@pytest.mark.parametrize("name", list(CARD_SETS))
@pytest.mark.parametrize("context", [4096, 32768])
def test_the_preview_is_the_engines_split(name: str, context: int) -> None:
    gpus = _gpus(CARD_SETS[name])
    g = _qwen3_30b()
    # The preview, as the wizard shows it.
    order = recommend.stage_order(gpus, "auto")
    fit = recommend.estimate_fit(g, order.gpus, context, "bf16")
    preview = [(c.gpu.index, c.begin, c.end) for c in fit.cards]
    # The engine, from the config the wizard writes ("gpu": the cards in the user's order, "layer_split": "auto").
    cards = [recommend.as_card(x) for x in gpus]
    opts = SplitOptions(gpus=tuple(x.index for x in gpus), layer_split="auto")
    sp = plan_stages(opts, g.layers, cards, g.to_placement("bf16"), context)
    engine = [(d, r.start, r.stop) for d, r in zip(sp.devices, sp.ranges, strict=True)]
    assert preview == engine
    if sp.placement is not None:  # the experts each card's cache holds, too
        assert [c.experts_in_vram for c in fit.cards] == [s.held for s in sp.placement.stages]


def test_the_reported_pair() -> None:
    """A 48-layer model on a 24 GiB and a 12 GiB card: the preview put the second card's first layer at 3, the
    engine at 15; now both say the same."""
    gpus = _gpus([RTX_3090, RTX_3060_12])
    g = _qwen3_30b()
    assert g.layers == 48
    fit = recommend.estimate_fit(g, recommend.stage_order(gpus, "auto").gpus, 4096)
    sp = plan_stages(
        SplitOptions(gpus=(0, 1), layer_split="auto"),
        48,
        [recommend.as_card(x) for x in gpus],
        g.to_placement(),
        4096,
    )
    assert fit.layer_split == tuple(r.start for r in sp.ranges[1:])
    assert fit.layer_split[0] > 3

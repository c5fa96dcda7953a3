"""Card rules, the numbered choices and the card order, on the seed's PC and on other mixes (fake NVML)."""

from __future__ import annotations

import pytest

from installer import recommend, rules
from installer.gpus import GpuInfo, OtherAdapter, probe
from installer.rules import Status
from tests.installer.fake_nvml import GTX_1080_TI, RTX_3090, RTX_5080, FakeCard, FakeNvml

SEED_LISTING = [
    "  Your NVIDIA GPUs:",
    "    GPU 0: NVIDIA GeForce RTX 5080, 16 GB VRAM - can be used",
    "    GPU 1: NVIDIA GeForce GTX 1080 Ti, 11 GB VRAM - not supported - older than the RTX 20 series "
    "(compute capability 6.1; PolyStrata needs 7.5 or newer)",
    "    GPU 2: NVIDIA GeForce RTX 3090, 24 GB VRAM - can be used",
]
SEED_CHOICES = [
    "  1) GPU 0 (NVIDIA GeForce RTX 5080, 16 GB) + GPU 2 (NVIDIA GeForce RTX 3090, 24 GB) together   (recommended)",
    "  2) GPU 2 (NVIDIA GeForce RTX 3090, 24 GB) only",
    "  3) GPU 0 (NVIDIA GeForce RTX 5080, 16 GB) only",
]


def cards(*fakes: FakeCard) -> tuple[GpuInfo, ...]:
    return probe(FakeNvml(list(fakes)), others=[]).gpus


def test_the_seed_listing_and_choices_exactly() -> None:
    assessments = rules.assess(cards(RTX_5080, GTX_1080_TI, RTX_3090))
    assert recommend.format_listing(assessments) == SEED_LISTING
    options = recommend.choices(assessments)
    assert recommend.format_choices(options) == SEED_CHOICES
    assert options[0].indices == (0, 2)  # the 5080 (Blackwell) is the main card
    assert [a.status for a in assessments] == [Status.USABLE, Status.NAMED_ONLY, Status.USABLE]


def test_seed_card_order_under_auto_puts_the_faster_card_last() -> None:
    g = cards(RTX_5080, GTX_1080_TI, RTX_3090)
    order = recommend.stage_order((g[0], g[2]), "auto")
    # 84 SMs x 3090 MHz = 259,560 against 82 x 2100 = 172,200: the 5080 is 51% faster and goes last.
    assert [x.index for x in order.gpus] == [2, 0] and order.changed
    assert "GPU 0 goes last" in order.note and "51% faster than GPU 2" in order.note
    assert recommend.stage_order((g[0], g[2]), "as_given").gpus == (g[0], g[2])
    assert recommend.stage_order((g[2], g[0]), "auto").changed is False  # already last


def test_five_percent_tie_keeps_the_given_order() -> None:
    a = FakeCard("NVIDIA GeForce RTX 3090", 24576, (8, 6), cores=10496, max_sm_clock=2100)
    b = FakeCard("NVIDIA GeForce RTX 3090", 24576, (8, 6), cores=10496, max_sm_clock=2205)  # exactly +5%
    c = FakeCard("NVIDIA GeForce RTX 3090", 24576, (8, 6), cores=10496, max_sm_clock=2206)  # just over 5%
    ga, gb, gc = cards(a, b, c)
    assert recommend.stage_order((gb, ga)).gpus == (gb, ga)
    assert recommend.stage_order((gc, ga)).gpus == (ga, gc)
    unknown = cards(FakeCard("NVIDIA Mystery", 24576, (8, 9), cores=None), RTX_3090)
    assert recommend.stage_order(unknown).changed is False


def test_four_cards() -> None:
    g = cards(
        FakeCard("NVIDIA GeForce RTX 3090", 24576, (8, 6), cores=10496, max_sm_clock=2100),
        FakeCard("NVIDIA GeForce RTX 4060 Ti", 16380, (8, 9), cores=4352, max_sm_clock=2595),
        FakeCard("NVIDIA GeForce RTX 4090", 24564, (8, 9), cores=16384, max_sm_clock=2790),
        FakeCard("NVIDIA GeForce RTX 2060", 6144, (7, 5), cores=1920, max_sm_clock=1680),
    )
    assessments = rules.assess(g)
    assert assessments[3].line() == (
        "GPU 3: NVIDIA GeForce RTX 2060, 6 GB VRAM - can be used alone - less than 8 GB of VRAM, so not together "
        "with other cards (each card holds a copy of the dense weights and its own prompt buffers)"
    )
    assert recommend.format_choices(recommend.choices(assessments)) == [
        "  1) GPU 2 (NVIDIA GeForce RTX 4090, 24 GB) + GPU 0 (NVIDIA GeForce RTX 3090, 24 GB) together   (recommended)",
        "  2) GPU 2 (NVIDIA GeForce RTX 4090, 24 GB) + GPU 1 (NVIDIA GeForce RTX 4060 Ti, 16 GB) + "
        "GPU 0 (NVIDIA GeForce RTX 3090, 24 GB) together",
        "  3) GPU 2 (NVIDIA GeForce RTX 4090, 24 GB) only",
        "  4) GPU 0 (NVIDIA GeForce RTX 3090, 24 GB) only",
        "  5) GPU 1 (NVIDIA GeForce RTX 4060 Ti, 16 GB) only",
        "  6) GPU 3 (NVIDIA GeForce RTX 2060, 6 GB) only",
    ]
    assert rules.parse_gpu_list("all", assessments) == (0, 1, 2)  # the 6 GB card needs naming
    # All three under auto: the 4090 (128 SMs x 2790) is the fastest and goes last.
    order = recommend.stage_order(recommend.choices(assessments)[1].gpus)
    assert [x.index for x in order.gpus] == [1, 0, 2]


def test_a_six_gb_card_with_a_bigger_one() -> None:
    g = cards(RTX_3090, FakeCard("NVIDIA GeForce RTX 2060", 6144, (7, 5), cores=1920))
    assessments = rules.assess(g)
    assert assessments[1].status == Status.ALONE_ONLY
    assert recommend.format_choices(recommend.choices(assessments)) == [
        "  1) GPU 0 (NVIDIA GeForce RTX 3090, 24 GB) only   (recommended)",
        "  2) GPU 1 (NVIDIA GeForce RTX 2060, 6 GB) only",
    ]
    named = rules.check_named((0, 1), assessments)
    assert named.ok and named.needs_confirmation
    assert named.risks == (
        "GPU 1 (NVIDIA GeForce RTX 2060) has 6 GB of VRAM: next to other cards it holds its own copy of the dense "
        "weights and prompt buffers and may run out of memory",
    )
    assert rules.check_named((1,), assessments).risks == ()  # alone it is fine
    # A 6 GB card that is the only card is simply usable.
    alone = rules.assess(cards(FakeCard("NVIDIA GeForce RTX 2060", 6144, (7, 5), cores=1920)))
    assert alone[0].status == Status.USABLE and alone[0].line().endswith("6 GB VRAM - can be used")


def test_named_pascal_is_experimental_and_older_is_refused() -> None:
    g = cards(RTX_5080, GTX_1080_TI, RTX_3090, FakeCard("NVIDIA GeForce GTX 980", 4096, (5, 2), cores=2048))
    assessments = rules.assess(g)
    assert assessments[3].status == Status.UNSUPPORTED
    pascal = rules.check_named((0, 1), assessments)
    assert pascal.ok and pascal.risks[0].startswith(
        "GPU 1 (NVIDIA GeForce GTX 1080 Ti) is a Pascal/Volta card"
    )
    assert "experimental" in pascal.risks[0]
    maxwell = rules.check_named((3,), assessments)
    assert not maxwell.ok
    assert maxwell.errors == (
        "GPU 3 (NVIDIA GeForce GTX 980) is not supported - older than the RTX 20 series (compute capability 5.2; "
        "PolyStrata needs 7.5 or newer); cards that can be used: GPU 0, GPU 2",
    )
    missing = rules.check_named((7,), assessments)
    assert missing.errors == ("GPU 7 does not exist (cards here: 0, 1, 2, 3, numbered as nvidia-smi does)",)


def test_amd_and_intel_next_to_nvidia() -> None:
    g = cards(RTX_3090)
    others = rules.assess_others(
        [OtherAdapter("AMD", "Radeon RX 7900 XTX", "1002:744c"), OtherAdapter("Intel", "UHD Graphics 770")],
        has_nvidia=True,
    )
    listing = recommend.format_listing(rules.assess(g), others)
    assert listing[-3:] == [
        "  Other graphics adapters:",
        "    Radeon RX 7900 XTX (AMD) - not supported - a mix of NVIDIA and AMD cards cannot share a model; "
        "PolyStrata uses the NVIDIA cards",
        "    UHD Graphics 770 (Intel) - not supported - Intel GPUs are not supported",
    ]
    # The NVIDIA card is still recommended on its own.
    assert recommend.choices(rules.assess(g))[0].indices == (0,)
    amd_only = rules.assess_others([OtherAdapter("AMD", "Radeon RX 7900 XTX")], has_nvidia=False)
    assert amd_only[0].reason == "AMD cards are not supported; PolyStrata runs on NVIDIA cards"


def test_parse_gpu_list() -> None:
    assessments = rules.assess(cards(RTX_5080, GTX_1080_TI, RTX_3090))
    assert rules.parse_gpu_list(" 2, 0 ", assessments) == (2, 0)
    assert rules.parse_gpu_list("ALL", assessments) == (0, 2)
    for bad, msg in (("0,0", "named twice"), ("a", "is not a card number"), (",", "expected card numbers")):
        with pytest.raises(ValueError, match=msg):
            rules.parse_gpu_list(bad, assessments)
    with pytest.raises(ValueError, match="no card here can share a model"):
        rules.parse_gpu_list("all", rules.assess(cards(GTX_1080_TI)))


def test_no_usable_card_gives_no_choice() -> None:
    assert recommend.choices(rules.assess(cards(GTX_1080_TI))) == []
    assert recommend.choices([]) == []

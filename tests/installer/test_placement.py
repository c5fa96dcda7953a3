"""Auto layer split and card order (seed 002) with cards given as data: the seed's worked cases, and every auto
choice of up to four cards checked against a plain brute force written here."""

import itertools
import math

import numpy as np
import pytest

from installer.placement import (
    GIB,
    MIB,
    Budget,
    Card,
    Geometry,
    PlacementError,
    check_manual_split,
    order_cards,
    plan,
)

# Cards as NVML shows them (SMs x max SM clock from the spec sheets).
RTX_3090 = dict(name="NVIDIA GeForce RTX 3090", sm_count=82, max_clock_mhz=1695, compute_capability=(8, 6))
RTX_5080 = dict(name="NVIDIA GeForce RTX 5080", sm_count=84, max_clock_mhz=2617, compute_capability=(12, 0))
RTX_4060TI = dict(
    name="NVIDIA GeForce RTX 4060 Ti", sm_count=34, max_clock_mhz=2535, compute_capability=(8, 9)
)
RTX_3060 = dict(name="NVIDIA GeForce RTX 3060", sm_count=28, max_clock_mhz=1777, compute_capability=(8, 6))
RTX_4070S = dict(
    name="NVIDIA GeForce RTX 4070 SUPER", sm_count=56, max_clock_mhz=2475, compute_capability=(8, 9)
)
RTX_A4000 = dict(name="NVIDIA RTX A4000", sm_count=48, max_clock_mhz=1560, compute_capability=(8, 6))
GTX_1080TI = dict(
    name="NVIDIA GeForce GTX 1080 Ti", sm_count=28, max_clock_mhz=1582, compute_capability=(6, 1)
)


def card(index: int, gb: float, spec: dict) -> Card:
    total = int(gb * GIB)
    return Card(index=index, free_bytes=total - 300 * MIB, total_bytes=total, **spec)


def flash_next(expert_mb: float = 1.35, experts: int = 512, layers: int = 48) -> Geometry:
    """Qwen3-Next-like: 48 layers of 512 routed experts, KV on every fourth layer only (the others are linear
    attention), a 150K-token table and head."""
    kv = tuple(4096 if (i + 1) % 4 == 0 else 0 for i in range(layers))
    return Geometry(
        n_layer=layers,
        n_expert=experts,
        dense_bytes=(40 * MIB,) * layers,
        expert_bytes=(int(expert_mb * MIB),) * layers,
        kv_bytes_per_token=kv,
        embed_bytes=170 * MIB,
        head_bytes=250 * MIB,
    )


def small_moe(layers: int = 12, experts: int = 16) -> Geometry:
    return Geometry(
        layers, experts, (20 * MIB,) * layers, (4 * MIB,) * layers, (2048,) * layers, (), 50 * MIB, 50 * MIB
    )


# ---------------------------------------------------------------------------------------------------------------
# Card order


def test_equal_cards_keep_their_order() -> None:
    cards = [card(1, 24, RTX_3090), card(0, 24, RTX_3090)]
    order, note = order_cards(cards)
    assert [c.index for c in order] == [1, 0] and note is None


def test_fast_small_card_goes_last_behind_a_slow_big_one() -> None:
    cards = [card(0, 16, RTX_5080), card(1, 24, RTX_3090)]
    order, note = order_cards(cards)
    assert [c.index for c in order] == [1, 0]
    assert note is not None and "CUDA0" in note and "goes last" in note and "58% faster" in note
    # as_given and a manual split keep the order written
    assert [c.index for c in order_cards(cards, "as_given")[0]] == [0, 1]
    assert [c.index for c in order_cards(cards, manual=True)[0]] == [0, 1]


def test_cards_within_five_percent_keep_their_order() -> None:
    # 56 x 2475 = 138,600 against 82 x 1695 = 138,990: within 5%, so the 3090 given first stays first.
    cards = [card(0, 24, RTX_3090), card(1, 12, RTX_4070S)]
    assert order_cards(cards) == (tuple(cards), None)


def test_auto_plan_logs_the_order_change_and_the_split() -> None:
    cards = [card(0, 16, RTX_5080), card(1, 24, RTX_3090)]
    p = plan(cards, flash_next(), Budget(32768))
    assert [c.index for c in p.cards] == [1, 0]
    lines = p.log_lines()
    assert lines[0].startswith("layer split: card order CUDA1, CUDA0 - CUDA0")
    k = p.starts[0]
    assert lines[1].startswith(
        f"layer split auto: K={k} - the caches hold {p.pairs_held} of 24576 profiled pairs ("
    )
    assert lines[2] == f"layer split: layers 0-{k - 1} (CUDA1), {k}-47 (CUDA0), one hand-off per window"


# ---------------------------------------------------------------------------------------------------------------
# The two-card share rule (#2644)


def test_4060ti_and_3060_each_own_their_share_not_k3() -> None:
    """The seed's unequal pair: 48 layers IQ3_S on a 4060 Ti 16 GB + 3060 12 GB. The 4060 Ti is faster and goes
    last; the 3060 must own its share of the layers by its room (the reporter's sweep was best at 24-32)."""
    cards = [card(0, 16, RTX_4060TI), card(1, 12, RTX_3060)]
    p = plan(cards, flash_next(expert_mb=1.35), Budget(32768))
    assert [c.label for c in p.cards] == ["CUDA1", "CUDA0"]
    k = p.starts[0]
    assert p.rule == "share"
    assert 18 <= k <= 24 and k != 3
    assert all(s.layers >= 3 for s in p.stages)
    # each card owns at least its share of the 48 layers by its room for experts
    rooms = [s.usable_bytes - Budget(32768).overhead for s in p.stages]
    rooms[0] -= 170 * MIB
    rooms[1] -= 250 * MIB
    for s, room in zip(p.stages, rooms, strict=True):
        assert s.layers >= math.floor(48 * room / sum(rooms))
    assert "#2644" in p.log_lines()[-2]


def test_a4000_pair_made_unequal_by_the_reserve_gets_k20() -> None:
    """The seed's measurement: 2x RTX A4000, stage 0 with 3.7 GiB less room (--vram-reserve-mib 4400): K=20."""
    cards = [card(0, 16, RTX_A4000), card(1, 16, RTX_A4000)]
    p = plan(
        cards, flash_next(expert_mb=1.2), Budget(14500, reserve_first=4400 * MIB, reserve_later=512 * MIB)
    )
    assert p.rule == "share" and [c.index for c in p.cards] == [0, 1]
    assert p.starts in ((20,), (21,))


def test_share_rule_overrides_the_profile_on_two_cards_only() -> None:
    """A profile whose hot pairs all sit in the last layers pulls the profile rule's boundary; on two cards the
    share rule keeps each card its share, on three the profile rule decides alone."""
    g = flash_next(expert_mb=5.4, experts=128)
    prof = np.ones((48, 128))
    prof[40:] = 1000.0
    two = [card(0, 16, RTX_A4000), card(1, 16, RTX_A4000)]
    p2 = plan(two, g, Budget(8192), profile=prof)
    assert p2.rule == "share" and 22 <= p2.starts[0] <= 25
    three = [card(i, 16, RTX_A4000) for i in range(3)]
    p3 = plan(three, g, Budget(8192), profile=prof)
    assert p3.rule == "profile"
    assert p3.starts == _brute_force(three, g, Budget(8192), prof)


# ---------------------------------------------------------------------------------------------------------------
# The profile search against a brute force


def _brute_force(cards: list[Card], g: Geometry, b: Budget, profile: np.ndarray | None) -> tuple[int, ...]:
    """Every split with >= 3 layers per card; each card's cache takes the hottest pairs of its own layers; best by
    weight held, then pairs held, then the lowest fill of the fullest card; first in order on a full tie."""
    n, L = len(cards), g.n_layer
    w = np.ones((L, g.n_expert)) if profile is None else np.asarray(profile, dtype=float)
    slot = max(g.expert_bytes)
    best, best_key = None, None
    for starts in itertools.combinations(range(1, L), n - 1):
        bounds = [0, *starts, L]
        if any(bounds[j + 1] - bounds[j] < 3 for j in range(n)):
            continue
        weight = held_total = 0.0
        fills = []
        ok = True
        for j in range(n):
            a, z = bounds[j], bounds[j + 1]
            fixed = sum(g.dense_bytes[a:z]) + sum(g.kv_bytes(i, b.context) for i in range(a, z)) + b.overhead
            fixed += g.embed_bytes if j == 0 else 0
            fixed += g.head_bytes + g.draft_bytes if j == n - 1 else 0
            usable = cards[j].free_bytes - b.reserve(j)
            if fixed > usable:
                ok = False
                break
            cap = (usable - fixed) // slot
            pairs = sorted(w[a:z].ravel().tolist(), reverse=True)
            held = min(cap, len(pairs))
            weight += sum(pairs[:held])
            held_total += held
            fills.append((fixed + held * slot) / usable)
        if not ok:
            continue
        key = (weight, held_total, -max(fills))
        if best_key is None or key > best_key:
            best, best_key = tuple(starts), key
    assert best is not None
    return best


@pytest.mark.parametrize(
    "gbs",
    [(12, 10, 16), (8, 11, 24, 12), (16, 16, 16)],
)
def test_three_and_four_cards_match_the_brute_force(gbs: tuple[int, ...]) -> None:
    cards = [card(i, gb, RTX_3090) for i, gb in enumerate(gbs)]  # equal speed: no reordering
    g = flash_next(expert_mb=5.4, experts=128, layers=24 if len(gbs) == 4 else 48)
    rng = np.random.default_rng(7)
    prof = rng.zipf(1.6, size=(g.n_layer, g.n_expert)).astype(float)
    for profile in (None, prof):
        p = plan(cards, g, Budget(16384), profile=profile)
        assert p.rule == "profile"
        assert p.starts == _brute_force(cards, g, Budget(16384), profile)


def test_hottest_pairs_weigh_most() -> None:
    """Room for about a third of the pairs on each card and hot pairs in the first 20 layers: the profile moves the
    boundaries so that two caches share the hot layers, holding more of the profile than the uniform choice."""
    cards = [card(i, 9, RTX_3090) for i in range(3)]
    g = flash_next(expert_mb=5.4, experts=128)
    prof = np.ones((48, 128))
    prof[:20] = 50.0
    uniform = plan(cards, g, Budget(4096))
    weighted = plan(cards, g, Budget(4096), profile=prof)

    def held_weight(starts: tuple[int, ...]) -> float:
        p = plan(cards, g, Budget(4096), layer_split=starts, profile=prof, gpu_order="as_given")
        return sum(s.weight_held for s in p.stages)

    assert weighted.starts == _brute_force(cards, g, Budget(4096), prof)
    assert held_weight(weighted.starts) > 1.05 * held_weight(uniform.starts)


def test_ties_leave_the_fullest_card_the_most_room() -> None:
    """A small model that fits any split of three equal cards: every split holds every pair, so the one that
    keeps the fullest card emptiest wins - here the even split, whatever order the search meets it in."""
    cards = [card(i, 24, RTX_3090) for i in range(3)]
    g = small_moe(layers=12)
    p = plan(cards, g, Budget(4096))
    assert p.pairs_held == 12 * 16
    assert p.starts == _brute_force(cards, g, Budget(4096), None) == (4, 8)


def test_five_cards_proportional_to_room() -> None:
    cards = [card(i, gb, RTX_3090) for i, gb in enumerate((24, 24, 12, 12, 24))]
    p = plan(cards, flash_next(expert_mb=0.2), Budget(4096))
    assert p.rule == "proportional"
    sizes = [s.layers for s in p.stages]
    assert sum(sizes) == 48 and min(sizes) >= 3
    assert sizes[2] < sizes[0] and sizes[3] < sizes[4]


def test_a_card_with_too_little_room_never_gets_one_or_two_layers() -> None:
    g = flash_next()
    # 6 GB next to 24 GB: the small card holds 3 layers at least, or the plan says it does not fit.
    small = Card(1, "NVIDIA GeForce RTX 2060", 6 * GIB, 6 * GIB, (7, 5), 30, 1680)
    p = plan([card(0, 24, RTX_3090), small], g, Budget(4096), gpu_order="as_given")
    assert all(s.layers >= 3 for s in p.stages)
    tiny = Card(1, "tiny", 1400 * MIB, 2 * GIB, (7, 5), 30, 1680)  # cannot hold 3 layers + overhead
    with pytest.raises(PlacementError, match="does not fit"):
        plan([card(0, 24, RTX_3090), tiny], g, Budget(4096), gpu_order="as_given")


def test_too_few_layers_for_auto() -> None:
    with pytest.raises(PlacementError, match=r"3 layers at least.*fewer cards"):
        plan([card(i, 24, RTX_3090) for i in range(3)], small_moe(layers=8), Budget(4096))


# ---------------------------------------------------------------------------------------------------------------
# split_skip_if_fits


def test_skip_split_when_the_first_card_holds_everything() -> None:
    g = small_moe()
    cards = [card(0, 24, RTX_5080), card(1, 24, RTX_3090)]
    p = plan(cards, g, Budget(4096), skip_if_fits=True)
    assert p.rule == "skip" and len(p.stages) == 1 and p.cards[0].index == 0
    assert "running on it alone (split_skip_if_fits)" in p.log_lines()[0]
    big = flash_next()
    p = plan(cards, big, Budget(4096), skip_if_fits=True)
    assert len(p.stages) == 2 and "the split stays" in " ".join(p.log_lines())
    # with a profile, "everything" is every profiled pair: one hot pair per layer fits the first card alone
    prof = np.zeros((48, 512))
    prof[:, 0] = 5
    assert plan(cards, big, Budget(4096), profile=prof, skip_if_fits=True).rule == "skip"


# ---------------------------------------------------------------------------------------------------------------
# Manual splits and validation


@pytest.mark.parametrize(
    ("starts", "n", "msg"),
    [
        ((24, 12), 3, "does not rise"),
        ((24,), 3, "1 number\\(s\\) for 3 card"),
        ((0,), 2, "does not rise"),
        ((48,), 2, "every number must be below 48"),
        ((47,), 2, "leaves the last card 1 layer.*use 46 or lower"),
    ],
)
def test_manual_split_errors_say_how_to_fix(starts: tuple[int, ...], n: int, msg: str) -> None:
    with pytest.raises(PlacementError, match=msg):
        check_manual_split(starts, n, 48)


def test_manual_split_keeps_the_order_and_checks_memory() -> None:
    cards = [card(0, 16, RTX_5080), card(1, 24, RTX_3090)]
    p = plan(cards, flash_next(), Budget(4096), layer_split=(20,))
    assert p.rule == "manual" and [c.index for c in p.cards] == [0, 1] and p.starts == (20,)
    assert p.log_lines() == ["layer split: layers 0-19 (CUDA0), 20-47 (CUDA1), one hand-off per window"]
    tiny = Card(1, "tiny", 1 * GIB, 2 * GIB, (8, 6), 30, 1680)
    with pytest.raises(PlacementError, match=r"CUDA1 \(tiny\) needs .* GiB for layers 4-47 .*move the split"):
        plan([cards[0], tiny], flash_next(), Budget(4096), layer_split=(4,))


def test_old_cards_are_refused_with_the_usable_ones_named() -> None:
    with pytest.raises(
        PlacementError, match=r"CUDA1 \(NVIDIA GeForce GTX 1080 Ti, compute capability 6.1\).*7.5.*use CUDA0"
    ):
        plan([card(0, 24, RTX_3090), card(1, 11, GTX_1080TI)], flash_next(), Budget(4096))


def test_profile_of_another_model_is_refused() -> None:
    with pytest.raises(PlacementError, match="belongs to another model"):
        plan(
            [card(0, 24, RTX_3090), card(1, 24, RTX_3090)],
            flash_next(),
            Budget(4096),
            profile=np.ones((10, 8)),
        )


def test_a_context_whose_kv_does_not_fit_says_which_context_fits_and_the_smaller_kv_types() -> None:
    # small_moe: 12 layers of 2,048 KV bytes a token (24 KiB a position), 290 MiB of dense weights and table/head
    g = small_moe()
    gpu = card(0, 4, RTX_3060)  # ~3.7 GiB usable after the reserve
    plan([gpu], g, Budget(65536))  # 1.5 GiB of KV: fits
    with pytest.raises(PlacementError, match="does not fit the card") as e:
        plan([gpu], g, Budget(262144))  # 6 GiB of KV
    msg = str(e.value)
    assert "the KV of 262144 tokens is 6.0 GiB" in msg and "--kv int8" in msg and "--kv q4_0" in msg
    fits = int(msg.split("; --max-context ")[1].split()[0])
    assert fits % 1024 == 0 and 65536 < fits < 262144
    plan([gpu], g, Budget(fits))  # the context the message names does fit
    with pytest.raises(PlacementError):
        plan([gpu], g, Budget(fits + 2048))

"""Fit estimates checked against arithmetic done by hand (numbers in MiB, see each test). The split is the
engine's own (installer.placement): the token table on the first card (a tied head's too), the head on the last."""

from __future__ import annotations

import itertools
import time

import pytest

from installer.gpus import GpuInfo
from installer.recommend import KV_BYTES_SCALE, ModelGeometry, auto_split, estimate_fit

MIB = 1024**2


def card(index: int, free_mib: int) -> GpuInfo:
    return GpuInfo(
        index,
        f"GPU-{index}",
        f"Card {index}",
        free_mib * MIB,
        free_mib * MIB,
        (8, 9),
        "580",
        sm_count=50,
        max_sm_clock_mhz=2000,
    )


# 8 layers, 4 experts of 100 MiB each per layer, 50 MiB dense per layer, 1 KiB of KV per token and layer, 200 MiB head.
SMALL = ModelGeometry(
    layers=8,
    experts=4,
    experts_used=2,
    expert_bytes=100 * MIB,
    dense_bytes_per_layer=50 * MIB,
    kv_bytes_per_token_layer=1024,
    head_bytes=200 * MIB,
)
OPTS = {"reserve_bytes": 256 * MIB, "overhead_bytes": 256 * MIB}


def test_manual_split_by_hand() -> None:
    # Card 0 (2048 MiB free), layers 0-3 + token table: dense 4x50 + 200 = 400, KV 4 x 1024 tok x 1 KiB = 4;
    # room = 2048-256-256-400-4 = 1132 MiB -> 11 of its 16 experts. Card 1 (3072 MiB), layers 4-7 + head: dense
    # 200+200 = 400, KV 4; room = 3072-512-404 = 2156 -> 21, capped at its 16 experts.
    fit = estimate_fit(SMALL, [card(0, 2048), card(1, 3072)], context=1024, layer_split=[4], **OPTS)
    c0, c1 = fit.cards
    assert (c0.begin, c0.end, c1.begin, c1.end) == (0, 4, 4, 8) and c1.last and not c0.last
    assert (c0.dense_bytes, c0.kv_bytes, c0.expert_room) == (400 * MIB, 4 * MIB, 1132 * MIB)
    assert (c0.experts_in_vram, c0.experts_total) == (11, 16)
    assert (c1.dense_bytes, c1.kv_bytes, c1.expert_room) == (400 * MIB, 4 * MIB, 2156 * MIB)
    assert (c1.experts_in_vram, c1.experts_total) == (16, 16)
    assert fit.experts_in_vram == 27 and fit.summary == "fits partly"
    assert fit.host_expert_bytes(SMALL) == 5 * 100 * MIB
    assert (
        fit.summary_text() == "fits partly: 27 of 32 routed experts in VRAM, the rest computed from host RAM"
    )
    assert fit.layer_split == (4,)
    assert fit.lines()[0] == (
        "GPU 0 (Card 0), layers 0-3: dense weights 0.4 GiB, KV 0.0 GiB (1024 tokens, bf16), room for experts 1.1 GiB, "
        "experts in VRAM 11 of 16"
    )


def test_auto_split_holds_the_most_experts() -> None:
    # At least 3 layers per card: K in {3, 4, 5}.
    # K=3: card 0: 2048-512-(150+200)-3 = 1183 -> 11 of 12; card 1: 3072-512-(250+200)-5 = 2105 -> 20 of 20: 31.
    # K=4: 11 + 16 = 27 (above). K=5: card 0: 2048-512-(250+200)-5 = 1081 -> 10 of 20; card 1 holds its 12: 22.
    # Each card's share by its room (2048-512-200 : 3072-512-200 of 8 layers: 2 and 5) allows K=3.
    fit = estimate_fit(SMALL, [card(0, 2048), card(1, 3072)], context=1024, **OPTS)
    assert fit.layer_split == (3,)
    assert [c.experts_in_vram for c in fit.cards] == [11, 20]
    assert fit.summary == "fits partly" and fit.summary_text().startswith("fits partly: 31 of 32 routed")


def test_auto_split_tie_leaves_the_fullest_card_most_room() -> None:
    # Two 10240 MiB cards hold all experts for every K; the fullest card's share of its 10240-256 MiB:
    # K=3: max(150+200+3+256+1200, 250+200+5+256+2000) = 2711
    # K=4: max(200+200+4+256+1600, 200+200+4+256+1600) = 2260   <- best (and the only K giving each card 4 layers,
    # its share by room)
    # K=5: max(250+200+5+256+2000, 150+200+3+256+1200) = 2711
    assert auto_split(SMALL, [card(0, 10240), card(1, 10240)], 1024, **OPTS) == (4,)


def test_does_not_fit_names_the_card_and_the_bytes() -> None:
    # One 512 MiB card: 512-512 = 0 for 8x50 + 200 (table) + 200 (head) + 8 MiB: short by 808 MiB.
    fit = estimate_fit(SMALL, [card(0, 512)], context=1024, **OPTS)
    (c,) = fit.cards
    assert c.shortfall == 808 * MIB and c.expert_room == 0 and c.experts_in_vram == 0
    assert fit.summary == "does not fit"
    assert (
        fit.summary_text() == "does not fit: GPU 0 lacks 0.8 GiB for its dense weights, KV cache and buffers"
    )


def test_kv_layouts() -> None:
    hybrid = ModelGeometry(
        layers=8,
        experts=0,
        experts_used=0,
        expert_bytes=0,
        dense_bytes_per_layer=MIB,
        kv_bytes_per_token_layer=2048,
        head_bytes=MIB,
        full_attention_interval=4,
        recurrent_state_bytes=3 * MIB,
    )
    # Layers 3 and 7 keep 1000 tokens x 2048 B; the other six keep a 3 MiB state.
    assert [hybrid.layer_kv_bytes(i, 1000) for i in range(4)] == [3 * MIB, 3 * MIB, 3 * MIB, 2_048_000]
    sliding = ModelGeometry(
        layers=4,
        experts=0,
        experts_used=0,
        expert_bytes=0,
        dense_bytes_per_layer=MIB,
        kv_bytes_per_token_layer=2048,
        head_bytes=MIB,
        sliding_window=128,
        sliding_window_pattern=2,
    )
    # Even layers slide over 128 tokens, odd layers are global.
    assert [sliding.kv_tokens(i, 1000) for i in range(4)] == [128, 1000, 128, 1000]
    assert sliding.kv_tokens(0, 100) == 100
    # int8: one byte per value and a 2-byte scale per 32 values = 0.53125 of bf16.
    assert KV_BYTES_SCALE["int8"] == 0.53125
    assert SMALL.layer_kv_bytes(0, 1024, "int8") == 544 * 1024
    # q4_0: half a byte per value and a 2-byte scale per 32 = 0.28125 of bf16, as the engine's cache allocates
    assert KV_BYTES_SCALE["q4_0"] == 0.28125 and SMALL.layer_kv_bytes(0, 1024, "q4_0") == 288 * 1024
    fit = estimate_fit(sliding, [card(0, 4096)], context=1000, **OPTS)
    assert fit.cards[0].kv_bytes == 2 * 128 * 2048 + 2 * 1000 * 2048
    assert fit.summary_text() == "fits fully (dense model)"
    assert "free after loading" in fit.lines()[0]


def test_first_dense_layers_and_draft_layer() -> None:
    g = ModelGeometry(
        layers=6,
        experts=4,
        experts_used=2,
        expert_bytes=10 * MIB,
        dense_bytes_per_layer=MIB,
        kv_bytes_per_token_layer=0,
        head_bytes=5 * MIB,
        first_dense_layers=1,
        draft_bytes=7 * MIB,
    )
    assert g.moe_layers == 5 and g.routed_experts_total == 20
    assert g.total_bytes == 6 * MIB + 200 * MIB + 5 * MIB + 7 * MIB
    fit = estimate_fit(g, [card(0, 4096), card(1, 4096)], context=16, layer_split=[3], **OPTS)
    assert [c.experts_total for c in fit.cards] == [8, 12]  # layer 0 has no routed experts
    assert fit.cards[1].dense_bytes == 3 * MIB + 5 * MIB + 7 * MIB  # head and draft layer on the last card


def test_bad_inputs_say_what_is_wrong() -> None:
    gpus = [card(0, 4096), card(1, 4096)]
    with pytest.raises(
        ValueError, match=r"the model has 8 layers \(0-7\), every number must be below 8, e.g. 4"
    ):
        estimate_fit(SMALL, gpus, 1024, layer_split=[8])
    with pytest.raises(ValueError, match=r"has 2 number\(s\) for 2 card\(s\)"):
        estimate_fit(SMALL, gpus, 1024, layer_split=[2, 5])
    with pytest.raises(ValueError, match="kv type 'fp8'"):
        estimate_fit(SMALL, gpus, 1024, kv="fp8")
    with pytest.raises(ValueError, match="the model has 8 layers for 9 cards: use fewer cards"):
        estimate_fit(SMALL, [card(i, 4096) for i in range(9)], 1024)
    with pytest.raises(ValueError, match="expert_bytes > 0"):
        ModelGeometry(8, 4, 2, 0, MIB, 0, 0)
    with pytest.raises(ValueError, match="dense_bytes_per_layer must be a non-negative integer"):
        ModelGeometry(8, 4, 2, MIB, -1, 0, 0)


def test_four_cards_search_everything_quickly_and_more_go_proportional() -> None:
    g = ModelGeometry(48, 128, 8, 3 * MIB, 12 * MIB, 2048, 300 * MIB)
    gpus = [card(0, 16000), card(1, 24000), card(2, 12000), card(3, 8000)]
    started = time.monotonic()
    fit = estimate_fit(g, gpus, 32768)
    assert time.monotonic() - started < 5.0  # ~16k placements
    starts = (0, *fit.layer_split, 48)
    assert all(b - a >= 3 for a, b in itertools.pairwise(starts))
    # 6144 experts x 3 MiB = 18 GiB fit in the 60 GB of these cards: the search finds a placement holding all.
    assert fit.summary == "fits fully"
    six = [card(i, 10000) for i in range(6)]
    assert auto_split(g, six, 4096) == (8, 16, 24, 32, 40)

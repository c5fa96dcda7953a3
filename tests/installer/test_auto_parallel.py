"""--parallel left out: how many slots the server runs (installer.placement.auto_parallel) and where it keeps one."""

import pytest

from engine.link.startup import _sequences
from engine.pipeline.split import SplitOptions
from installer.placement import AUTO_PARALLEL, CPU_PARALLEL, Card, auto_parallel

GIB = 1 << 30


@pytest.mark.parametrize(
    ("slot_kv", "free", "want"),
    [
        (GIB // 2, 80 * GIB, AUTO_PARALLEL),  # a big card: the cap
        (GIB // 2, 10 * GIB, 2),  # a 12 GB card with 10 GiB free: 1.25 GiB for KV
        (2 * GIB, 10 * GIB, 1),  # never fewer than one
        (GIB // 2, None, CPU_PARALLEL),  # no card
    ],
)
def test_auto_parallel_keeps_the_slots_kv_within_an_eighth_of_the_card(
    slot_kv: int, free: int | None, want: int
) -> None:
    n, why = auto_parallel(slot_kv, free)
    assert n == want and str(n) in why
    if free is not None and n > 1:
        assert n * slot_kv <= free // 8


def test_on_the_cpu_the_slots_kv_stays_within_an_eighth_of_the_ram() -> None:
    assert auto_parallel(GIB // 2, None, 64 * GIB)[0] == CPU_PARALLEL
    n, why = auto_parallel(GIB, None, 16 * GIB)  # a big model's 1 GiB a slot on a 16 GiB PC: 2
    assert n == 2 and "RAM" in why
    assert auto_parallel(4 * GIB, None, 8 * GIB)[0] == 1


def test_a_remote_stage_asks_for_the_slots_asked_for() -> None:
    # the workers' welcome settles how many they hold (tests/engine/link/test_remote_slots.py)
    card = Card(0, "card", 80 * GIB)
    assert _sequences(4, SplitOptions(layer_split=(10,), remote="10.0.0.2:7470"), [card], None, 4096) == 4
    assert _sequences(4, SplitOptions(layer_split=(10,)), [card], None, 4096) == 4
    assert _sequences(3, SplitOptions(), [card], None, 4096) == 3
    assert _sequences(None, SplitOptions(), [], None, 4096) == CPU_PARALLEL

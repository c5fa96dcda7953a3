"""--max-context auto (serve's default): the context grows from the fixed default into the room an eighth of the
card gives the slots' KV, up to the length the model was trained for (installer.placement.auto_context), and the
flag takes `auto` or a count."""

import logging

import pytest

from engine.link.startup import _context
from engine.pipeline.split import SplitOptions
from installer.engine_options import AUTO_CONTEXT, resolve
from installer.placement import CONTEXT_STEP, Card, Geometry, auto_context

GIB = 1 << 30
# Qwen3-30B-A3B's attention: 48 layers, 4 KV heads of 128, K and V in bf16 -> 96 KiB a position
A3B = Geometry(n_layer=48, n_expert=128, dense_bytes=(0,) * 48, expert_bytes=(0,) * 48,
               kv_bytes_per_token=(2 * 4 * 128 * 2,) * 48)  # fmt: skip


def _kv(g: Geometry, context: int, slots: int) -> int:
    return slots * sum(g.kv_bytes(i, context) for i in range(g.n_layer))


@pytest.mark.parametrize(
    ("free", "slots", "want"),
    [
        (139 * GIB, 1, 40960),  # an H200, one slot: the trained length (3.75 GiB of KV)
        (10 * GIB, 2, 6144),  # a 12 GB card, 2 slots: 1.25 GiB for KV
        (2 * GIB, 4, 4096),  # the KV at the default already passes the eighth: never below it
    ],
)
def test_the_context_fills_an_eighth_of_the_card_up_to_the_trained_length(
    free: int, slots: int, want: int
) -> None:
    n, why = auto_context(A3B, 40960, free, slots, 4096)
    assert n == want and str(n) in why


def test_with_many_slots_the_context_is_the_most_whose_kv_fits() -> None:
    n, _ = auto_context(A3B, 40960, 139 * GIB, 16, 4096)
    assert 4096 < n < 40960 and n % CONTEXT_STEP == 0
    assert _kv(A3B, n, 16) <= 139 * GIB // 8 < _kv(A3B, n + CONTEXT_STEP, 16)


def test_sliding_window_layers_cost_no_more_past_their_window() -> None:
    g = Geometry(n_layer=4, n_expert=0, dense_bytes=(0,) * 4, expert_bytes=(0,) * 4,
                 kv_bytes_per_token=(GIB // 65536,) * 4, kv_window=(1024, 1024, 1024, 0))  # fmt: skip
    full = Geometry(n_layer=4, n_expert=0, dense_bytes=(0,) * 4, expert_bytes=(0,) * 4,
                    kv_bytes_per_token=(GIB // 65536,) * 4)  # fmt: skip
    assert auto_context(g, 131072, 8 * GIB, 1, 4096)[0] > auto_context(full, 131072, 8 * GIB, 1, 4096)[0]


def test_on_the_cpu_and_for_short_models_the_default_or_the_trained_length() -> None:
    assert auto_context(A3B, 40960, None, 4, 4096) == (
        4096,
        "4096 on the CPU; --max-context N gives more",
    )
    assert auto_context(A3B, 2048, 139 * GIB, 1, 4096)[0] == 2048
    assert auto_context(A3B, 2048, None, 1, 4096)[0] == 2048


def test_a_remote_stage_keeps_the_default_and_a_card_grows_it(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    card = Card(0, "card", 80 * GIB)
    assert _context(SplitOptions(layer_split=(10,), remote="10.0.0.2:7470"), [card], A3B, 40960, 4) == 4096
    assert "--max-context 4096 (auto: with --remote-stage" in caplog.text
    assert _context(SplitOptions(), [card], A3B, 40960, 1) == 40960
    assert (
        _context(SplitOptions(vram_budget_mib=8192), [card], A3B, 40960, 1) == 10240
    )  # the budget is the card
    assert _context(SplitOptions(), [], A3B, 40960, 4) == 4096


def test_the_flag_takes_auto_or_a_count_and_serve_defaults_to_auto(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert resolve(["serve"]).max_context == AUTO_CONTEXT
    assert resolve(["serve", "--max-context", "auto"]).max_context == AUTO_CONTEXT
    assert resolve(["serve", "--max-context", "32768"]).max_context == 32768
    assert resolve(["generate", "--prompt", "x"]).max_context == 4096
    with pytest.raises(SystemExit):
        resolve(["serve", "--max-context", "lots"])
    assert "'lots' is neither a count of positions nor auto" in capsys.readouterr().err

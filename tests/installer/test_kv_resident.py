"""--kv-resident: which layers keep their KV in page-locked host RAM (installer.placement.host_kv_layers), when
auto moves KV there on one card (auto_kv_resident), the flag, and the memory plan that then leaves that room to the
experts. The KV itself in host RAM runs on a card: tests/engine/test_kv_resident_gpu.py."""

import pytest

from engine.pipeline.split import SplitOptions, StagePlan, _policies, kv_host
from installer.engine_options import resolve
from installer.placement import (
    CONTEXT_STEP,
    DEFAULT_OVERHEAD_BYTES,
    DEFAULT_RESERVE_BYTES,
    Budget,
    Geometry,
    auto_kv_resident,
    host_kv_layers,
)

GIB = 1 << 30
PER = 2 * 4 * 128 * 2  # Qwen3-30B-A3B: 4 KV heads of 128, K and V in bf16 -> 4 KiB a layer and position
A3B = Geometry(n_layer=48, n_expert=128, dense_bytes=(20 << 20,) * 48, expert_bytes=(2 << 20,) * 48,
               kv_bytes_per_token=(PER,) * 48, embed_bytes=300 << 20, head_bytes=300 << 20)  # fmt: skip


def _vram_kv(g: Geometry, layers: range, host: frozenset[int], context: int) -> int:
    return sum(g.kv_bytes(i, context) for i in layers if i not in host)


@pytest.mark.parametrize("resident", [None, 131072, 200000])
def test_all_of_the_kv_stays_in_vram_without_a_limit_below_the_context(resident: int | None) -> None:
    assert host_kv_layers(A3B, range(48), 131072, resident) == frozenset()


@pytest.mark.parametrize(("resident", "vram_layers"), [(32768, 12), (0, 0), (65536, 24), (40000, 14)])
def test_vram_keeps_at_most_the_kv_of_the_resident_positions_as_whole_layers(
    resident: int, vram_layers: int
) -> None:
    host = host_kv_layers(A3B, range(48), 131072, resident)
    assert 48 - len(host) == vram_layers
    assert _vram_kv(A3B, range(48), host, 131072) <= resident * PER * 48
    assert host == frozenset(range(vram_layers, 48))  # of equal layers, the later ones go


def test_a_stage_places_only_its_own_layers_and_windows_go_last() -> None:
    """Sliding-window layers hold a window's KV whatever the context: the full layers go to host RAM first."""
    g = Geometry(n_layer=6, n_expert=0, dense_bytes=(0,) * 6, expert_bytes=(0,) * 6, kv_bytes_per_token=(PER,) * 6,
                 kv_window=(512, 512, 0, 512, 512, 0))  # fmt: skip
    host = host_kv_layers(g, range(6), 65536, 16384)
    assert host == frozenset(
        {2, 5}
    )  # 4 windows + 0 full layers = 2K positions' worth; 1 full layer would be 64K
    assert host_kv_layers(g, range(3, 6), 65536, 1024) == frozenset({5})


def test_recurrent_states_do_not_count_as_kv() -> None:
    g = Geometry(n_layer=4, n_expert=0, dense_bytes=(0,) * 4, expert_bytes=(0,) * 4,
                 kv_bytes_per_token=(0, 0, 0, PER), state_bytes=(1 << 20, 1 << 20, 1 << 20, 0))  # fmt: skip
    assert host_kv_layers(g, range(4), 8192, 0) == frozenset({3})


def test_auto_leaves_the_kv_in_vram_where_it_fits() -> None:
    assert auto_kv_resident(A3B, 32768, 1, 139 * GIB) == (None, "")


def test_auto_keeps_the_positions_that_fit_and_says_why() -> None:
    """A 10 GB card, 128K positions of bf16 KV (12 GiB): the dense weights take 1.5 GiB; what is left after the
    reserve, the working buffers and the experts' staging area holds the KV of some positions, in steps of
    CONTEXT_STEP."""
    free = 10 * GIB
    resident, why = auto_kv_resident(A3B, 131072, 1, free)
    stage = 128 * (2 << 20)  # a prompt chunk stages one layer's experts
    room = free - DEFAULT_RESERVE_BYTES - DEFAULT_OVERHEAD_BYTES - (48 * (20 << 20) + (600 << 20)) - stage
    assert resident is not None and resident % CONTEXT_STEP == 0
    assert resident * PER * 48 <= room < (resident + CONTEXT_STEP) * PER * 48
    assert "131072" in why and f"{resident}" in why and "host RAM" in why and "--max-context" in why
    # two slots: half the positions each
    two, _ = auto_kv_resident(A3B, 131072, 2, free)
    assert two is not None and abs(two - resident // 2) <= CONTEXT_STEP


def test_auto_gives_up_where_not_even_the_dense_weights_fit() -> None:
    assert auto_kv_resident(A3B, 131072, 1, 2 * GIB)[0] is None


def test_the_experts_get_the_room_of_the_kv_in_host_ram_and_the_plan_prices_it() -> None:
    sp = StagePlan((range(48),), (0,))
    full = _policies(sp, A3B, 131072, SplitOptions(), None)[0].kv_bytes
    opts = SplitOptions(kv_resident=32768)
    assert kv_host(A3B, sp, 0, 131072, opts) == frozenset(range(12, 48))
    assert _policies(sp, A3B, 131072, opts, None)[0].kv_bytes == full // 4
    assert (
        kv_host(A3B, StagePlan((range(48),), (None,)), 0, 131072, opts) == frozenset()
    )  # the CPU: no host KV
    assert Budget(131072, kv_resident=32768).kv_positions == 32768
    assert Budget(131072).kv_positions == Budget(131072, kv_resident=10**6).kv_positions == 131072


def test_the_flag_takes_a_count_or_auto() -> None:
    gen = ["generate", "--prompt", "hi"]
    assert resolve([*gen, "--kv-resident", "32768"]).kv_resident == 32768
    assert resolve([*gen, "--kv-resident", "auto"]).kv_resident is None
    assert resolve(["serve"]).kv_resident is None
    for bad in ("lots", "-5"):
        with pytest.raises(SystemExit):
            resolve([*gen, "--kv-resident", bad])

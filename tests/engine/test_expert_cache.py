"""Expert cache bookkeeping that needs no GPU: capacity planning and hit/miss accounting from selection counts."""

from itertools import pairwise

import torch
from gguf import GGMLQuantizationType as QT

from engine.experts.cache import ExpertCache
from engine.experts.capacity import plan_capacity
from engine.layers.moe import ExpertWeights
from engine.layers.pinned import PAGE
from engine.layers.qtensor import QTensor


def test_capacity_takes_the_hottest_pairs_within_the_budget() -> None:
    profile = torch.tensor([[5, 0, 9, 1], [7, 8, 0, 0]])
    cap = plan_capacity({0: 100, 1: 100}, 4, budget_bytes=350, profile=profile)
    assert cap == {0: 1, 1: 2}  # 9 (layer 0), 8 and 7 (layer 1): three experts of 100 bytes fit in 350
    assert plan_capacity({0: 100, 1: 100}, 4, budget_bytes=10_000, profile=None, max_pairs=3) == {0: 3, 1: 0}
    assert plan_capacity({0: 100}, 4, budget_bytes=0, profile=profile) == {0: 0}


def _experts(n_e: int = 4) -> ExpertWeights:
    raw = torch.zeros(n_e, 2, 34, dtype=torch.uint8)  # Q8_0 rows of 32 elements
    q = QTensor(raw, QT.Q8_0, (n_e, 2, 32))
    return ExpertWeights(QTensor(torch.zeros(n_e, 32 * 4, dtype=torch.uint8), QT.F32, (n_e, 32)), q, q, q)


def test_hits_and_misses_come_from_the_selection_counts() -> None:
    cache = ExpertCache({0: _experts()}, torch.device("cpu"), {0: 2}, profile=torch.tensor([[1, 9, 8, 0]]))
    assert cache.layers[0].slot_of == [-1, 0, 1, -1]  # experts 1 and 2 are the hottest
    counts = torch.zeros(1, 4, dtype=torch.int64)
    cache.attach_counts(counts)
    counts[0] += torch.tensor([3, 5, 1, 2])
    st = cache.stats()
    assert (st.hits, st.misses) == (6, 5)
    assert st.experts_in_vram == 2 and st.experts_total == 4


def test_prompt_tables_point_at_slots_and_at_the_staged_copies_of_the_rest() -> None:
    n_e = 6
    raws = [torch.randint(0, 256, (n_e, 2, 34), dtype=torch.uint8) for _ in range(3)]
    qs = [QTensor(r, QT.Q8_0, (n_e, 2, 32)) for r in raws]
    router = QTensor(torch.zeros(n_e, 32 * 4, dtype=torch.uint8), QT.F32, (n_e, 32))
    profile = torch.tensor([[0, 9, 0, 0, 8, 0]])  # experts 1 and 4 in slots; 0, 2-3 and 5 staged (two runs)
    cache = ExpertCache({0: ExpertWeights(router, *qs)}, torch.device("cpu"), {0: 2}, profile=profile)
    le = cache.layers[0]
    tables = cache.prompt_tables(0)
    assert cache.prompt_area is not None
    for j, (p, raw, table) in enumerate(zip(le.projections, raws, tables, strict=True)):
        area = cache.prompt_area[j]
        for e in range(n_e):
            addr = int(table[e])
            if le.slot_of[e] >= 0:
                assert addr == p.slot_addr(le.slot_of[e])
            else:
                i = next(i for i in range(area.shape[0]) if area[i].data_ptr() == addr)
                assert torch.equal(area[i], raw[e])
    assert le.bytes_moved == 4 * 3 * 2 * 34


def test_a_held_layer_stages_its_experts_once() -> None:
    """Inside hold_prompt_layer(li) the chunks of layer li share one staging (a prompt read layer by layer);
    other layers, and the same layer outside the block, stage again."""
    cache = ExpertCache({0: _experts(), 1: _experts()}, torch.device("cpu"), {0: 1, 1: 1})
    le0, le1 = cache.layers[0], cache.layers[1]
    one = 3 * 3 * 2 * 34  # three missed experts, three projections
    assert cache.streams_prompts
    assert cache.pending_bytes == one  # the staging area, not allocated before the first prompt
    with cache.hold_prompt_layer(0):
        first = cache.prompt_tables(0)
        again = cache.prompt_tables(0)
        assert all(a is b for a, b in zip(first, again, strict=True))
        cache.prompt_tables(1)  # overwrites the staging area: layer 0 stages again
        assert (le0.bytes_moved, le1.bytes_moved) == (one, one)
        cache.prompt_tables(0)
        cache.prompt_tables(0)
    assert le0.bytes_moved == 2 * one
    cache.prompt_tables(0)
    assert le0.bytes_moved == 3 * one
    assert cache.pending_bytes == 0
    full = ExpertCache({0: _experts()}, torch.device("cpu"), {0: 4})
    assert not full.streams_prompts and full.pending_bytes == 0


def test_pinned_slabs_hold_several_projections_and_waste_little() -> None:
    """The host store is pinned in slabs of a power of two (torch rounds every pinned allocation up to one): every
    projection placed once, page-aligned, inside its slab; Qwen3-30B-A3B's 144 projections of 113 MB take about 5%
    more than their bytes, where one allocation each took 18.5% more (144 x 128 MiB)."""
    from engine.layers.pinned import plan_slabs

    for sizes in ([113_246_208] * 144, [5_000, 70_000, 3, 1 << 20, 123_457] * 7, [3 << 30, 1 << 20]):
        plan = plan_slabs(sizes)
        placed = [(size, o) for size, offs in plan for o in offs]
        assert len(placed) == len(sizes)
        for (size, o), n in zip(placed, sizes, strict=True):
            assert size & (size - 1) == 0 and o % PAGE == 0 and o + n <= size
        at = 0
        for _, offs in plan:  # in order, and no two tensors of a slab overlap
            for o, nxt in pairwise(offs):
                assert o + sizes[at] <= nxt
                at += 1
            at += 1
    a3b = plan_slabs([113_246_208] * 144)
    assert sum(s for s, _ in a3b) <= 1.07 * 144 * 113_246_208


def test_pin_all_copies_into_slab_views(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """pin_all's views hold the same bytes as the tensors they copy (pinning itself needs a card: here the slabs
    are plain memory), and a failed pin leaves the rest as they were."""
    import engine.experts.cache as cache_mod

    raws = [torch.randint(0, 256, (n, 7), dtype=torch.uint8) for n in (3, 1000, 50)]
    plain = torch.empty
    monkeypatch.setattr(cache_mod.torch, "empty", lambda *a, pin_memory=False, **k: plain(*a, **k))
    got = cache_mod.pin_all(raws)
    assert all(torch.equal(g, r) and g.data_ptr() != r.data_ptr() for g, r in zip(got, raws, strict=True))
    assert got[1].data_ptr() - got[0].data_ptr() == PAGE  # one slab, a page each

    def refuse(*a, **k):  # type: ignore[no-untyped-def]
        raise RuntimeError("no pinned memory here")

    monkeypatch.setattr(cache_mod.torch, "empty", refuse)
    assert all(g is r for g, r in zip(cache_mod.pin_all(raws), raws, strict=True))
    # a slab refused: the tensors are still pinned one by one
    sizes = []

    def small_only(*a, pin_memory=False, **k):  # type: ignore[no-untyped-def]
        n = a[0] if isinstance(a[0], int) else a[0][0] * a[0][1]
        if n >= 4096:
            raise RuntimeError("no room for a slab")
        sizes.append(n)
        return plain(*a, **k)

    monkeypatch.setattr(cache_mod.torch, "empty", small_only)
    got = cache_mod.pin_all(raws[:1])
    assert torch.equal(got[0], raws[0]) and got[0] is not raws[0] and sizes == [21]


def test_the_decode_staging_area_grows_with_the_slots_within_an_eighth_of_the_budget() -> None:
    """Room for the misses of up to 8 rows (k experts each), at least one row's, at most an eighth of the experts'
    budget beyond that: Qwen3-30B-A3B (k = 8, 2.65 MB an expert) on a 5 GB budget keeps 64 at --parallel 8; large
    experts (25 MB) on a 4 GB budget keep 16."""
    from engine.experts.policy import decode_stage_slots

    mb = 1 << 20
    assert (
        decode_stage_slots(8, 1) == 8 and decode_stage_slots(8, 8) == 64 and decode_stage_slots(8, 16) == 64
    )
    assert decode_stage_slots(8, 8, int(2.65 * mb), 5 << 30) == 64
    assert decode_stage_slots(8, 8, 25 * mb, 4 << 30) == 16
    assert decode_stage_slots(8, 8, 25 * mb, 0) == 8  # never less than one row's

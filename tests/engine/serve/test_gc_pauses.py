"""The server's garbage collection: what the load made is frozen out of collections, pauses are counted."""

import gc

from engine.telemetry import gc_pauses


def test_a_load_is_frozen_and_collections_are_timed() -> None:
    keep = [[i] for i in range(20000)]  # objects a load would leave
    frozen, _ = gc_pauses.freeze_loaded()
    try:
        assert frozen >= 20000 and gc.get_freeze_count() == frozen
        p = gc_pauses.watch()
        before = sum(p.collections)
        gc.collect()
        snap = p.snapshot()
        assert sum(snap["collections"]) > before and snap["pause_ms_max"] >= 0  # type: ignore[arg-type,operator]
        assert snap["frozen_objects"] == frozen
        assert gc_pauses.watch() is p and gc.callbacks.count(p) == 1  # once per process
    finally:
        gc_pauses.unfreeze()
    assert gc.get_freeze_count() == 0 and keep

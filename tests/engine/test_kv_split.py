"""KVCache.split: slots' caches as rows of one cache (the fused decode path runs their rows together)."""

import pytest
import torch

from engine.layers.kv_cache import KVCache, KVCacheError


@pytest.mark.parametrize("kv", ["f32", "int8"])
def test_split_caches_are_views_of_their_rows(kv: str) -> None:
    shared = KVCache(range(2), 12, 2, 4, 4, kv, torch.device("cpu"))
    a, b, c = shared.split(3)
    assert (a.max_ctx, b.base, c.base, c.shared) == (4, 4, 8, shared)
    k = torch.ones(1, 2, 4)
    b.store(1, torch.tensor([2]), k * 3, k * 5, 4)
    assert shared.layers[1].k[4 + 2].float().abs().sum() > 0  # b's position 2 is the shared row 6
    assert shared.layers[1].k[:6].float().abs().sum() == 0 and shared.layers[1].k[7:].float().abs().sum() == 0
    keys, values = b.store(0, torch.tensor([0]), k, k, 1)
    assert keys.shape == values.shape == (1, 2, 4) and torch.equal(a.layers[0].k, shared.layers[0].k[:4])
    a.length = 3
    assert b.length == 0 and shared.length == 0  # each sequence's length is its own


def test_a_split_too_fine_is_refused() -> None:
    with pytest.raises(KVCacheError, match="cannot split"):
        KVCache(range(1), 2, 1, 4, 4, "f32", torch.device("cpu")).split(3)

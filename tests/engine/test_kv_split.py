"""KVCache.split: slots' caches as rows of one cache (the fused decode path runs their rows together)."""

from pathlib import Path

import pytest
import torch

from engine.layers.kv_cache import KVCache, KVCacheError, dequant4, quant4


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


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads the resident set from /proc")
@pytest.mark.parametrize("kv", ["f32", "bf16", "int8", "q4_0"])
def test_a_cpu_cache_holds_memory_for_the_positions_it_has_used(kv: str) -> None:
    """A CPU cache's pages are mapped as positions are written, not for the whole --max-context at once (the CPU's
    resident memory then follows the conversation, not the longest context the engine allows)."""

    def rss() -> int:
        text = Path("/proc/self/status").read_text()
        return int(text.split("VmRSS:")[1].split()[0]) << 10

    before = rss()
    cache = KVCache(range(8), 16384, 8, 128, 128, kv, torch.device("cpu"))  # 128-512 MiB in all
    assert rss() - before < cache.nbytes // 8
    k = torch.randn(4, 8, 128, generator=torch.Generator().manual_seed(0))
    lk = cache.write(3, torch.arange(4), k, k, 4)
    assert lk.k.shape[0] == 16384 and bool((lk.k[4:].float() == 0).all())
    got = cache.store(3, torch.arange(4, 5), k[:1], k[:1], 5)[0]
    if kv == "q4_0":  # 4-bit: the values the q4_0 rounding gives
        assert torch.equal(got[:4], dequant4(*quant4(k), torch.float32))
    else:
        assert torch.allclose(got[:4].float(), k, atol=0.02)

"""Prompt cache: the KV of recent sequences kept in host memory, so that a request which extends any of them (the
next turn of a conversation, another branch of it) reads only its new tokens.

The live sequence stays in the runner's KV cache; only when a request leaves it (another conversation comes in) is
its filled part copied here. A request that shares a longer prefix with a kept sequence than with the live one gets
that sequence's KV copied back. Entries are evicted least recently used first, within `max_bytes`.
"""

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from engine.layers.kv_cache import KVCache
from engine.layers.pinned import plan_slabs, views


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


@dataclass
class CacheEntry:
    tokens: list[int]
    # per layer: k [n, Hkv, Dk], v [n, Hkv, Dv], and for int8 KV their scales [n, Hkv, 1]
    layers: dict[int, tuple[torch.Tensor | None, ...]]
    kv_type: str
    nbytes: int
    used: float = field(default_factory=time.monotonic)


@dataclass
class PromptCacheStats:
    entries: int
    bytes: int
    max_bytes: int
    saves: int
    restores: int
    evictions: int
    restored_tokens: int


def _copy_out(parts: list[torch.Tensor], pin: bool) -> tuple[list[torch.Tensor], int]:
    """Host copies of `parts`, and the bytes of host memory they take. For a card they are page-locked, so that the
    copies are queued behind the device's work instead of waiting for it (a server saving a slot's KV while a step
    runs does not stall), in slabs of a power of two (layers.pinned.plan_slabs): torch's pinned allocator rounds
    each block up to one, which one buffer an entry left up to half unused, beyond what the cache counted."""
    sizes = [t.numel() * t.element_size() for t in parts]
    if pin:
        plan = plan_slabs(sizes)
    else:  # plain memory: one buffer, each part 16-byte aligned
        offsets, total = [], 0
        for n in sizes:
            offsets.append(total)
            total += -(-n // 16) * 16
        plan = [(total, offsets)]
    out: list[torch.Tensor] = []
    held = i = 0
    for size, offsets in plan:
        buf = torch.empty(size, dtype=torch.uint8, device="cpu", pin_memory=pin)
        held += size
        mine = parts[i : i + len(offsets)]
        gathered = pin and _gather(mine, offsets, sizes[i : i + len(offsets)], buf)
        for dst, t in zip(views(buf, offsets, [(tuple(t.shape), t.dtype) for t in mine]), mine, strict=True):
            if not gathered:
                dst.copy_(t, non_blocking=pin)
            out.append(dst)
        i += len(offsets)
    return out, held


# A slab's parts (a snapshot's K and V of every layer) are gathered on the card into one buffer of at most this
# many bytes and cross in one copy: a copy per part (two a layer) took the server's thread ~7 ms a new request.
GATHER_MAX = 64 << 20


def _gather(parts: list[torch.Tensor], offsets: list[int], sizes: list[int], buf: torch.Tensor) -> bool:
    """Copy `parts` (contiguous, on one card) to `buf` at `offsets` through one device buffer -> whether it did."""
    end = offsets[-1] + sizes[-1] if offsets else 0
    dev = parts[0].device if parts else None
    if (
        not parts
        or end > GATHER_MAX
        or dev is None
        or dev.type != "cuda"
        or any(t.device != dev or not t.is_contiguous() for t in parts)
    ):
        return False
    pieces, at = [], 0
    for t, o, n in zip(parts, offsets, sizes, strict=True):
        if o > at:
            pieces.append(torch.empty(o - at, dtype=torch.uint8, device=dev))  # alignment padding
        pieces.append(t.reshape(-1).view(torch.uint8))
        at = o + n
    buf[:end].copy_(torch.cat(pieces), non_blocking=True)
    return True


class PromptCache:
    """Several sequences' KV, at most `max_bytes` in all, kept in host memory (pinned when the model is on CUDA)."""

    def __init__(self, max_bytes: int, min_tokens: int = 16) -> None:
        self.max_bytes = max(0, int(max_bytes))
        self.min_tokens = max(1, min_tokens)  # shorter sequences cost little to read again
        self.entries: list[CacheEntry] = []
        self._saves = self._restores = self._evictions = self._restored_tokens = 0

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries)

    def stats(self) -> PromptCacheStats:
        return PromptCacheStats(
            len(self.entries),
            self.nbytes,
            self.max_bytes,
            self._saves,
            self._restores,
            self._evictions,
            self._restored_tokens,
        )

    def lookup(self, tokens: Sequence[int]) -> tuple[CacheEntry | None, int]:
        """The entry sharing the longest prefix with `tokens`, and that prefix's length (ties: most recent)."""
        best, best_n = None, 0
        for e in self.entries:
            n = common_prefix(e.tokens, tokens)
            if n > best_n or (n == best_n and n > 0 and best is not None and e.used > best.used):
                best, best_n = e, n
        return best, best_n

    def snapshot(self, tokens: Sequence[int], cache: KVCache) -> CacheEntry | None:
        """A host copy of the first len(tokens) positions of `cache`, or None when not worth keeping."""
        n = len(tokens)
        if n < self.min_tokens or n > cache.length:
            return None
        per_token = cache.nbytes // max(1, cache.max_ctx)
        if per_token * n > self.max_bytes:
            return None
        # A kept entry that already holds this sequence (or more of it) makes a copy useless.
        for e in self.entries:
            if len(e.tokens) >= n and common_prefix(e.tokens, tokens) == n:
                e.used = time.monotonic()
                return None
        pin = any(lk.k.device.type == "cuda" for lk in cache.layers.values()) and torch.cuda.is_available()
        srcs = [
            (i, j, t[:n])
            for i, lk in cache.layers.items()
            for j, t in enumerate((lk.k, lk.v, lk.k_scale, lk.v_scale))
            if t is not None
        ]
        copies, nbytes = _copy_out([t for _, _, t in srcs], pin)
        layers: dict[int, list[torch.Tensor | None]] = {i: [None] * 4 for i in cache.layers}
        for (i, j, _), c in zip(srcs, copies, strict=True):
            layers[i][j] = c
        return CacheEntry(list(tokens), {i: tuple(v) for i, v in layers.items()}, cache.kv_type, nbytes)

    def insert(self, entry: CacheEntry | None) -> None:
        if entry is None or entry.nbytes > self.max_bytes:
            return
        # Entries that are a prefix of the new one are covered by it.
        self.entries = [e for e in self.entries if common_prefix(e.tokens, entry.tokens) < len(e.tokens)]
        self.entries.append(entry)
        self._saves += 1
        while self.nbytes > self.max_bytes and len(self.entries) > 1:
            oldest = min(self.entries, key=lambda e: e.used)
            self.entries.remove(oldest)
            self._evictions += 1

    def save(self, tokens: Sequence[int], cache: KVCache) -> None:
        self.insert(self.snapshot(tokens, cache))

    def restore(self, entry: CacheEntry, n: int, cache: KVCache) -> None:
        """Copy the first n positions of `entry` into `cache`, which then holds exactly those n positions."""
        if entry.kv_type != cache.kv_type:
            raise ValueError(f"prompt cache entry has KV type {entry.kv_type}, the cache {cache.kv_type}")
        n = min(n, len(entry.tokens))
        for i, lk in cache.layers.items():
            for dst, src in zip((lk.k, lk.v, lk.k_scale, lk.v_scale), entry.layers[i], strict=True):
                if dst is not None and src is not None:  # page-locked on a card: queued, as the save was
                    dst[:n].copy_(src[:n], non_blocking=src.is_pinned())
        cache.length = n
        entry.used = time.monotonic()
        self._restores += 1
        self._restored_tokens += n

    def clear(self) -> None:
        self.entries.clear()

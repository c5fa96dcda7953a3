"""The grouped expert kernel's schedule (engine.kernels.moe_blocks.Blocks): computed on the device with torch ops, so
it runs on the CPU too. Every (token, slot) pair is in exactly one block, a block holds one expert's pairs and at
most BLOCK_M of them, and the blocks in use come first."""

import pytest
import torch

from engine.kernels import moe_blocks


@pytest.mark.parametrize("t,k,e,seed", [(1, 8, 128, 0), (90, 3, 6, 1), (512, 8, 128, 2), (37, 4, 16, 3)])
def test_blocks_cover_every_slot_once(t: int, k: int, e: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    if t > 10:
        ids[: t // 2, 0] = 3  # one expert with many rows: several blocks
    b = moe_blocks.Blocks(ids, e)
    flat = ids.reshape(-1)
    n = int(b.nblocks.item())
    assert n <= b.max_blocks
    seen = torch.zeros(flat.numel(), dtype=torch.int64)
    for i in range(n):
        lo, hi, ex = int(b.start[i]), int(b.end[i]), int(b.expert[i])
        assert 0 < hi - lo <= moe_blocks.BLOCK_M
        slots = b.order[lo:hi]
        assert torch.all(flat[slots] == ex)
        seen[slots] += 1
    assert torch.all(seen == 1)
    counts = torch.bincount(flat, minlength=e)
    expect = int(((counts + moe_blocks.BLOCK_M - 1) // moe_blocks.BLOCK_M).sum())
    assert n == expect

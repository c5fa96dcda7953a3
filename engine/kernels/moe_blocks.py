"""The schedule of the grouped expert kernel (engine/kernels/moe_gemm.py), in plain torch ops on the device: no
Triton here, so it is checked on any machine."""

from collections.abc import Callable

import torch

BLOCK_M = 64  # (token, slot) rows of one expert a program multiplies


class Blocks:
    """The chunk's (token, slot) pairs sorted by expert and cut into blocks of `block_m` rows of one expert: computed
    on the device once per layer and used by the gate/up and the down launches. `schedule` computes the block table
    from the per-expert counts in one launch (engine.kernels.moe_gemm.block_table) instead of the ~18 torch ops
    here; the blocks in use (b < nblocks) are the same either way."""

    def __init__(
        self,
        ids: torch.Tensor,
        n_expert: int,
        schedule: "Schedule | None" = None,
        order: "Order | None" = None,
        block_m: int = BLOCK_M,
    ) -> None:
        self.block_m = block_m
        flat = ids.reshape(-1)  # [S]
        s = flat.numel()
        # index_add_, not bincount: bincount sizes its output from the largest id, a host sync each layer that
        # kept the host from queueing the next layer's launches while this one ran
        counts = torch.zeros(n_expert, dtype=torch.int64, device=flat.device)
        counts.index_add_(0, flat, torch.ones(s, dtype=torch.int64, device=flat.device))  # [E]
        # the pairs by expert, in index order within one (`order`: engine.kernels.moe_gemm.expert_order)
        self.order = order(flat, counts) if order is not None else torch.argsort(flat, stable=True)  # [S]
        self.max_blocks = -(-s // block_m) + n_expert  # a bound known on the host: the launch grid
        if schedule is not None:
            self.expert, self.start, self.end, self.nblocks = schedule(counts, self.max_blocks, block_m)
            return
        nblk = (counts + block_m - 1) // block_m
        cum_blk = torch.cumsum(nblk, 0)
        cnt_first = torch.cumsum(counts, 0) - counts
        b = torch.arange(self.max_blocks, device=ids.device)
        ex = torch.searchsorted(cum_blk, b, right=True).clamp_max(n_expert - 1)  # [MAXB]
        self.expert = ex
        self.start = cnt_first[ex] + (b - (cum_blk - nblk)[ex]) * block_m
        self.end = torch.minimum(self.start + block_m, cnt_first[ex] + counts[ex])
        self.nblocks = cum_blk[-1:]


# counts [E], max_blocks, block_m -> expert, start, end [max_blocks] and nblocks [1] (int64, on the counts' device)
Schedule = Callable[[torch.Tensor, int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]
# ids [S], counts [E] -> the stable sort order of the ids [S] (int64)
Order = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

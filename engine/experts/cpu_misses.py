"""A decode step's missed experts split between the CPU and the GPU's PCIe copies (`--cpu-experts F`).

Of each layer's experts left in host RAM, a fraction F (the least used first, where a profile says which) is also
held repacked for the CPU (engine/experts/cpu_experts.py). When a one-token step selects such an expert and it is
not in VRAM, the CPU computes it while the GPU copies and computes the other misses: the two draw on different
buses (host RAM for the CPU, PCIe for the copies). The price is a host synchronisation a MoE layer (the host must
see the step's expert ids), so such steps run without CUDA graphs; `bench/engine_bench.py --cpu-experts F` measures
whether that pays on a machine."""

import logging
from typing import TYPE_CHECKING

import torch

from engine.experts.cpu_experts import CpuExperts

if TYPE_CHECKING:
    from engine.experts.cache import ExpertCache

log = logging.getLogger("strata.engine")


class CpuMisses:
    """The CPU's share of one expert cache's misses, with the pinned buffers a step's hand-offs go through."""

    def __init__(
        self, cache: "ExpertCache", share: float, k: int, act: str, profile: torch.Tensor | None = None
    ) -> None:
        if not 0.0 < share <= 1.0:
            raise ValueError(f"--cpu-experts {share}: give a fraction above 0 and at most 1")
        self.cache = cache
        self.layers: dict[int, CpuExperts] = {}
        d = 0
        for li, le in cache.layers.items():
            if le.host_tables is None:  # every expert of the layer is in VRAM
                continue
            out = [e for e in range(le.n_expert) if le.slot_of[e] < 0]
            if profile is not None:
                out.sort(key=lambda e: float(profile[li, e]))  # the least used go to the CPU
            n = round(len(out) * share)
            if n:
                self.layers[li] = CpuExperts(le.gate.host, le.up.host, le.down.host, out[:n], act)
                d = self.layers[li].d
        dev = cache.device
        self.ids = torch.zeros(k, dtype=torch.int64, pin_memory=True)
        self.w = torch.zeros(k, dtype=torch.float32, pin_memory=True)
        self.x = torch.zeros(max(d, 1), dtype=torch.float32, pin_memory=True)
        self.y = torch.zeros(max(d, 1), dtype=torch.float32, pin_memory=True)
        self.claim_host = torch.zeros(k, dtype=torch.int32, pin_memory=True)
        self.claim = torch.zeros(k, dtype=torch.int32, device=dev)
        self.event = torch.cuda.Event()
        self._take: torch.Tensor | None = None
        self._layer = -1
        self.slots = 0  # (token, slot) pairs the CPU computed
        held = sum(ce.n_held for ce in self.layers.values())
        log.info("%d experts of %d layers also held for the CPU (%.1f GiB of host RAM): the CPU computes them "
                 "when a decode step misses them", held, len(self.layers),
                 sum(ce.nbytes for ce in self.layers.values()) / 2**30)  # fmt: skip

    def begin(self, li: int, ids: torch.Tensor, w: torch.Tensor, x: torch.Tensor) -> torch.Tensor | None:
        """ids, w [1, k] and the experts' float32 input x [1, D] of layer li, on the device: waits for them, and
        returns the device's claim mask int32 [k] (1: the CPU computes that slot; the GPU neither copies it nor
        counts it), or None where the CPU takes none of this step's slots."""
        ce = self.layers.get(li)
        if ce is None or ids.shape[0] != 1:
            return None
        self.ids.copy_(ids.view(-1), non_blocking=True)
        self.w.copy_(w.view(-1), non_blocking=True)
        self.x.copy_(x.view(-1), non_blocking=True)
        self.event.record()
        self.event.synchronize()  # the host sync of this path: the ids decide what the CPU computes
        slot_of = self.cache.layers[li].slot_of
        take = [ce.holds(e) and slot_of[e] < 0 for e in self.ids.tolist()]
        if not any(take):
            return None
        self.claim_host.copy_(torch.tensor(take, dtype=torch.int32))
        self.claim.copy_(self.claim_host, non_blocking=True)
        self._take, self._layer = self.claim_host.view(1, -1) != 0, li
        self.slots += sum(take)
        return self.claim

    def finish(self, out: torch.Tensor) -> torch.Tensor:
        """The CPU's experts of the step `begin` claimed, computed while the GPU runs the others, added to the
        layer's output [1, D] float32 (on the device)."""
        assert self._take is not None
        ce = self.layers[self._layer]
        d = ce.d
        y = ce.mix(self.x[:d].view(1, d), self.ids.view(1, -1), self.w.view(1, -1), self._take)  # [1, D]
        self._take = None
        self.y[:d].copy_(y.view(-1))
        # the next layer's begin synchronises before this buffer is written again
        return out + self.y[:d].view(1, d).to(out.device, non_blocking=True)

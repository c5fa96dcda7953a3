"""The expert backends of the MoE block (engine.layers.moe) that read an expert cache or the CPU's own kernels, and
the rule that picks one for each layer when a model is loaded (`choose`).

- `CachedExperts`: a card's expert cache (engine.experts.cache): its slots in VRAM and the rest in host RAM.
  Decode-sized inputs (up to 8 rows) run two fused kernels that read each selected expert wherever the cache's
  device tables say it is (no host synchronisation: the step can be captured in a CUDA graph); prompt chunks run
  grouped matrix multiplies on tensor cores through the same tables, the experts in host RAM streamed into VRAM
  first; block types without those kernels go expert by expert.
- `CpuInPlaceExperts`: decode on the CPU computes a token's Q4_K experts (Q4_K or Q6_K down) from their blocks
  where they lie, against activations rounded to 8 bits (engine.experts.cpu_q4k); longer inputs, `--activations
  float` and other block types go expert by expert (engine.layers.moe.HostExperts).
"""

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch
from gguf import GGMLQuantizationType as QT

from engine import kernels
from engine.experts.cpu_experts import CpuExperts
from engine.kernels import int8_activations
from engine.layers.moe import ExpertMath, Experts, ExpertWeights, HostExperts, per_expert

if TYPE_CHECKING:
    from engine.experts.cache import ExpertCache, LayerExperts

log = logging.getLogger("strata.engine")

FUSED_MAX_ROWS = 8  # decode-sized inputs (a step, a verify window) take the fused expert kernels
# Decode on the CPU, and verify windows of up to 8 rows (each token as a one-token step computes it: the window's
# logits are the steps' to the bit); longer prompt chunks go expert by expert over all their tokens.
IN_PLACE_MAX_ROWS = 8
Tables = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def choose(ew: ExpertWeights, math: ExpertMath, cache: "ExpertCache | None", layer: int) -> Experts:
    """The backend of one MoE layer: its card's expert cache where it has one; on the CPU the in-place kernels
    where the block types and the math allow them; else every expert from the layer's own block tensors."""
    if cache is not None:
        return CachedExperts(cache, layer, math)
    if ew.gate.raw.device.type == "cpu" and math.plain:
        assert math.act is not None
        in_place = CpuExperts.in_place_kernels(ew.gate, ew.up, ew.down, math.act)
        if in_place is not None:
            return CpuInPlaceExperts(ew, math, in_place)
    return HostExperts(ew, math)


class CpuInPlaceExperts:
    def __init__(self, ew: ExpertWeights, math: ExpertMath, kernels: object) -> None:
        self.host = HostExperts(ew, math)
        self.kernels = kernels  # engine.experts.cpu_q4k.Q4KExperts

    def mix(self, x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > IN_PLACE_MAX_ROWS or not int8_activations():
            return self.host.mix(x, w, ids)
        out = torch.empty(x.shape, dtype=torch.float32)
        t, k = ids.shape
        tok = np.repeat(np.arange(t), k)  # the tokens' experts straight from their blocks, each read once
        self.kernels.mix_rows(ids.reshape(-1).numpy(), tok, w.float().reshape(-1).numpy(),  # type: ignore[attr-defined]
                              x.float().contiguous().numpy(), out.numpy())  # fmt: skip
        return out


class CachedExperts:
    def __init__(self, cache: "ExpertCache", layer: int, math: ExpertMath) -> None:
        self.cache, self.layer, self.math = cache, layer, math
        cpu = cache.cpu_misses
        if cpu is not None and layer in cpu.rows and not (math.plain and math.act == cpu.act):
            # the CPU's kernels compute plain experts only: this layer's misses stay on the GPU
            cpu.drop(layer)
            if not cpu.rows:
                cache.cpu_misses = None

    def hand_off(
        self, ids: torch.Tensor, w: torch.Tensor, x32: torch.Tensor, tables: torch.Tensor | None = None
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """A decode step's missed experts that the CPU takes (--cpu-experts; x32 the experts' float32 input
        [T, D]): (claim [T * k], 1 where the CPU computes the pair's expert, or None where it takes none of this
        layer's; the weights the GPU's sum uses, the CPU's pairs zeroed). `take_back` adds the CPU's sums to the
        output. `tables`: the layer's with the prefetched experts in VRAM (hits, not the CPU's to take)."""
        cpu = self.cache.cpu_misses
        posted = cpu.post(self.layer, ids, w, x32, tables) if cpu is not None else None
        return (None, w) if posted is None else posted

    def take_back(self, out: torch.Tensor, claim: torch.Tensor | None) -> torch.Tensor:
        """out [T, D] float32 with the CPU's share of the step added (in place), where `hand_off` claimed any."""
        cpu = self.cache.cpu_misses
        return out if claim is None or cpu is None else cpu.collect(self.layer, out)

    def mix(self, x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        cache, layer, math = self.cache, self.layer, self.math
        le = cache.layers[layer]
        t, d = x.shape
        k = ids.shape[1]
        g, u, dn = le.gate.host, le.up.host, le.down.host
        f = g.shape[1]
        b = math.biases
        if t <= FUSED_MAX_ROWS and fused_moe_available(g.qtype, u.qtype, dn.qtype, d, f):
            moe_gemv = kernels.gemv.moe_gemv
            flat = ids.reshape(-1)
            claim, w = self.hand_off(ids, w, x.float()) if t == 1 and math.plain else (None, w)
            # sid: the ids the kernels read the tables with
            gt, ut, dt, sid = expert_tables(cache, layer, ids, claim)
            if math.plain:
                h = moe_gemv(gt, g.qtype, g.raw.shape[-1], sid, x, f, d, k, up_table=ut, act=math.act)
            else:
                hg = moe_gemv(gt, g.qtype, g.raw.shape[-1], sid, x, f, d, k)  # [T*k, F]
                hu = moe_gemv(ut, u.qtype, u.raw.shape[-1], sid, x, f, d, k)
                if b is not None:
                    hg, hu = hg + b.gate[flat], hu + b.up[flat]
                h = math.glu(hg, hu)
            y = moe_gemv(dt, dn.qtype, dn.raw.shape[-1], sid, h, d, f, k, x_per_slot=True)  # [T*k, D]
            if b is not None:
                y = y + b.down[flat]
            return self.take_back((y.view(t, k, d).float() * w.float().unsqueeze(-1)).sum(dim=1), claim)
        if math.plain:  # a prompt chunk: grouped launches where they exist
            assert math.act is not None
            grouped = grouped_experts(x, le, w, ids, k, math.act, lambda: cache.prompt_tables(layer))
            if grouped is not None:
                return grouped
        loaded: dict[int, ExpertWeights] = {}

        def get(e: int) -> ExpertWeights:
            if e not in loaded:
                loaded[e] = le.expert(e, x.device)
            return loaded[e]

        return per_expert(x, w, ids, get, math)


def expert_tables(
    cache: "ExpertCache",
    layer: int,
    ids: torch.Tensor,
    claim: torch.Tensor | None = None,
    tables: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gate, up and down address tables a decode step's expert kernels read, and the ids to read them with:
    the cache's own tables and the experts' ids, or (with `--expert-misses copy`) per-slot tables with the missed
    experts staged in VRAM, read with the identity. `claim` [k]: slots the CPU computes (not staged); `tables`:
    the layer's with the prefetched experts in VRAM (engine/experts/prefetch.py)."""
    staged = cache.staged_tables(layer, ids, claim, tables)
    if staged is not None:
        tabs, sid = staged
        return tabs[0], tabs[1], tabs[2], sid
    le = cache.layers[layer]
    return le.gate.table, le.up.table, le.down.table, ids


_GROUPED_FAILED: set[tuple[QT, QT, int, int]] = set()


def _is_build_error(e: Exception) -> bool:
    try:
        from triton.compiler.errors import CompilationError  # lazy: Triton is optional (CPU-only installs)
        from triton.runtime.errors import OutOfResources  # lazy: as above
    except ImportError:
        return False
    return isinstance(e, CompilationError | OutOfResources)


def grouped_experts(
    x: torch.Tensor,
    le: "LayerExperts",
    w: torch.Tensor,
    ids: torch.Tensor,
    k: int,
    act: str,
    tables: Callable[[], Tables] | None = None,
) -> torch.Tensor | None:
    """A prompt chunk's routed experts (x [T, D], weights and ids [T, k]) as grouped launches on CUDA -> float32
    [T, D]; None where the block types have no tile kernel or the kernel cannot be built here (said once).
    `tables` gives the gate, up and down address tables to read (the cache's prompt_tables: experts in host
    memory streamed into VRAM first); without it the layer's own."""
    g, u, dn = le.gate.host, le.up.host, le.down.host
    d, f = x.shape[1], g.shape[1]
    key = (g.qtype, dn.qtype, d, f)
    if not x.is_cuda or key in _GROUPED_FAILED or not grouped_available(g.qtype, u.qtype, dn.qtype, d, f):
        return None
    try:
        tabs = tables() if tables is not None else (le.gate.table, le.up.table, le.down.table)
        return _grouped(x, le, w, ids, k, act, tabs)
    except Exception as e:  # a kernel this GPU or Triton cannot build: the per-expert path
        if not _is_build_error(e):
            raise
        _GROUPED_FAILED.add(key)
        log.warning("grouped expert kernel unavailable for %s/%s experts (%s): experts run one by one",
                    g.qtype.name, dn.qtype.name, str(e).splitlines()[0][:160])  # fmt: skip
        return None


def _grouped(
    x: torch.Tensor, le: "LayerExperts", w: torch.Tensor, ids: torch.Tensor, k: int, act: str, tabs: Tables
) -> torch.Tensor:
    """All the chunk's routed experts as two grouped launches (gate/up with the activation, down), then the
    weighted combine."""
    mg = kernels.moe_gemm
    Blocks, block_table, expert_order, moe_gemm = mg.Blocks, mg.block_table, mg.expert_order, mg.moe_gemm
    g, dn = le.gate.host, le.down.host
    t, d = x.shape
    f = g.shape[1]
    blocks = Blocks(ids, le.router.shape[0], block_table, expert_order)
    s = t * k
    h = moe_gemm(blocks, tabs[0], g.qtype, g.raw.shape[-1], x, f, d, k, s, up_table=tabs[1], act=act,
                 out_dtype=x.dtype)  # fmt: skip
    y = moe_gemm(blocks, tabs[2], dn.qtype, dn.raw.shape[-1], h, d, f, k, s, x_per_slot=True)  # [S, D]
    # the weighted sum as a batched product: no [T, k, D] temporary (268 MB for a 4,096-token chunk of Qwen3-30B,
    # which took the reserved peak past a small card's budget)
    return torch.bmm(w.float().unsqueeze(1), y.view(t, k, d)).squeeze(1)


def grouped_available(gate: QT, up: QT, down: QT, d: int, f: int) -> bool:
    """Whether prompt chunks of such experts have the grouped tile kernels."""
    return _both(kernels.loaded("moe_gemm"), gate, up, down, d, f)


def fused_moe_available(gate: QT, up: QT, down: QT, d: int, f: int) -> bool:
    """Whether decode steps of such experts avoid host synchronisation (and can be captured in a CUDA graph)."""
    return _both(kernels.loaded("gemv"), gate, up, down, d, f)


def _both(module: object, gate: QT, up: QT, down: QT, d: int, f: int) -> bool:
    """The kernels of `module` (None: no Triton) take gate/up rows of d and down rows of f elements."""
    if module is None:
        return False
    supports = module.supports  # type: ignore[attr-defined]
    return gate == up and supports(gate, d) and supports(down, f)

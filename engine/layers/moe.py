"""The MoE block: router -> top-k -> selected experts -> weighted combine.

`moe_forward` touches only the experts a token selected (their blocks are dequantized tile by tile);
`moe_reference` is the plain dense einsum over every expert that the tests check it against."""

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as QT

from engine.kernels import int8_activations
from engine.layers.qtensor import QTensor

if TYPE_CHECKING:
    from engine.experts.cache import ExpertCache, LayerExperts

log = logging.getLogger("strata.engine")

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


@dataclass
class ExpertWeights:
    router: QTensor  # [E, D]
    gate: QTensor  # [E, F, D]
    up: QTensor  # [E, F, D]
    down: QTensor  # [E, D, F]
    # On the CPU: the in-place Q4_K kernels for decode (engine/experts/cpu_q4k.py), made on first use; False where
    # the block types or the CPU do not allow them.
    cpu_kernels: object = field(default=None, repr=False, compare=False)


def route(x: torch.Tensor, router: QTensor, k: int, norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, D] -> weights [T, k] (float32), expert ids [T, k]. Softmax over all experts, then top-k.
    The router runs in float32 whatever the compute type: a bf16 router flips near-tied expert choices."""
    probs = torch.softmax(router.linear(x.float()), dim=-1)  # [T, E]
    w, ids = torch.topk(probs, k, dim=-1)  # [T, k]
    if norm:
        w = w / w.sum(dim=-1, keepdim=True)
    return w, ids


def moe_forward(
    x: torch.Tensor,
    ew: ExpertWeights,
    k: int,
    norm: bool,
    act: str = "silu",
    counts: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [T, D] -> [T, D]. `counts` [E] (optional) accumulates how often each expert was selected."""
    w, ids = route(x, ew.router, k, norm)
    _count(counts, ids)
    if x.device.type == "cpu" and x.shape[0] <= _IN_PLACE_MAX_ROWS and int8_activations():
        kernels = _cpu_kernels(ew, act)
        if kernels is not None:  # a token's experts straight from their blocks, one call a token
            out = torch.empty(x.shape, dtype=torch.float32)
            xs, wf = x.float().contiguous(), w.float().contiguous()
            for t in range(x.shape[0]):
                kernels.mix(ids[t].numpy(), wf[t].numpy(), xs[t].numpy(), out[t].numpy())
            return out
    return _per_expert(x, w, ids, lambda e: ew.gate[e], lambda e: ew.up[e], lambda e: ew.down[e], act)


_IN_PLACE_MAX_ROWS = 4  # decode on the CPU; longer prompt chunks go expert by expert over all their tokens


def _cpu_kernels(ew: ExpertWeights, act: str):  # -> cpu_q4k.Q4KExperts | None
    if ew.cpu_kernels is None:
        from engine.experts.cpu_experts import CpuExperts

        on_cpu = ew.gate.raw.device.type == "cpu"
        ew.cpu_kernels = (on_cpu and CpuExperts.in_place_kernels(ew.gate, ew.up, ew.down, act)) or False
    return ew.cpu_kernels or None


def route_and_count(
    x: torch.Tensor, router: QTensor, k: int, norm: bool, counts: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`route`, and one count per selection into `counts` [E]: one fused kernel on CUDA."""
    if x.is_cuda:
        try:
            from engine.kernels.fused import route as fused_route
        except ImportError:
            fused_route = None
        if fused_route is not None:
            return fused_route(router.linear(x.float()), k, norm, counts)
    w, ids = route(x, router, k, norm)
    _count(counts, ids)
    return w, ids


def _count(counts: torch.Tensor | None, ids: torch.Tensor) -> None:
    if counts is not None:  # index_add_ rather than bincount: no host sync, capturable
        flat = ids.flatten()
        counts.index_add_(0, flat, torch.ones_like(flat, dtype=counts.dtype))


def _per_expert(
    x: torch.Tensor,
    w: torch.Tensor,
    ids: torch.Tensor,
    gate: Callable[[int], QTensor],
    up: Callable[[int], QTensor],
    down: Callable[[int], QTensor],
    act: str,
) -> torch.Tensor:
    """Each selected expert on the tokens that chose it (reads the ids on the host: prompt chunks, the CPU)."""
    fn = ACTIVATIONS[act]
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)  # [T, D]
    for e in torch.unique(ids).tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        xe = x.index_select(0, tok)  # [n, D]
        h = fn(gate(e).linear(xe)) * up(e).linear(xe)  # [n, F]
        y = down(e).linear(h).float()  # [n, D]
        out.index_add_(0, tok, y * w[tok, slot].unsqueeze(-1))
    return out  # float32: it joins the float32 residual stream


def moe_forward_cached(
    x: torch.Tensor,
    cache: "ExpertCache",
    layer: int,
    k: int,
    norm: bool,
    act: str = "silu",
    counts: torch.Tensor | None = None,
) -> torch.Tensor:
    """The MoE block with the experts of an `ExpertCache` (CUDA). Decode-sized inputs run two fused kernels that
    read each selected expert wherever the cache's table says it is; prompt chunks run grouped matrix multiplies on
    tensor cores through the same tables (block types without a tile kernel: expert by expert)."""
    le = cache.layers[layer]
    w, ids = route_and_count(x, le.router, k, norm, counts)  # [T, k]
    t, d = x.shape
    g, u, dn = le.gate.host, le.up.host, le.down.host
    f = g.shape[1]
    if t <= _FUSED_MAX_ROWS and _fused_ok(g.qtype, u.qtype, dn.qtype, d, f):
        from engine.kernels.gemv import moe_gemv

        gt, ut, dt, sid = expert_tables(cache, layer, ids)
        h = moe_gemv(gt, g.qtype, g.raw.shape[-1], sid, x, f, d, k, up_table=ut, act=act)
        y = moe_gemv(dt, dn.qtype, dn.raw.shape[-1], sid, h, d, f, k, x_per_slot=True)  # [T*k, D]
        return (y.view(t, k, d) * w.unsqueeze(-1)).sum(dim=1)
    grouped = grouped_experts(x, le, w, ids, k, act, lambda: cache.prompt_tables(layer))  # a prompt chunk
    if grouped is not None:
        return grouped
    experts: dict[int, ExpertWeights] = {}

    def get(e: int) -> ExpertWeights:
        if e not in experts:
            experts[e] = le.expert(e, x.device)
        return experts[e]

    return _per_expert(x, w, ids, lambda e: get(e).gate, lambda e: get(e).up, lambda e: get(e).down, act)


_FUSED_MAX_ROWS = 8


def expert_tables(
    cache: "ExpertCache", layer: int, ids: torch.Tensor, claim: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gate, up and down address tables a decode step's expert kernels read, and the ids to read them with:
    the cache's own tables and the experts' ids, or (with `--expert-misses copy`) per-slot tables with the missed
    experts staged in VRAM, read with the identity. `claim` [k]: slots the CPU computes (not staged)."""
    staged = cache.staged_tables(layer, ids, claim)
    if staged is not None:
        assert cache.stager is not None
        return staged[0], staged[1], staged[2], cache.stager.identity
    le = cache.layers[layer]
    return le.gate.table, le.up.table, le.down.table, ids


_GROUPED_FAILED: set[tuple[QT, QT, int, int]] = set()


def _is_build_error(e: Exception) -> bool:
    try:
        from triton.compiler.errors import CompilationError
        from triton.runtime.errors import OutOfResources
    except ImportError:
        return False
    return isinstance(e, CompilationError | OutOfResources)


Tables = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


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
    if not x.is_cuda or key in _GROUPED_FAILED or not _grouped_ok(g.qtype, u.qtype, dn.qtype, d, f):
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
    from engine.kernels.moe_gemm import Blocks, block_table, expert_order, moe_gemm

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


def _grouped_ok(gate: QT, up: QT, down: QT, d: int, f: int) -> bool:
    try:
        from engine.kernels.moe_gemm import supports
    except ImportError:
        return False
    return gate == up and supports(gate, d) and supports(down, f)


def _fused_ok(gate: QT, up: QT, down: QT, d: int, f: int) -> bool:
    try:
        from engine.kernels.gemv import supports
    except ImportError:
        return False
    return gate == up and supports(gate, d) and supports(down, f)


def fused_moe_available(gate: QT, up: QT, down: QT, d: int, f: int) -> bool:
    """Whether decode steps of such experts avoid host synchronisation (and can be captured in a CUDA graph)."""
    return _fused_ok(gate, up, down, d, f)


def moe_reference(x: torch.Tensor, ew: ExpertWeights, k: int, norm: bool, act: str = "silu") -> torch.Tensor:
    """Every expert on every token, then the routing weights as a dense [T, E] matrix: the plain einsum form."""
    fn = ACTIVATIONS[act]
    xf = x.float()
    w, ids = route(xf, ew.router, k, norm)
    dense_w = torch.zeros(x.shape[0], ew.gate.shape[0]).scatter(1, ids, w)  # [T, E]
    g, u, d = ew.gate.dequant(), ew.up.dequant(), ew.down.dequant()  # [E, F, D], [E, F, D], [E, D, F]
    h = fn(torch.einsum("td,efd->tef", xf, g)) * torch.einsum("td,efd->tef", xf, u)  # [T, E, F]
    y = torch.einsum("tef,edf->ted", h, d)  # [T, E, D]
    return torch.einsum("ted,te->td", y, dense_w)

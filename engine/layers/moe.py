"""The MoE block: router -> dispatch -> experts -> combine.

Routing is the family's (softmax top-k: `route`; DeepSeek and GLM's grouped sigmoid scores: family_base's
`grouped_route`; gpt-oss's router bias), so a block takes the routing result. What each selected expert computes is
`ExpertMath` (a gated activation, optional per-expert biases); where its blocks are read and how is an `Experts`
backend, chosen once when the model is loaded (engine.experts.backends.choose):

- `HostExperts` (here): the layer's experts in one block tensor on the compute device, each selected expert on the
  tokens that chose it;
- engine.experts.backends: `CachedExperts` (CUDA: an expert cache's slots and host RAM; fused kernels for decode-sized
  inputs, grouped tile kernels for prompt chunks) and `CpuInPlaceExperts` (decode on the CPU straight from the Q4_K
  blocks with 8-bit activations).

Every backend is tested against `reference`: a float64 einsum over all the dequantized experts."""

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from engine import kernels
from engine.layers.qtensor import QTensor

log = logging.getLogger("strata.engine")

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
}

# (gate [N, F], up [N, F]) -> hidden [N, F]: the gated activation of an FFN or expert
Glu = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def silu_glu(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    return F.silu(g) * u


@dataclass
class ExpertWeights:
    router: QTensor  # [E, D]
    gate: QTensor  # [E, F, D]
    up: QTensor  # [E, F, D]
    down: QTensor  # [E, D, F]

    def expert(self, e: int) -> "ExpertWeights":
        return ExpertWeights(self.router, self.gate[e], self.up[e], self.down[e])


@dataclass
class ExpertBiases:
    """Per-expert biases of the projections (gpt-oss), float32 on the compute device."""

    gate: torch.Tensor  # [E, F]
    up: torch.Tensor  # [E, F]
    down: torch.Tensor  # [E, D]


@dataclass(frozen=True)
class ExpertMath:
    """What one expert computes: down(glu(gate x + b_g, up x + b_u)) + b_d. `act` names the activation when `glu`
    is act(gate) * up, which the fused kernels (and the CPU's in-place ones) have built in; None where it is a
    family's own (gpt-oss's clamped SwiGLU)."""

    glu: Glu = silu_glu
    biases: ExpertBiases | None = None
    act: str | None = "silu"

    @classmethod
    def gated(cls, act: str) -> "ExpertMath":
        if act == "silu":
            return cls()
        fn = ACTIVATIONS[act]
        return cls(glu=lambda g, u: fn(g) * u, act=act)

    @property
    def plain(self) -> bool:
        """act(gate) * up with no biases: what the built-in kernels compute."""
        return self.biases is None and self.act is not None


class Experts(Protocol):
    """A layer's routed experts where one backend reads them."""

    def mix(self, x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [T, D], routing weights w [T, k] and expert ids [T, k] -> sum over k of w * expert(x), float32 [T, D]
        (it joins the float32 residual stream)."""
        ...


class RouteTrace:
    """The experts each softmax top-k routing call chose, in call order: recorded from one run, then replayed in
    place of the router's choice in another, the weights staying the router's own for the replayed experts.
    For tests and benches: two runs that differ only in arithmetic (bf16 against float32) compare their arithmetic,
    not a near-tied expert choice that rounding decided the other way."""

    def __init__(self, ids: list[torch.Tensor] | None = None) -> None:
        self.replaying = ids is not None
        self.ids: list[torch.Tensor] = [] if ids is None else list(ids)
        self.used = 0

    def choose(self, probs: torch.Tensor, k: int) -> torch.Tensor:
        """probs [T, E] -> expert ids [T, k]: the recorded ones when replaying (each call takes the next)."""
        if not self.replaying:
            ids = torch.topk(probs, k, dim=-1).indices
            self.ids.append(ids.cpu())
            return ids
        if self.used >= len(self.ids):
            raise RuntimeError(
                f"the routing trace holds {len(self.ids)} calls; this run routed more: replay the same inputs"
            )
        ids = self.ids[self.used]
        if tuple(ids.shape) != (probs.shape[0], k):
            raise ValueError(
                f"routing call {self.used} of the trace chose {tuple(ids.shape)} experts, this run asks for "
                f"{(probs.shape[0], k)}: replay the same inputs on the same model"
            )
        self.used += 1
        return ids.to(probs.device)


_trace: RouteTrace | None = None


@contextmanager
def route_trace(trace: RouteTrace) -> Iterator[RouteTrace]:
    """Record into, or replay, `trace` for the softmax top-k routing calls made inside the block (eager ones: a
    captured CUDA graph keeps the choices it was captured with)."""
    global _trace
    before, _trace = _trace, trace
    try:
        yield trace
    finally:
        _trace = before


def route(x: torch.Tensor, router: QTensor, k: int, norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, D] -> weights [T, k] (float32), expert ids [T, k]. Softmax over all experts, then top-k.
    The router runs in float32 whatever the compute type: a bf16 router flips near-tied expert choices."""
    probs = torch.softmax(router.linear(x.float()), dim=-1)  # [T, E]
    if _trace is None:
        w, ids = torch.topk(probs, k, dim=-1)  # [T, k]
    else:
        ids = _trace.choose(probs, k)
        w = probs.gather(-1, ids)
    if norm:
        w = w / w.sum(dim=-1, keepdim=True)
    return w, ids


def route_and_count(
    x: torch.Tensor, router: QTensor, k: int, norm: bool, counts: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`route`, and one count per selection into `counts` [E]: one fused kernel on CUDA (not while a routing
    trace records or replays)."""
    if x.is_cuda and _trace is None:
        fused = kernels.loaded("fused")
        if fused is not None:
            return fused.route(router.linear(x.float()), k, norm, counts)
    w, ids = route(x, router, k, norm)
    count_experts(counts, ids)
    return w, ids


def count_experts(counts: torch.Tensor | None, ids: torch.Tensor, rows: torch.Tensor | None = None) -> None:
    """Add a step's selections to the usage counts [E] (index_add_ rather than bincount: no host sync,
    capturable). `rows` (a device int64 [1]): only the first rows[0] rows of ids count (the others pad a prompt
    chunk up to a captured size)."""
    if counts is None:
        return
    flat = ids.flatten()
    if rows is None:
        counts.index_add_(0, flat, torch.ones_like(flat, dtype=counts.dtype))
        return
    real = torch.arange(ids.shape[0], device=ids.device) < rows  # [T]
    counts.index_add_(0, flat, real.unsqueeze(1).expand_as(ids).reshape(-1).to(counts.dtype))


def per_expert(
    x: torch.Tensor,
    w: torch.Tensor,
    ids: torch.Tensor,
    get: Callable[[int], ExpertWeights],
    math: ExpertMath,
) -> torch.Tensor:
    """Each selected expert on the tokens that chose it (reads the ids on the host: prompt chunks, the CPU, and
    what the kernels do not cover). `get(e)` gives expert e's weights on the compute device."""
    b = math.biases
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)  # [T, D]
    for e in torch.unique(ids).tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        xe = x.index_select(0, tok)  # [n, D]
        ex = get(e)
        hg, hu = ex.gate.linear(xe), ex.up.linear(xe)  # [n, F]
        if b is not None:
            hg, hu = hg + b.gate[e].to(hg.dtype), hu + b.up[e].to(hu.dtype)
        y = ex.down.linear(math.glu(hg, hu).to(xe.dtype)).float()  # [n, D]
        if b is not None:
            y = y + b.down[e]
        out.index_add_(0, tok, y * w[tok, slot].unsqueeze(-1))
    return out


class HostExperts:
    """All of a layer's experts in one block tensor on the compute device (the CPU, or CUDA without an expert
    cache): each selected expert dequantized tile by tile on the tokens that chose it."""

    def __init__(self, ew: ExpertWeights, math: ExpertMath) -> None:
        self.ew, self.math = ew, math

    def mix(self, x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return per_expert(x, w, ids, self.ew.expert, self.math)


def reference(
    x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor, ew: ExpertWeights, math: ExpertMath = ExpertMath()
) -> torch.Tensor:
    """The plain form every backend is checked against, in float64: every expert on every token (dequantized
    whole), then the routing weights as a dense [T, E] matrix. -> float64 [T, D]"""
    xf = x.double()
    n_e = ew.gate.shape[0]
    dense_w = torch.zeros(x.shape[0], n_e, dtype=torch.float64).scatter(
        1, ids.cpu(), w.double().cpu()
    )  # [T, E]
    g, u, d = (
        q.dequant().double().cpu() for q in (ew.gate, ew.up, ew.down)
    )  # [E, F, D], [E, F, D], [E, D, F]
    hg = torch.einsum("td,efd->tef", xf.cpu(), g)  # [T, E, F]
    hu = torch.einsum("td,efd->tef", xf.cpu(), u)
    b = math.biases
    if b is not None:
        hg, hu = hg + b.gate.double().cpu(), hu + b.up.double().cpu()
    y = torch.einsum("tef,edf->ted", math.glu(hg, hu), d)  # [T, E, D]
    if b is not None:
        y = y + b.down.double().cpu()
    return torch.einsum("ted,te->td", y, dense_w)

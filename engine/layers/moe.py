"""The MoE block: router -> top-k -> selected experts -> weighted combine.

`moe_forward` touches only the experts a token selected (their blocks are dequantized tile by tile);
`moe_reference` is the plain dense einsum over every expert that the tests check it against."""

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.layers.qtensor import QTensor

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
    fn = ACTIVATIONS[act]
    w, ids = route(x, ew.router, k, norm)
    if counts is not None:
        counts += torch.bincount(ids.flatten(), minlength=counts.numel()).to(counts.device, counts.dtype)
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)  # [T, D]
    for e in torch.unique(ids).tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        xe = x.index_select(0, tok)  # [n, D]
        h = fn(ew.gate[e].linear(xe)) * ew.up[e].linear(xe)  # [n, F]
        y = ew.down[e].linear(h).float()  # [n, D]
        out.index_add_(0, tok, y * w[tok, slot].unsqueeze(-1))
    return out  # float32: it joins the float32 residual stream


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

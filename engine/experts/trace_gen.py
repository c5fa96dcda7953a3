"""Routing traces made to match what real text's routing is measured to look like, from uniform to strongly local.

Each layer has its own popularity over the experts: a Zipf law of exponent `skew` over a random order (0: uniform).
Each token's k experts are drawn one by one: with probability `reuse` from the experts an earlier token chose in this
layer, that token `1 + Geometric(1 / depth)` tokens back (recency), otherwise from the layer's popularity; never
twice in one token. Weights are a sorted Dirichlet(1) draw (a softmax top-k's look: one large, a tail).

Calibration (written down in docs/performance.md, checked by tests/engine/test_routing_trace.py) against published
figures of real routing for Qwen3-30B-A3B-class models (128 experts, top-8):
- 90% of the routing mass needs 45-51% of the experts (aggregate: close to uniform);
- an LRU of 12.5-25% of the experts per layer hits 67-81% (llama.cpp PR #27861 on a 512-expert model, real mixed
  workload; 88.7% reported by kekzl/imp on Qwen3-30B-A3B with a synthetic prompt).
PRESETS["realistic"] reproduces both; "uniform" is what a model with random weights does today; "local" is
strongly local, for the sweep."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from engine.experts.trace import RoutingTrace


@dataclass(frozen=True)
class TraceParams:
    skew: float = 0.0  # Zipf exponent of each layer's popularity (0: every expert alike)
    reuse: float = 0.0  # probability a choice repeats an earlier token's expert
    depth: float = 1.0  # mean distance, in tokens, of the earlier token a choice repeats


PRESETS: dict[str, TraceParams] = {
    "uniform": TraceParams(),
    "realistic": TraceParams(skew=1.3, reuse=0.4, depth=1.5),
    "local": TraceParams(skew=1.3, reuse=0.85, depth=1.5),
}


def generate(
    tokens: int, layers: int, n_expert: int, k: int, params: TraceParams, seed: int = 0, streams: int = 1
) -> RoutingTrace:
    """A trace of `tokens` tokens for `layers` MoE layers routing to k of n_expert experts. With `streams` S > 1 it
    interleaves S conversations token by token (token i is conversation i % S's token i // S), each with its own
    recency and all with the layers' one popularity: a step of S slots' decode rows, which replays S consecutive
    trace tokens, then routes as S separate conversations do, not as one conversation's neighbouring tokens."""
    if not 0 < k <= n_expert:
        raise ValueError(f"k = {k} must be 1..n_expert ({n_expert})")
    if not 0.0 <= params.reuse <= 1.0 or params.depth < 1.0 or params.skew < 0.0:
        raise ValueError(f"{params}: reuse is a probability, depth >= 1, skew >= 0")
    if not 1 <= streams <= max(tokens, 1):
        raise ValueError(f"streams = {streams} must be 1..tokens ({tokens})")
    rng = np.random.default_rng(seed)
    ids = np.empty((tokens, layers, k), dtype=np.int16)
    ranks = np.arange(1, n_expert + 1, dtype=np.float64)
    zipf = ranks**-params.skew
    zipf /= zipf.sum()
    for li in range(layers):
        pop = np.empty(n_expert)
        pop[rng.permutation(n_expert)] = zipf
        for s in range(streams):
            ids[s::streams, li] = _column(rng, pop, len(range(s, tokens, streams)), k, params)
    w = np.sort(rng.dirichlet(np.ones(k), size=(tokens, layers)), axis=-1)[..., ::-1].astype(np.float32)
    meta = {"source": "generated", "params": asdict(params), "seed": seed}
    if streams > 1:
        meta["streams"] = streams
    return RoutingTrace(ids, np.ascontiguousarray(w), list(range(layers)), n_expert, meta)


def _column(
    rng: np.random.Generator, pop: np.ndarray, tokens: int, k: int, params: TraceParams
) -> np.ndarray:
    """One conversation's choices [tokens, k] in one layer of popularity `pop`."""
    n_expert = pop.shape[0]
    col = np.empty((tokens, k), dtype=np.int16)
    draws = rng.choice(n_expert, size=(tokens, 4 * k), p=pop)  # popularity draws, spares for repeats
    reuse = rng.random((tokens, k)) < params.reuse
    back = rng.geometric(1.0 / params.depth, size=(tokens, k))
    pick = rng.integers(0, k, size=(tokens, k))
    for t in range(tokens):
        chosen: list[int] = []
        d = 0
        for j in range(k):
            e = -1
            if reuse[t, j] and t > 0:
                e = int(col[max(t - int(back[t, j]), 0), pick[t, j]])
                if e in chosen:
                    e = -1
            while e < 0 or e in chosen:
                if d < draws.shape[1]:
                    e = int(draws[t, d])
                    d += 1
                else:
                    e = int(rng.choice(n_expert, p=pop))
            chosen.append(e)
        col[t] = chosen
    return col


def trace_spec(name: str) -> tuple[TraceParams, int]:
    """A preset's name, or NAME-xS for S interleaved conversations (generate's `streams`: "realistic-x8", the
    routing of 8 slots' decode rows) -> (its parameters, S)."""
    base, sep, n = name.rpartition("-x")
    if sep and n.isdigit() and int(n) >= 1:
        return preset(base), int(n)
    return preset(name), 1


def preset(name: str) -> TraceParams:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(
            f"trace preset {name!r}: use one of {', '.join(PRESETS)} (NAME-xS: S interleaved conversations)"
        ) from None

"""Routing traces: which experts each token chose in each MoE layer, with their weights, as a file.

A trace is recorded from a model a user runs (`strata-engine profile --trace FILE`), or made by
engine/experts/trace_gen.py to match published statistics of real routing. Replayed in place of the router's choice
(`STRATA_ROUTE_TRACE=FILE`, for benchmarks and tests) it makes a model with random weights route like a real one, so the
expert cache is measured on realistic locality; everything else the step computes stays the same.

The file is a NumPy .npz archive (read with allow_pickle=False: no code runs on load):
  ids      int16   [N, L, k]  expert of each (token, MoE layer, choice)
  weights  float32 [N, L, k]  routing weight of each choice (as the router gave it, renormalised where it does)
  layers   int32   [L]        the model layer index of each column
  meta     uint8   [bytes]    UTF-8 JSON: {"format", "version", "n_expert", "source", ...}
Tokens are in the order the model read them: each prompt's tokens, then each decoded token."""

from __future__ import annotations

import json
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

FORMAT = "polystrata-routing-trace"
VERSION = 1
MAX_FILE_BYTES = 4 << 30  # a 1M-token trace of 48 layers x 8 choices is ~2.3 GB uncompressed


class TraceError(ValueError):
    """Why a trace file cannot be used."""


@dataclass
class RoutingTrace:
    ids: np.ndarray  # int16 [N, L, k]
    weights: np.ndarray  # float32 [N, L, k]
    layers: list[int]  # model layer index of each column
    n_expert: int
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check(self)

    @property
    def tokens(self) -> int:
        return int(self.ids.shape[0])

    @property
    def k(self) -> int:
        return int(self.ids.shape[2])


def check(t: RoutingTrace) -> None:
    if t.ids.ndim != 3:
        raise TraceError(f"ids has shape {t.ids.shape}; a trace's ids are [tokens, layers, k]")
    if t.weights.shape != t.ids.shape:
        raise TraceError(f"weights {t.weights.shape} and ids {t.ids.shape} differ in shape")
    if len(t.layers) != t.ids.shape[1]:
        raise TraceError(f"{len(t.layers)} layer indices for {t.ids.shape[1]} columns of ids")
    if len(set(t.layers)) != len(t.layers) or any(li < 0 for li in t.layers):
        raise TraceError(f"the layer indices {t.layers} repeat or are negative")
    if not 0 < t.n_expert <= 1 << 15:
        raise TraceError(f"n_expert {t.n_expert} is outside 1..32768")
    if t.ids.size and (int(t.ids.min()) < 0 or int(t.ids.max()) >= t.n_expert):
        raise TraceError(f"expert ids outside 0..{t.n_expert - 1}")
    if t.ids.size and not np.isfinite(t.weights).all():
        raise TraceError("the weights hold NaN or infinity")


def save_trace(path: str | Path, t: RoutingTrace) -> Path:
    """Write `t` to `path` (.npz; written to a temporary name, then renamed)."""
    path = Path(path)
    meta = dict(t.meta, format=FORMAT, version=VERSION, n_expert=t.n_expert)
    tmp = path.with_name(path.name + ".part")
    with open(tmp, "wb") as f:
        np.savez_compressed(
            f,
            ids=t.ids.astype(np.int16),
            weights=t.weights.astype(np.float32),
            layers=np.asarray(t.layers, dtype=np.int32),
            meta=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8),
        )
    tmp.replace(path)
    return path


def load_trace(path: str | Path) -> RoutingTrace:
    """Read a trace file; a file that is not one, or not a valid one, raises TraceError saying what is wrong."""
    path = Path(path)
    try:
        size = path.stat().st_size
    except OSError as e:
        raise TraceError(f"cannot read the routing trace {path}: {e.strerror or e}") from None
    if size > MAX_FILE_BYTES:
        raise TraceError(
            f"{path} is {size >> 20} MiB, more than a routing trace can be ({MAX_FILE_BYTES >> 20})"
        )
    try:
        with np.load(path, allow_pickle=False) as z:
            missing = {"ids", "weights", "layers", "meta"} - set(z.files)
            if missing:
                raise TraceError(f"{path} is not a routing trace: it lacks {', '.join(sorted(missing))}")
            for name in ("ids", "weights"):  # refuse before inflating: the header says the shapes
                if z[name].nbytes > MAX_FILE_BYTES * 4:
                    raise TraceError(f"{path}: {name} would take {z[name].nbytes >> 20} MiB")
            ids, weights, layers = z["ids"], z["weights"], z["layers"]
            meta = json.loads(bytes(z["meta"].astype(np.uint8)).decode())
    except (OSError, ValueError, zipfile.BadZipFile, UnicodeDecodeError) as e:
        if isinstance(e, TraceError):
            raise
        raise TraceError(f"{path} is not a readable routing trace ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise TraceError(
            f"{path} is not a routing trace (format {meta.get('format') if isinstance(meta, dict) else meta!r})"
        )
    if meta.get("version") != VERSION:
        raise TraceError(
            f"{path} is a version {meta.get('version')} routing trace; this engine reads version {VERSION}"
        )
    n_expert = meta.get("n_expert")
    if not isinstance(n_expert, int):
        raise TraceError(f"{path}: n_expert is {n_expert!r}")
    if not (np.issubdtype(ids.dtype, np.integer) and np.issubdtype(weights.dtype, np.floating)):
        raise TraceError(
            f"{path}: ids are {ids.dtype} and weights {weights.dtype}; integers and floats expected"
        )
    return RoutingTrace(
        ids.astype(np.int16), weights.astype(np.float32), [int(x) for x in layers], n_expert, meta
    )


def for_model(t: RoutingTrace, moe_layers: list[int], n_expert: int, k: int) -> RoutingTrace:
    """`t` checked against a model's MoE layers, expert count and top-k; a generated trace (made for a layer
    count, not a file) takes the model's layer indices in order."""
    if t.n_expert != n_expert or t.k != k:
        raise TraceError(
            f"the trace routes to {t.k} of {t.n_expert} experts; this model to {k} of {n_expert}: "
            "record or generate one for this model"
        )
    if t.layers == moe_layers:
        return t
    if len(t.layers) == len(moe_layers) and t.meta.get("source") == "generated":
        return RoutingTrace(t.ids, t.weights, list(moe_layers), t.n_expert, t.meta)
    missing = sorted(set(moe_layers) - set(t.layers))
    if missing:
        raise TraceError(f"the trace has no routing for MoE layers {missing[:8]}: record it from this model")
    cols = [t.layers.index(li) for li in moe_layers]
    return RoutingTrace(t.ids[:, cols], t.weights[:, cols], list(moe_layers), t.n_expert, t.meta)


def usage_counts(t: RoutingTrace, n_layer: int, start: int = 0) -> np.ndarray:
    """Selection counts [n_layer, n_expert] of the trace's tokens from `start` on: a usage profile's counts (a
    recorded trace names its layers; a generated one is laid on the last layers, where MoE layers are)."""
    layers = t.layers if t.meta.get("source") == "recorded" else range(n_layer - len(t.layers), n_layer)
    counts = np.zeros((n_layer, t.n_expert), np.int64)
    for j, li in enumerate(layers):
        counts[li] = np.bincount(t.ids[start:, j].ravel().astype(np.int64), minlength=t.n_expert)
    return counts


# ---------------------------------------------------------------------------------------------------------------
# What a trace says about caching (pure functions: the generator's calibration and the benches use them)


def coverage(ids: np.ndarray, n_expert: int, mass: float = 0.9) -> float:
    """Fraction of the experts that cover `mass` of a layer's selections (ids [N, k]), hottest first."""
    counts = np.sort(np.bincount(ids.reshape(-1).astype(np.int64), minlength=n_expert))[::-1]
    total = counts.sum()
    if total == 0:
        return 0.0
    need = int(np.searchsorted(np.cumsum(counts), mass * total) + 1)
    return min(need, n_expert) / n_expert


POLICIES = ("lru", "lfu", "static")


def hit_rate(
    ids: np.ndarray, capacity: int, policy: str = "lru", decay: float = 0.9, start: list[int] | None = None
) -> float:
    """Hits / selections of a cache of `capacity` experts on one layer's choices ids [N, k], each token's experts
    admitted on a miss: "lru" evicts the least recently used, "lfu" the lowest decayed use count (each token
    multiplies every count by `decay`), "static" keeps the `capacity` experts the whole trace uses most (an
    oracle of the profile fill). `start`: the experts resident before the first token (the profile's fill; none
    by default). The device kernels follow the same rules (engine/kernels/expert_lru.py)."""
    n = ids.shape[0]
    if n == 0 or capacity <= 0:
        return 0.0
    flat = ids.astype(np.int64)
    if policy == "static":
        top = np.argsort(-np.bincount(flat.reshape(-1)), kind="stable")[:capacity]
        return float(np.isin(flat, top).mean())
    if policy not in POLICIES:
        raise ValueError(f"policy {policy!r}: use one of {', '.join(POLICIES)}")
    n_e = max(int(flat.max()), *(start or [0])) + 1
    stamp = np.full(n_e, -np.inf)  # lru: last step used; lfu: decayed count
    resident = np.zeros(n_e, dtype=bool)
    for e in start or []:
        resident[e], stamp[e] = True, -1.0
    held = len(start or [])
    hits = 0
    score = np.zeros(n_e)
    for t in range(n):
        row = flat[t]
        if policy == "lfu":
            score *= decay
        hit = resident[row]
        hits += int(hit.sum())
        if policy == "lru":
            stamp[row[hit]] = t
        else:
            score[row[hit]] += 1.0
        for e in dict.fromkeys(row[~hit].tolist()):  # an expert two rows of a step chose is admitted once
            if held < capacity:
                held += 1
            else:  # the victim: resident, not chosen at this step
                cand = np.flatnonzero(resident)
                key = stamp[cand] if policy == "lru" else score[cand]
                fresh = stamp[cand] == t if policy == "lru" else np.isin(cand, row)
                key = np.where(fresh, np.inf, key)
                v = cand[int(np.argmin(key))]
                if not np.isfinite(key.min()):
                    continue  # every slot serves this step: the miss is read, not admitted
                resident[v] = False
            resident[e] = True
            stamp[e] = t
            score[e] = 1.0
    return hits / flat.size

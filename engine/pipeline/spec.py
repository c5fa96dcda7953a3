"""Verify windows: decode with drafted tokens, checked by the model in one forward (seed 002, `--spec N`).

A window is the token decided last (not yet in the KV cache) followed by up to N drafted tokens; the model reads
them in one forward, so each stage runs (and, on a split, hands off) once per window instead of once per token.
Row j of the window's logits is the target's distribution after draft j-1; a draft is kept while the target
agrees with it, and the first disagreement gives the next token, so every window yields at least one token.
The KV cache is then cut back to the last kept token.

- Greedy: a draft is kept when it is the target's argmax; the tokens are the ones decoding without drafts gives.
- Sampling: standard speculative sampling. A draft d drawn from the draft distribution q is kept with probability
  min(1, p(d) / q(d)); on a rejection the token is drawn from the normalised residual max(0, p - q). The kept
  tokens then follow the target distribution p exactly. Drafts copied from earlier context are deterministic: q is
  a point mass, so d is kept with probability p(d) and the residual is p without d.

Draft sources: `SuffixDraft` (copies of earlier context: prompt lookup, `--suffix-draft`) and the model's own
draft (MTP / nextn) layer (`--mtp`, engine/pipeline/mtp.py); `DraftPicker` chooses between them per window.

`--pipeline-windows 2` on a layer split (`PipelinedStages`): while the last stage verifies window w, the front
stages already read window w+1 as guessed - every draft of w kept and the bonus token the draft chain predicts.
When the guess holds, the front's half of the next window is done; when it does not, its rows are dropped (their
KV positions lie beyond the kept length and are written again before anything reads them).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from engine.layers.kv_cache import KVCache
from engine.pipeline.cuda_graphs import SPAN_BUCKET, GraphTable, capturing
from engine.pipeline.drafts import NO_DRAFT, Draft, DraftSource
from engine.pipeline.mtp import DraftLayerSource, draft_layer_of
from engine.pipeline.sampling import Sampler
from engine.pipeline.stages import LocalStage

log = logging.getLogger("strata.engine")

MAX_SPEC = 32  # drafts per window; beyond this a window costs more than a rejection saves
MTP_CHOICES = ("auto", "1", "0")  # --mtp: the model's draft layer where it has one, required, off


class SpecError(ValueError):
    pass


@dataclass(frozen=True)
class SpecConfig:
    """The decode options: `--spec N`, `--suffix-draft`, `--mtp`, `--pipeline-windows`."""

    n: int = 0  # most drafted tokens per verify window (0: one token per forward, no drafts)
    suffix: bool = True  # drafts copied from earlier context
    draft_layer: bool = True  # the model's own draft layer, where it has one
    need_draft_layer: bool = False  # --mtp 1: a model without a draft layer is refused
    min_match: int = 2  # shortest suffix of the sequence that counts as seen before
    max_match: int = 16  # longest suffix compared (a longer one matches as well as this)
    strong_match: int = 4  # a suffix match this long is preferred to the draft layer's guess
    pipeline_windows: int = 0  # 2: the front stages read the guessed next window during the verification
    guess_threshold: float = 0.3  # start a guessed window when this share of recent windows was kept whole
    force_guess_miss: bool = False  # checks and debugging: every guessed window is dropped and read again

    def __post_init__(self) -> None:
        if not 0 <= self.n <= MAX_SPEC:
            raise SpecError(f"--spec {self.n}: give the drafted tokens per window, 0 (off) to {MAX_SPEC}")
        if self.pipeline_windows not in (0, 2):
            raise SpecError(
                f"--pipeline-windows {self.pipeline_windows}: use 0 (off) or 2 (the first stages read the next, "
                "guessed, window while the last verifies); 1 (short prompt reads through the windows) is not offered"
            )
        if self.need_draft_layer and (self.n == 0 or not self.draft_layer):
            raise SpecError(
                "--mtp 1 drafts with the model's draft layer in verify windows: give --spec N as well"
            )
        if not 1 <= self.min_match <= self.max_match:
            raise SpecError(f"suffix match lengths {self.min_match}..{self.max_match} are not a range")

    @property
    def drafting(self) -> bool:
        return self.n > 0 and (self.suffix or self.draft_layer)

    @classmethod
    def from_flags(cls, n: int, suffix: bool, mtp: str = "auto", pipeline_windows: int = 0) -> SpecConfig:
        """From the command line: `--spec N`, `--suffix-draft 1|0`, `--mtp auto|1|0`, `--pipeline-windows`."""
        if mtp not in MTP_CHOICES:
            raise SpecError(
                f"--mtp {mtp}: use auto (the model's draft layer where its file has one), 1 (required) or 0 (off)"
            )
        return cls(
            n=n,
            suffix=suffix,
            draft_layer=mtp != "0",
            need_draft_layer=mtp == "1",
            pipeline_windows=pipeline_windows,
        )


@dataclass
class SpecStats:
    """Counts of one request's decode."""

    windows: int = 0  # forwards of the decode
    proposed: int = 0  # drafted tokens the model verified
    accepted: int = 0  # of those, kept
    guesses: int = 0  # guessed windows started on the front stages (--pipeline-windows)
    guesses_kept: int = 0


# ---------------------------------------------------------------------------------------------------------------
# Draft sources


class SuffixDraft:
    """Drafts copied from earlier context (prompt lookup): find the longest suffix of the sequence, between
    `min_match` and `max_match` tokens, that occurred before (latest occurrence on a tie) and propose what
    followed it. A continuation that runs into the present repeats it, so a periodic text drafts whole periods.

    Every `min_match`-gram of the committed sequence is indexed by where it was followed, so a proposal compares
    only the few places its last tokens occurred."""

    CANDIDATES = 16  # latest occurrences compared per proposal

    def __init__(self, min_match: int = 2, max_match: int = 16) -> None:
        self.min_match = min_match
        self.max_match = max_match
        self.seq: list[int] = []
        self._index: dict[tuple[int, ...], list[int]] = {}

    def reset(self, tokens: Sequence[int]) -> None:
        self.seq = []
        self._index = {}
        self.commit(tokens)

    def commit(self, tokens: Sequence[int]) -> None:
        m, seq, index = self.min_match, self.seq, self._index
        for tok in tokens:
            i = len(seq)
            if i >= m:
                index.setdefault(tuple(seq[i - m : i]), []).append(
                    i
                )  # the m-gram before i was followed by seq[i]
            seq.append(int(tok))

    def propose(self, pending: Sequence[int], n: int) -> Draft:
        seq, m = self.seq, self.min_match
        pend = [int(t) for t in pending]
        total = len(seq) + len(pend)
        if n <= 0 or total < m:
            return NO_DRAFT

        def at(i: int) -> int:
            return seq[i] if i < len(seq) else pend[i - len(seq)]

        key = tuple(at(i) for i in range(total - m, total))
        found = self._index.get(key)
        if not found:
            return NO_DRAFT
        best, best_len = -1, 0
        for f in reversed(found[-self.CANDIDATES :]):
            j = m  # tokens f-j..f-1 equal the last j tokens
            while j < self.max_match and f - j - 1 >= 0 and at(f - j - 1) == at(total - j - 1):
                j += 1
            if j > best_len:
                best, best_len = f, j
            if j >= self.max_match:
                break
        out: list[int] = []
        for i in range(n):
            p = best + i
            out.append(at(p) if p < total else out[p - total])
        return Draft(out, None, best_len)


class DraftPicker:
    """The draft sources of one request, in the order of preference: a long match in earlier context, then the
    draft layer, then a shorter match."""

    def __init__(self, suffix: SuffixDraft | None, layer: DraftLayerSource | None, strong_match: int) -> None:
        self.suffix = suffix
        self.layer = layer
        self.strong = strong_match
        self.sources: list[DraftSource] = [s for s in (suffix, layer) if s is not None]

    def reset(self, tokens: Sequence[int]) -> None:
        for s in self.sources:
            s.reset(tokens)

    def commit(self, tokens: Sequence[int]) -> None:
        for s in self.sources:
            s.commit(tokens)

    def finish(self) -> None:
        if self.layer is not None:
            self.layer.finish()

    def propose(self, pending: Sequence[int], n: int) -> Draft:
        if n <= 0:
            return NO_DRAFT
        copy = self.suffix.propose(pending, n) if self.suffix is not None else NO_DRAFT
        if copy.tokens and (copy.match >= self.strong or self.layer is None):
            return copy
        if self.layer is not None:
            return self.layer.propose(pending, n)
        return copy


def draft_sources(
    model: object, cfg: SpecConfig, sampler: Sampler, cache: KVCache | None = None
) -> DraftPicker | None:
    """The sources a request drafts from under `cfg`, or None when it decodes one token per forward. The draft
    layer keeps its KV in `cache` (the runner's), so it drafts only where one is given."""
    if not cfg.drafting:
        return None
    suffix = SuffixDraft(cfg.min_match, cfg.max_match) if cfg.suffix else None
    layer = None
    if cfg.draft_layer and cache is not None:
        layer_model = draft_layer_of(model)
        layer = DraftLayerSource(layer_model, sampler, cache) if layer_model is not None else None
    if suffix is None and layer is None:
        return None
    return DraftPicker(suffix, layer, cfg.strong_match)


# ---------------------------------------------------------------------------------------------------------------
# Verification


@dataclass(frozen=True)
class Verdict:
    accepted: int  # drafts kept
    token: (
        int  # the next token: the target's own at the first rejected draft, or the bonus after the last kept
    )


def _penalised(sampler: Sampler) -> bool:
    """Whether the sampler changes the logits before its choice (penalties, a logit bias, a grammar): then a greedy
    window is verified row by row through it, not by one argmax."""
    p = sampler.p
    return (
        p.repeat_penalty != 1
        or p.presence_penalty != 0
        or p.frequency_penalty != 0
        or bool(p.logit_bias)
        or sampler.constraint is not None
    )


def verify(logits: torch.Tensor, draft: Draft, sampler: Sampler, history: Sequence[int]) -> Verdict:
    """logits [k+1, V]: the window's rows (row j follows drafts 0..j-1); `history` ends with the window's first
    token. Penalties see the history each row would have, so row j's law is the one decoding without drafts uses."""
    k = len(draft.tokens)
    if sampler.p.greedy and not _penalised(sampler):
        best = torch.argmax(logits[: k + 1], dim=-1).tolist()  # one transfer for the whole window
        a = 0
        while a < k and best[a] == draft.tokens[a]:
            a += 1
        return Verdict(a, int(best[a]))
    rows = logits[: k + 1]  # [k+1, V], where the logits are: the sampler filters there
    hist = list(history)
    for j, d in enumerate(draft.tokens):
        if sampler.p.greedy:
            tok = sampler.sample(rows[j], hist)
            if tok != d:
                return Verdict(j, tok)
        else:
            p = sampler.probs(rows[j], hist)  # [V]
            q = draft.probs[j] if draft.probs is not None else None
            qd = 1.0 if q is None else float(q[d])
            if not sampler.uniform() * qd < float(p[d]):
                if q is None:
                    resid = p.clone()
                    resid[d] = 0.0
                else:
                    resid = (p - q.to(p.dtype)).clamp_min_(0.0)
                if (
                    float(resid.sum()) <= 0.0
                ):  # only where p(d) >= q(d), which never rejects; kept for rounding
                    resid = p
                return Verdict(j, sampler.draw(resid))
        hist.append(d)
    return Verdict(k, sampler.sample(rows[k], hist))


# ---------------------------------------------------------------------------------------------------------------
# Running windows


def rollback(model: object, cache: KVCache, length: int) -> None:
    """Forget positions >= length. Attention KV only needs the length cut (a position is always written again
    before a query reads it); a cache with recurrent state puts its state back in its own `truncate` (qwen3next's
    `RecurrentCache`), and a model that keeps state elsewhere does it in a `rollback(cache, length)` of its own."""
    fn = getattr(model, "rollback", None)
    if callable(fn):
        fn(cache, length)
    else:
        cache.truncate(length)


@dataclass
class _Guess:
    pos: int
    tokens: list[int]  # the guessed window: its first token (the guessed bonus) and its drafts
    draft: Draft  # the drafts among them (tokens[1:]) as proposed
    future: Future[torch.Tensor]  # the front stages' output [T, D] on the last stage's device


@dataclass(frozen=True)
class Window:
    tokens: list[int]  # what the model read: the token decided last, then the drafts
    accepted: list[int]  # the drafts kept
    next_token: int  # decided, not yet in the KV cache
    guessed: bool = False  # the front stages had read this window ahead (--pipeline-windows)
    rows: torch.Tensor | None = None  # the window's logits [len(tokens), V] (a request's logprobs)


def pipeline_support(model: object, cache: KVCache | None = None) -> str | None:
    """None when `--pipeline-windows 2` can run on `model` (with `cache`), else why not (one line for the log)."""
    stages = getattr(model, "stages", None)
    if not stages or len(stages) < 2:
        return "it needs a layer split of two or more stages (--layer-split)"
    if not hasattr(model, "handoffs"):
        return "the split model does not expose its hand-offs"

    if not all(isinstance(s, LocalStage) for s in stages):
        return "a stage runs in another process (--remote-stage); its windows stay serial"
    if getattr(model, "rollback", None) is not None or hasattr(cache, "step_states"):
        return "the model keeps recurrent state, whose guessed windows would need copies to put back"
    devices = [s.device for s in stages]
    if len(set(devices)) < len(devices) and devices[0].type == "cuda":
        return "two stages share a card (--split-device): they would take turns, not overlap"
    return None


class PipelinedStages:
    """A split's stages as front (all but the last, run on a worker thread) and last (run by the caller): the
    front can read one window ahead while the last stage computes the current one."""

    def __init__(self, model: object) -> None:
        self.model = model
        stages = model.stages  # type: ignore[attr-defined]
        self.front = list(stages[:-1])
        self.last = stages[-1]
        self.handoffs = list(model.handoffs)  # type: ignore[attr-defined]
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="strata-front")

    def front_run(self, tokens: list[int], cache: KVCache, pos: int) -> torch.Tensor:
        """tokens -> the front stages' hidden state [T, D] on the last stage's device."""
        x = torch.tensor(tokens, dtype=torch.long)
        for s, st in enumerate(self.front):
            x = st.run(x, cache, pos)
            x = self.handoffs[s].send(x)
        return x

    def submit(self, tokens: list[int], cache: KVCache, pos: int) -> Future[torch.Tensor]:
        inference = torch.is_inference_mode_enabled()

        def job() -> torch.Tensor:
            with torch.inference_mode(inference):  # the mode is per thread
                return self.front_run(tokens, cache, pos)

        return self.pool.submit(job)

    def last_run(self, h: torch.Tensor, cache: KVCache, pos: int) -> torch.Tensor:
        return self.last.run(h, cache, pos)  # [T, V]

    def record(self, tokens: list[int], pos: int) -> None:
        """Keep the split's token history (it rebuilds remote stages from it) as its own forward would."""
        hist = getattr(self.model, "history", None)
        if isinstance(hist, list):
            del hist[pos:]
            hist.extend(tokens)


@dataclass
class _WindowGraph:
    graph: torch.cuda.CUDAGraph
    tok: torch.Tensor  # [R] long
    offsets: torch.Tensor  # [R] long: 0..R-1
    pos: torch.Tensor  # [R] long: start + offsets
    out: torch.Tensor  # [R, V] logits


class WindowGraphs:
    """Verify windows of a one-card CUDA model replayed as CUDA graphs, as its one-token step is
    (engine/pipeline/cuda_graphs.py): a window launches its few hundred kernels at once instead of one by one.

    Every window runs `rows` rows (--spec N + 1), one graph per (KV cache, attention-span bucket); a shorter window
    is padded with copies of its last token at the next positions. Attention is causal, so the padding rows change
    nothing in the real ones, and their KV lies beyond the kept length (written again before it is read). They do
    add to the expert selection counts, like any row the card computes."""

    def __init__(self, model: object, rows: int) -> None:
        self.model = model
        self.rows = rows

        self.graphs: GraphTable[_WindowGraph] = GraphTable()
        self.pool: tuple[int, int] | None = None
        self.keeper: torch.cuda.CUDAGraph | None = None  # keeps the pool (cuda_graphs.capturing)

    @staticmethod
    def usable(model: object) -> bool:
        own = getattr(model, "graphs", None)
        dev = getattr(model, "device", None)
        return (
            own is not None
            and bool(getattr(own, "usable", False))
            and hasattr(model, "forward_at")
            and isinstance(dev, torch.device)
            and dev.type == "cuda"
        )

    def forward(self, tokens: list[int], cache: KVCache, start: int) -> torch.Tensor:
        """tokens at start.. -> logits [len(tokens), V]; the cache then holds start + len(tokens) positions."""
        t, r = len(tokens), self.rows
        m = self.model
        if t == 1 or t > r or start + r > cache.max_ctx:  # one token: the model's own graph
            return m.forward(torch.tensor(tokens, dtype=torch.long), cache, start)  # type: ignore[attr-defined]
        padded = torch.tensor(tokens + [tokens[-1]] * (r - t), dtype=torch.long)
        span = min(cache.max_ctx, -(-(start + r) // SPAN_BUCKET) * SPAN_BUCKET)
        g = self.graphs.get(cache, span)
        if g is None:
            g = self._capture(padded, cache, start, span)
            self.graphs.put(cache, span, g)
        else:
            g.tok.copy_(padded, non_blocking=True)
            torch.add(g.offsets, start, out=g.pos)
        g.graph.replay()
        cache.length = start + t
        return g.out[:t].clone()  # the next replay overwrites the graph's output

    def _capture(self, padded: torch.Tensor, cache: KVCache, start: int, span: int) -> _WindowGraph:
        m = self.model
        dev = m.device  # type: ignore[attr-defined]
        tok = padded.to(dev)
        offsets = torch.arange(self.rows, dtype=torch.long, device=dev)
        pos = offsets + start
        # Warm-up runs repeat this window's own KV writes; the selection counts they add are put back.
        counts = getattr(m, "expert_counts", None)
        saved = counts.clone() if counts is not None else None
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            for _ in range(2):
                m.forward_at(tok, cache, pos, span)  # type: ignore[attr-defined]
        torch.cuda.current_stream(dev).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with capturing(graph, self.pool, side):
            out = m.forward_at(tok, cache, pos, span)  # type: ignore[attr-defined]
        self.pool, self.keeper = graph.pool(), graph
        if saved is not None and counts is not None:
            counts.copy_(saved)
        return _WindowGraph(graph, tok, offsets, pos, out)


def window_graphs_for(model: object, cfg: SpecConfig) -> WindowGraphs | None:
    """Graphs for the windows of `model` under `cfg`, where it runs on one CUDA card with graphs of its own."""
    if cfg.n <= 0 or not WindowGraphs.usable(model):
        return None
    return WindowGraphs(model, cfg.n + 1)


class WindowDecoder:
    """The decode of one request in verify windows: drafts, one forward per window (serial, or with the next
    window guessed ahead on a split's front stages), verification, KV rollback, statistics."""

    def __init__(
        self,
        model: object,
        cache: KVCache,
        cfg: SpecConfig,
        sampler: Sampler,
        sources: DraftSource | None,
        pipe: PipelinedStages | None = None,
        graphs: WindowGraphs | None = None,
    ) -> None:
        self.model = model
        self.graphs = graphs
        self.cache = cache
        self.cfg = cfg
        self.sampler = sampler
        self.sources = sources
        self.pipe = pipe
        self.stats = SpecStats()
        self._guess: _Guess | None = None
        self._kept_whole = 0.5  # running share of windows kept whole: the guess estimate

    def start(self, committed: Sequence[int]) -> None:
        """A request begins: `committed` is what the KV cache holds before its prompt is read."""
        if self.sources is not None:
            self.sources.reset(committed)

    def read(self, tokens: Sequence[int]) -> None:
        """A prompt chunk was read (the last forward): the sources take it as committed."""
        if self.sources is not None:
            self.sources.commit(tokens)

    def finish(self) -> None:
        """The decode ended normally: sources that defer work on kept tokens do it now."""
        finish = getattr(self.sources, "finish", None)
        if callable(finish):
            finish()

    def _forward(self, tokens: list[int], pos: int) -> torch.Tensor:
        if self.graphs is not None:
            return self.graphs.forward(tokens, self.cache, pos)
        return self.model.forward(torch.tensor(tokens, dtype=torch.long), self.cache, pos)  # type: ignore[attr-defined]

    def _take_guess(self, token: int, pos: int, k: int) -> tuple[list[int], Draft, torch.Tensor] | None:
        g, self._guess = self._guess, None
        if g is None:
            return None
        h = g.future.result()  # the front must be done before anything else runs on its stages
        if self.cfg.force_guess_miss or g.pos != pos or g.tokens[0] != token:
            return None
        n = min(k, len(g.draft.tokens))  # rows are causal: a shorter budget keeps a prefix of the window
        probs = g.draft.probs[:n] if g.draft.probs is not None else None
        self.stats.guesses_kept += 1
        return g.tokens[: n + 1], Draft(g.draft.tokens[:n], probs, g.draft.match), h[: n + 1]

    def window(self, token: int, pos: int, history: Sequence[int], k: int, room: int = 0) -> Window:
        """Read `token` (decided, at position `pos`) with up to k drafts, verify, roll the KV back to the last kept
        token. `history` ends with `token`; `room`: tokens the request may still take after this window's (the
        budget of a guessed next window)."""
        src = self.sources
        k = k if src is not None else 0
        taken = self._take_guess(token, pos, k) if self.pipe is not None else None
        chain = NO_DRAFT
        if taken is not None:
            tokens, draft, h = taken
        else:
            # With the pipeline the chain runs on past this window: the bonus token guessed, then the next drafts.
            ahead = 1 + min(self.cfg.n, room) if self.pipe is not None and k > 0 and room > 0 else 0
            chain = src.propose([token], k + ahead) if src is not None and k > 0 else NO_DRAFT
            n = min(k, len(chain.tokens))
            draft = Draft(chain.tokens[:n], chain.probs[:n] if chain.probs is not None else None, chain.match)
            tokens = [token, *draft.tokens]
            h = None
        if self.pipe is not None:
            if h is None:
                h = self.pipe.front_run(tokens, self.cache, pos)
            self._maybe_guess(tokens, draft, chain, pos, room)
            logits = self.pipe.last_run(h, self.cache, pos)  # runs beside the guessed window on the front
            self.cache.length = pos + len(tokens)
        else:
            logits = self._forward(tokens, pos)
        self.sampler.prepare(logits.device)  # a grammar's mask computed while the device runs the window
        v = verify(logits, draft, self.sampler, history)
        kept = draft.tokens[: v.accepted]
        rollback(self.model, self.cache, pos + 1 + v.accepted)
        if self.pipe is not None:
            self.pipe.record(tokens[: 1 + v.accepted], pos)
        if src is not None:
            src.commit([token, *kept])
        st = self.stats
        st.windows += 1
        st.proposed += len(draft.tokens)
        st.accepted += v.accepted
        if draft.tokens:
            whole = 1.0 if v.accepted == len(draft.tokens) else 0.0
            self._kept_whole = 0.75 * self._kept_whole + 0.25 * whole
        return Window(tokens, kept, v.token, taken is not None, logits)

    def _maybe_guess(self, tokens: list[int], draft: Draft, chain: Draft, pos: int, room: int) -> None:
        """Start the front stages on the next window as guessed: every draft of this one kept, the bonus token the
        chain's next one. Only when the estimate says a whole window is likely kept, and the drafts reach past it."""
        assert self.pipe is not None and self.sources is not None
        k = len(draft.tokens)
        if k == 0 or room <= 0 or self._kept_whole < self.cfg.guess_threshold:
            return
        if chain.tokens:  # proposed with this window: the chain already runs past it
            rest = chain.tokens[k:]
            rest_probs = chain.probs[k:] if chain.probs is not None else None
        else:  # this window was itself a guess: draft on from its end
            more = self.sources.propose(tokens, 1 + min(self.cfg.n, room))
            rest, rest_probs = more.tokens, more.probs
        if len(rest) < 2:
            return
        n = min(len(rest) - 1, self.cfg.n, room)
        nxt = pos + len(tokens)
        guess = rest[: n + 1]
        if nxt + len(guess) > self.cache.max_ctx:
            return
        gdraft = Draft(guess[1:], rest_probs[1 : n + 1] if rest_probs is not None else None, chain.match)
        self._guess = _Guess(nxt, guess, gdraft, self.pipe.submit(guess, self.cache, nxt))
        self.stats.guesses += 1

    def close(self) -> None:
        """Wait for a guessed window still on the front stages (nothing may touch the cache beside it)."""
        g, self._guess = self._guess, None
        if g is not None:
            try:
                g.future.result()
            except Exception:  # a failed guess no longer matters; the next forward reports a broken stage
                log.debug("a guessed window failed", exc_info=True)


def pipeline_for(
    model: object,
    cfg: SpecConfig,
    on_line: Callable[[str], None] | None = None,
    cache: KVCache | None = None,
) -> PipelinedStages | None:
    """The front/last runner for `--pipeline-windows 2`, or None (with one line saying why) where it cannot run."""
    if cfg.pipeline_windows != 2:
        return None
    why = pipeline_support(model, cache)
    if why is None and not cfg.drafting:
        why = "it guesses windows from drafts: give --spec N"
    if why is not None:
        line = f"--pipeline-windows 2 is off: {why}"
        (on_line or log.info)(line)
        return None
    return PipelinedStages(model)

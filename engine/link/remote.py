"""The model's side of the stage link (torch): what a worker computes, what the main process's chain sees of a
remote stage, and the fingerprints the handshake compares."""

from __future__ import annotations

import logging
import time
import warnings
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from itertools import accumulate

import torch

from engine.gguf.digest import data_digest, header_digest
from engine.gguf.model_config import ModelConfig
from engine.gguf.reader import GGUFFile
from engine.layers.kv_cache import KVCache
from engine.link import protocol as P
from engine.link.client import StageClient, StageError
from engine.models.decoder import DecoderLM
from engine.models.family_base import BatchPart, logit_rows, scratch_steps
from engine.models.fast_decode import FAST_MAX_ROWS
from engine.models.gated_delta import RecurrentCache
from engine.pipeline.cuda_graphs import HeadGraphs, decode_graphs_usable
from engine.pipeline.stages import LocalStage

log = logging.getLogger("strata.link")

_TIMING_KEYS = ("st", "at", "c", "w", "r", "x")
_TORCH = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}


# ---------------------------------------------------------------------------------------------------------------
# Fingerprints


def stage_info(
    gf: GGUFFile, cfg: ModelConfig, begin: int, end: int, max_ctx: int, max_tokens: int, kv: str = "f32",
    header: str | None = None, data: bool = True, slots: int = 1,
) -> P.StageInfo:  # fmt: skip
    return P.StageInfo(
        arch=cfg.arch,
        n_layer=cfg.n_layer,
        n_embd=cfg.n_embd,
        n_head_kv=cfg.n_head_kv,
        head_dim=cfg.head_dim_k,
        n_vocab=cfg.n_vocab,
        n_expert=cfg.n_expert,
        begin=begin,
        end=end,
        header=header or header_digest(gf),
        data=data_digest(gf, begin, end) if data else "",
        kv=kv,
        max_ctx=max_ctx,
        max_tokens=max_tokens,
        slots=slots,
    )


# ---------------------------------------------------------------------------------------------------------------
# The worker's compute


def tensor_from(payload: memoryview | bytes, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    """A checked payload (protocol.decode) as a tensor [T, D]; its own memory (the receive buffer is read-only)."""
    with warnings.catch_warnings():
        warnings.simplefilter(
            "ignore", UserWarning
        )  # torch warns on read-only buffers; the view is copied at once
        t = torch.frombuffer(payload, dtype=_TORCH[dtype]).view(shape)
    return t.clone()


def payload_of(h: torch.Tensor) -> tuple[memoryview, str, tuple[int, ...]]:
    """A hidden state as float32 bytes on the host (what the link carries: the residual stream is float32)."""
    out = h.detach().to("cpu", torch.float32).contiguous()
    return memoryview(out.numpy()).cast("B"), "f32", tuple(out.shape)


class ModelCompute:
    """Layers [begin, end) of the model on this worker's device (no token table, no head), for the sequences
    (slots) of one main process's session, each with its own KV."""

    def __init__(self, model: DecoderLM, label: str) -> None:
        if model.has_embed or model.has_head:
            raise ValueError("a worker stage runs neither the token table nor the head")
        self.stage = LocalStage(model, label)
        self.caches: list[KVCache] = []
        self._warm_due = False

    def open(self, max_ctx: int, kv: str, slots: int = 1) -> None:
        self.caches, self._warm_due = [], False  # the old session's KV goes first
        m = self.stage.model
        if self.stage.device.type == "cuda":
            torch.cuda.empty_cache()
        if slots > 1 and self.stage.takes_rows:
            # rows of one cache: a step's decode rows of every slot cross the stage's fused path together
            self.caches = m.new_cache(slots * max_ctx, kv).split(slots)
            # captured before the first step, not here: compiling the fused kernels can take longer than the
            # main waits for the handshake (on one H200 the first session's hello timed out at 10 s); while the
            # first step waits for them the worker says `busy`
            self._warm_due = True
        else:
            self.caches = [m.new_cache(max_ctx, kv) for _ in range(slots)]

    @torch.inference_mode()
    def _warm_rows(self) -> None:
        """Run (and so capture) the fused decode rows of 1 .. FAST_MAX_ROWS slots once, at position 0, before the
        first step needs them; the caches and the expert counts are left as they were."""
        m, dev = self.stage.model, self.stage.device
        with scratch_steps([m], self.caches):
            for t in range(1, min(len(self.caches), FAST_MAX_ROWS) + 1):
                parts = [BatchPart(torch.zeros(1, dtype=torch.long), c, 0) for c in self.caches[:t]]
                self.stage.run_rows(torch.zeros(t, m.cfg.n_embd, device=dev), parts)

    @torch.inference_mode()
    def forward(
        self,
        payload: memoryview | bytes,
        dtype: str,
        shape: tuple[int, ...],
        rows: Sequence[tuple[int, int, int]],
    ) -> tuple[memoryview, str, tuple[int, ...]]:
        if not self.caches:
            raise RuntimeError("no session: the handshake did not finish")
        if self._warm_due:
            self._warm_due = False
            self._warm_rows()
        h = tensor_from(payload, dtype, shape).to(self.stage.device).float()  # [T, D]
        st, m = self.stage, self.stage.model
        parts = [
            BatchPart(torch.zeros(n, dtype=torch.long), self.caches[slot], start) for slot, start, n in rows
        ]
        if len(parts) == 1:  # one sequence: its decode graphs, or a prompt piece
            out = st.run(h, parts[0].cache, parts[0].start)
        elif all(p.tokens.shape[0] == 1 for p in parts) and parts[0].cache.shared is not None:
            out = st.run_rows(h, parts)  # one decode row of each slot: the fused path
        elif hasattr(m, "layers_batch") and not any(isinstance(p.cache, RecurrentCache) for p in parts):
            out = st.run_batch(h, parts)  # prompt chunks and decode rows together, attention part by part
        else:  # a family that runs one sequence at a time (recurrent state, latent attention)
            cuts = list(accumulate((p.tokens.shape[0] for p in parts), initial=0))
            out = torch.cat(
                [st.run(h[a:b], p.cache, p.start) for p, a, b in zip(parts, cuts, cuts[1:], strict=False)]
            )
        for p in parts:
            p.cache.length = p.start + int(p.tokens.shape[0])
        return payload_of(out)


# ---------------------------------------------------------------------------------------------------------------
# The main process's view of a remote stage


DOWN_HOLD_S = 2.0  # how long one handshake that timed out answers for the requests behind it
SLOW_FAIL_S = 0.5  # a failure that took this long waited out a deadline (a silent worker), not a refusal


class RemoteStage:
    """Layers [begin, end) of the chain behind one link, as a pipeline stage of the main process. Hidden states go
    out and come back as float32 on the host; `pipe` keeps up to `window` prompt pieces in flight."""

    def __init__(
        self,
        client: StageClient,
        expect: P.StageInfo,
        verify: Callable[[list[P.StageInfo]], None],
        timing: Callable[[str], None] | None = None,
        window: int = 2,
    ) -> None:
        self.client = client
        self.expect = expect
        self.verify = verify
        self.timing = timing
        self.window = max(1, window)
        self.layers = range(expect.begin, expect.end)
        self.device = torch.device("cpu")
        self.label = str(client.endpoint)
        self.chain: list[P.StageInfo] = []
        self.last_timing: list[dict[str, object]] = []
        self.last_rtt_ms = 0.0
        self.status = "not connected"
        self._down: tuple[float, StageError] | None = None  # (until, why): the last handshake failed

    @property
    def max_tokens(self) -> int:
        return self.expect.max_tokens

    def connect(self) -> None:
        """A new handshake. One that failed by waiting out its deadline (a silent worker) is the answer for
        DOWN_HOLD_S: the requests queued behind it fail at once with its reason, not each after a wait of its own.
        A refusal takes milliseconds to find again, so it holds nothing (a worker back a moment later serves)."""
        held = self._down
        if held is not None and time.monotonic() < held[0]:
            raise StageError(str(held[1]), held[1].code)
        t0 = time.monotonic()
        try:
            chain = self._hello()
        except StageError as e:
            self.status = f"down: {e}"
            if time.monotonic() - t0 >= SLOW_FAIL_S:
                self._down = (time.monotonic() + DOWN_HOLD_S, e)
            raise
        self._down = None
        try:
            self.verify(chain)
        except StageError as e:
            self.client.close()
            self.status = f"refused: {e}"
            raise
        self.chain = chain
        self.status = "ok"
        log.info(
            "remote stage: %s",
            ", ".join(f"layers {c.layers_text} at {c.address or self.label}" for c in chain),
        )

    def _hello(self) -> list[P.StageInfo]:
        try:
            return self.client.connect(self.expect)
        except StageError as e:
            if self.expect.slots == 1 or "unknown field 'slots'" not in str(e):
                raise
        # a worker of a version before several sequences per session: it serves one (the welcome says so)
        log.warning(
            "%s keeps one sequence (an earlier version of PolyStrata): update it to serve several", self.label
        )
        self.expect = replace(self.expect, slots=1)
        return self.client.connect(self.expect)

    def ensure(self) -> bool:
        """Connected (a new handshake when the last request failed or the worker left since); -> True when this
        made a new session, whose worker holds no positions yet."""
        if self.client.ok and self.client.check_idle():
            return False
        self.connect()
        return True

    def check(self) -> None:
        """Between requests: a worker that left since is marked down (/health names it); the next request
        reconnects."""
        if self.status == "ok" and not self.client.check_idle():
            self.status = f"down: {self.client.lost or 'the connection ended'}"

    def close(self) -> None:
        self.client.close()

    def _note(self, reply_t: object, rtt: float) -> None:
        """Keep the reply's per-stage timing (numbers and names only: it came over the network)."""
        keep: list[dict[str, object]] = []
        for t in reply_t[:16] if isinstance(reply_t, list) else []:
            if isinstance(t, dict):
                keep.append(
                    {
                        k: (v if isinstance(v, int | float) else str(v)[:80])
                        for k, v in t.items()
                        if k in _TIMING_KEYS
                    }
                )
        self.last_timing = keep
        self.last_rtt_ms = rtt

    def run(self, x: torch.Tensor, cache: KVCache, start: int) -> torch.Tensor:
        """x [T, D] -> [T, D] after the remote layers (pieces of at most max_tokens)."""
        if not self.client.ok:
            raise StageError(f"{self.client.label} is not connected: {self.client.last_error or self.status}")
        outs = []
        for o in range(0, x.shape[0], self.max_tokens):
            piece = x[o : o + self.max_tokens]
            payload, dtype, shape = payload_of(piece)
            try:
                rows = [(cache.slot, start + o, int(piece.shape[0]))]
                seq = self.client.submit(payload, dtype, shape, start + o, rows)
                r = self.client.wait(seq)
            except StageError as e:
                self.status = f"down: {e}"
                raise
            self._note(r.message.get("t"), r.rtt_ms)
            outs.append(tensor_from(r.message.payload or b"", r.message.dtype or "f32", r.message.shape))
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def run_parts(self, x: torch.Tensor, parts: Sequence[BatchPart]) -> torch.Tensor:
        """The rows of several sequences (x [R, D], each part's rows in order, its cache's `slot` naming it on the
        worker) -> [R, D] after the remote layers: one message a step, or as many as `max_tokens` needs (a part
        longer than that goes in pieces, in order), all sent before the first answer is read."""
        return self.collect(self.submit_parts(x, parts))

    def submit_parts(self, x: torch.Tensor, parts: Sequence[BatchPart]) -> _Sent:
        """`run_parts` up to the sending: the step's messages go out (all of them, the worker queues them) and
        this returns at once; `collect` waits for the answers. Groups of slots are pipelined so: this process
        computes one group's layers while the worker computes another's."""
        if not self.client.ok:
            raise StageError(f"{self.client.label} is not connected: {self.client.last_error or self.status}")
        msgs: list[tuple[int, int, list[tuple[int, int, int]]]] = []  # (first row, last row + 1, rows)
        at = 0
        for p in parts:
            n = int(p.tokens.shape[0])
            for o in range(0, n, self.max_tokens):
                k = min(self.max_tokens, n - o)
                last = msgs[-1] if msgs else None
                fits = last is not None and last[1] - last[0] + k <= self.max_tokens
                if fits and all(r[0] != p.cache.slot for r in last[2]):  # type: ignore[index]
                    msgs[-1] = (last[0], last[1] + k, [*last[2], (p.cache.slot, p.start + o, k)])  # type: ignore[index]
                else:
                    msgs.append((at + o, at + o + k, [(p.cache.slot, p.start + o, k)]))
            at += n
        sent: list[int] = []
        try:
            for a, b, rows in msgs:
                payload, dtype, shape = payload_of(x[a:b])
                sent.append(self.client.submit(payload, dtype, shape, rows[0][1], rows))
        except StageError as e:
            self.status = f"down: {e}"
            raise
        return _Sent(sent, self.client.session)

    def collect(self, sent: _Sent) -> torch.Tensor:
        """The answers to `submit_parts`'s messages -> [R, D] (earlier steps' answers must have been collected)."""
        # reconnected since (another group's step found the link down): these answers will not come
        if self.client.session != sent.session:
            raise StageError(
                f"{self.client.label}: the connection was renewed while this step was out", "stale"
            )
        outs: list[torch.Tensor] = []
        try:
            for seq in sent.seqs:
                r = self.client.wait(seq)
                self._note(r.message.get("t"), r.rtt_ms)
                outs.append(tensor_from(r.message.payload or b"", r.message.dtype or "f32", r.message.shape))
        except StageError as e:
            self.status = f"down: {e}"
            raise
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def pipe(
        self,
        take: Callable[[float], tuple[int, torch.Tensor] | None],
        give: Callable[[torch.Tensor], bool],
        pieces: int,
        failed: Callable[[], bool],
        slot: int = 0,
    ) -> None:
        """Prompt pieces of the sequence in `slot` through the link with up to `window` in flight: `take(timeout)`
        gives (start, x) or None, `give(out)` passes a result on (False: stop)."""
        try:
            self._pipe(take, give, pieces, failed, slot)
        except StageError as e:
            self.status = f"down: {e}"
            raise

    def _pipe(
        self,
        take: Callable[[float], tuple[int, torch.Tensor] | None],
        give: Callable[[torch.Tensor], bool],
        pieces: int,
        failed: Callable[[], bool],
        slot: int,
    ) -> None:
        if not self.client.ok:
            raise StageError(f"{self.client.label} is not connected: {self.client.last_error or self.status}")
        sent = got = 0
        flight: deque[int] = deque()
        while got < pieces:
            if failed():
                if flight:  # answers still due on this session: a new handshake starts clean next time
                    self.client.close()
                    self.status = "down: a local stage failed while pieces were in flight"
                return
            if sent < pieces and len(flight) < self.window:
                item = take(0.002 if flight else 0.05)
                if item is not None:
                    pos, x = item
                    if x.shape[0] > self.max_tokens:
                        raise StageError(
                            f"a prompt piece of {x.shape[0]} tokens is over the {self.max_tokens} agreed"
                        )
                    payload, dtype, shape = payload_of(x)
                    rows = [(slot, pos, int(x.shape[0]))]
                    flight.append(self.client.submit(payload, dtype, shape, pos, rows))
                    sent += 1
                    continue
            if flight:
                r = self.client.poll(0.002 if sent < pieces and len(flight) < self.window else 0.05)
                if r is None:
                    continue
                if r.seq != flight[0]:
                    raise StageError(f"{self.client.label} answered out of order")
                flight.popleft()
                got += 1
                self._note(r.message.get("t"), r.rtt_ms)
                if not give(tensor_from(r.message.payload or b"", r.message.dtype or "f32", r.message.shape)):
                    return


@dataclass(frozen=True)
class _Sent:
    seqs: list[int]  # the link's sequence numbers of one step's messages, in order
    session: int  # the connection's session they went out on


class HeadStage:
    """The main process's output head after a remote chain (its model holds layers [0, K) and the head)."""

    def __init__(self, model: DecoderLM, label: str) -> None:
        self.model = model
        self.layers = range(model.cfg.n_layer, model.cfg.n_layer)
        self.device = model.device
        self.label = label
        # decode steps' heads from CUDA graphs, captured by warm() (SplitModel.warm_rows) where the model's decode
        # step can be captured
        self.graphs = HeadGraphs(model, FAST_MAX_ROWS) if decode_graphs_usable(model) else None

    takes_last_only = True

    def warm_head(self, most: int) -> int:
        """Capture the head of steps of 1 .. most rows -> how many row counts are captured (0: none here)."""
        return self.graphs.warm(most) if self.graphs is not None else 0

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        y = self.graphs.run(x) if self.graphs is not None else None
        return self.model.head(x) if y is None else y

    def run(self, x: torch.Tensor, cache: KVCache, start: int, last_only: bool = False) -> torch.Tensor:
        if last_only and x.shape[0] > 1:
            return self.model.head(x, last_only)  # [1, V]: a prompt chunk's last row
        return self._head(x)  # [T, V]

    def run_parts(self, x: torch.Tensor, parts: Sequence[BatchPart]) -> torch.Tensor:
        """Several sequences' rows [R, D] -> each part's wanted logit rows (its last; a verify window's every row)."""
        want = logit_rows(parts)
        if len(want) == x.shape[0]:  # every row (decode rows, windows): no gather
            return self._head(x)
        return self.model.head(x.index_select(0, torch.tensor(want, device=x.device)))

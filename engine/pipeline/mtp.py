"""Drafts from the model's own draft layer (MTP / nextn: GLM-4.5's `blk.N.nextn.*`) for verify windows (`--mtp`).

The draft layer pairs the target's final hidden state g_i at position i (after the output norm: the rows the head
multiplies) with the token x_{i+1} that follows it and predicts x_{i+2}; it has one decoder block with a KV of its
own, one slot per position (slot i for the pair (g_i, x_{i+1})). A draft chain starts from the target's g at the
last committed position paired with the token decided last, and feeds each step's own output hidden state to the
next step together with the token it drafted.

`DraftLayerSource` keeps that KV in step with the committed sequence: after every forward of the target (prompt
chunks and verify windows) it takes the head's rows of the committed positions (`take_head_rows`), and before the
next chain it writes their slots from them - the accepted drafts' slots, written from the chain's own hidden
states while drafting, are written again from the target's - in one batch with the chain's first step. Slots past
the committed positions are left as the last chain wrote them: a slot is always written again before a query
reads it. Positions reused from an earlier request (prompt cache) keep the slots that request wrote; the one slot
at the boundary pairs the earlier request's next token, which only changes what gets drafted, never the output.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch

from engine.layers.kv_cache import KVCache
from engine.pipeline.drafts import NO_DRAFT, Draft
from engine.pipeline.sampling import Sampler


@runtime_checkable
class DraftLayerModel(Protocol):
    """A model (or the last stage's model) that loaded a draft layer (engine/models/glm4moe.py)."""

    draft_layer_count: int

    def take_head_rows(self, n: int) -> torch.Tensor:
        """The first n rows [<= n, D] the head read since the last take, forgotten by the model."""
        ...

    def nextn_step(
        self, tokens: torch.Tensor, hidden: torch.Tensor, cache: KVCache, start: int, depth: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Slots start..start+T-1: tokens [T] and hidden [T, D] -> (logits [T, V], the step's hidden [T, D])."""
        ...


def draft_layer_of(model: object) -> DraftLayerModel | None:
    """The model's draft layer where it loaded one; on a layer split, the one the stage with the head holds."""
    stages = getattr(model, "stages", None)
    if stages:
        model = getattr(stages[-1], "model", None)
    if isinstance(model, DraftLayerModel) and int(model.draft_layer_count) > 0:
        return model
    return None


class DraftLayerSource:
    """Drafts from a draft layer: greedy requests take the argmax of each step (point masses); sampled ones draw
    from the draft layer's distribution under the request's temperature and filters, which verification then
    uses as q. Follows the `DraftSource` contract: each `commit(tokens)` comes right after the target's forward
    that started at the committed length and read at least those tokens."""

    def __init__(self, model: DraftLayerModel, sampler: Sampler, cache: KVCache) -> None:
        self.model = model
        self.sampler = sampler
        self.cache = cache
        self.committed = 0  # positions in the target's KV
        self.done = 0  # slots 0..done-1 hold the target's pairs of the committed sequence
        # The target's g at positions done..committed-1 [committed - done, D], and the tokens at positions
        # done+1..committed-1 (the pairs of every row but the last).
        self.rows: torch.Tensor | None = None
        self.next: list[int] = []
        # The token the last chain paired with the last row (that slot is written unless the token changes).
        self.tentative: int | None = None

    def reset(self, tokens: Sequence[int]) -> None:
        self.model.take_head_rows(0)  # rows of forwards outside this request
        self.committed = self.done = len(tokens)
        self.rows, self.next, self.tentative = None, [], None

    def commit(self, tokens: Sequence[int]) -> None:
        if not tokens:
            return
        rows = self.model.take_head_rows(len(tokens)).clone()  # [m, D] at positions committed..
        if self.rows is not None and self.tentative != int(tokens[0]):
            self._step([*self.next, int(tokens[0])], self.rows, self.done)  # the earlier rows' slots
        self.done = self.committed
        self.rows, self.next, self.tentative = rows, [int(t) for t in tokens[1:]], None
        self.committed += len(tokens)
        if len(rows) < len(tokens):  # rows that were not kept: those slots stay as they are
            self.done, self.rows, self.next = self.committed, None, []

    def finish(self) -> None:
        """Write the slots whose pairs are known (the last window's kept drafts), so that a later request that
        continues this sequence finds them."""
        if self.rows is not None and len(self.rows) > 1:
            self._step(self.next, self.rows[:-1], self.done)
            self.done += len(self.next)
            self.rows, self.next = self.rows[-1:], []

    def propose(self, pending: Sequence[int], n: int) -> Draft:
        if n <= 0 or not pending or self.rows is None:
            return NO_DRAFT
        last_slot = self.cache.max_ctx - 1
        slot = self.committed - 1  # the last committed position, paired with the first pending token
        if slot > last_slot:
            return NO_DRAFT
        logits, g = self._step([*self.next, int(pending[0])], self.rows, self.done)
        self.rows, self.next, self.done = self.rows[-1:], [], slot
        self.tentative = int(pending[0])
        logits, g = logits[-1:], g[-1:]
        for tok in pending[1:]:  # a guessed window: read through its tokens
            slot += 1
            if slot > last_slot:
                return NO_DRAFT
            logits, g = self._step([int(tok)], g, slot)
        greedy = self.sampler.p.greedy
        tokens: list[int] = []
        qs: list[torch.Tensor] = []
        while True:
            if greedy:
                tok = int(torch.argmax(logits[0]))
            else:
                q = self.sampler.probs(logits[0], [])  # [V]; penalties belong to the target, q may be any law
                tok = self.sampler.draw(q)
                qs.append(q)
            tokens.append(tok)
            slot += 1
            if len(tokens) == n or slot > last_slot:
                break
            logits, g = self._step([tok], g, slot)
        return Draft(tokens, torch.stack(qs) if qs else None)

    def _step(self, tokens: list[int], hidden: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.model.nextn_step(torch.tensor(tokens, dtype=torch.long), hidden, self.cache, start)

"""Test helpers: a plain greedy loop (the reference the windows are checked against), draft sources that know the
reference continuation (always wrong, or mostly right), and a toy bigram target with a bigram draft layer."""

from collections.abc import Sequence

import torch

from engine.layers.kv_cache import KVCache
from engine.pipeline.spec import Draft


@torch.inference_mode()
def reference_greedy(model: object, prompt: Sequence[int], n: int, max_ctx: int = 256) -> list[int]:
    """One forward per token, argmax of each: decoding as it is without any window code."""
    cache = model.new_cache(max_ctx, "f32")  # type: ignore[attr-defined]
    logits = model.forward(torch.tensor(list(prompt)), cache, 0)  # type: ignore[attr-defined]
    out: list[int] = []
    for _ in range(n):
        tok = int(torch.argmax(logits[-1].float().cpu()))
        out.append(tok)
        logits = model.forward(torch.tensor([tok]), cache, len(prompt) + len(out) - 1)  # type: ignore[attr-defined]
    return out


class ScriptedDraft:
    """Drafts read off a known continuation `truth` (prompt + reference tokens): `wrong_every=1` makes every draft
    wrong (token + 1), `wrong_every=k` every k-th position, 0 none."""

    def __init__(self, truth: Sequence[int], vocab: int, wrong_every: int) -> None:
        self.truth = list(truth)
        self.vocab = vocab
        self.wrong_every = wrong_every
        self.committed = 0

    def reset(self, tokens: Sequence[int]) -> None:
        self.committed = len(tokens)

    def commit(self, tokens: Sequence[int]) -> None:
        self.committed += len(tokens)

    def propose(self, pending: Sequence[int], n: int) -> Draft:
        start = self.committed + len(pending)
        out = []
        for pos in range(start, min(start + n, len(self.truth))):
            tok = self.truth[pos]
            if self.wrong_every and pos % self.wrong_every == 0:
                tok = (tok + 1) % self.vocab
            out.append(tok)
        return Draft(out)


class BigramToy:
    """A target whose next-token law depends only on the current token (`target[t]` logits), with a draft layer
    of another bigram law (`draft[t]`): small enough that the exact law of a sampled sequence is known."""

    def __init__(self, target: torch.Tensor, draft: torch.Tensor) -> None:
        self.target = target  # [V, V] logits
        self.draft = draft  # [V, V] logits
        self.device = torch.device("cpu")
        self.dtype = torch.float32
        self.draft_layer_count = 1
        self.draft_calls: list[tuple[int, int]] = []

    def new_cache(self, max_ctx: int, kv_type: str) -> KVCache:
        return KVCache(range(0), max_ctx, 1, 1, 1, "f32", self.device)

    def forward(self, tokens: torch.Tensor, cache: KVCache, start: int) -> torch.Tensor:
        cache.length = start + tokens.shape[0]
        return self.target[tokens]  # [T, V]

    def draft_step(self, token: int, pos: int) -> torch.Tensor:
        self.draft_calls.append((token, pos))
        return self.draft[token]  # [V]

"""Test helpers: a plain greedy loop (the reference the windows are checked against), a 2-stage CPU split, draft
sources that know the reference continuation (always wrong, or mostly right), and a toy bigram target with a bigram
draft layer."""

from collections.abc import Sequence
from pathlib import Path

import torch

from engine.gguf.reader import GGUFFile
from engine.layers.kv_cache import KVCache
from engine.link.startup import load_split_model
from engine.models.registry import config_for, model_class
from engine.pipeline.spec import Draft
from engine.pipeline.split import SplitOptions
from engine.pipeline.stages import LocalStage, SplitModel
from engine.testing.tiny_models import ARCHITECTURES


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


def family_split(path: Path, k: int, **split: object) -> SplitModel:
    """Two CPU stages of a family with a model class of its own (layers 0..k-1 with the token table, k.. with the
    head and, where the file has one, the draft layer); `split`: SplitModel's options."""
    gf = GGUFFile.open(path)
    cfg = config_for(gf.architecture, gf.metadata, gf.tensors["token_embd.weight"].shape[0])
    cls = model_class(gf.architecture)
    assert cls is not None
    first = cls(cfg, gf, layers=range(0, k), embed=True, head=False)
    last = cls(cfg, gf, layers=range(k, cfg.n_layer), embed=False, head=True)
    return SplitModel(cfg, [LocalStage(first, "CPU"), LocalStage(last, "CPU")], **split)  # type: ignore[arg-type]


def two_stage_split(path: Path, arch: str, k: int, ctx: int) -> SplitModel:
    """Two CPU stages: through the split loader for the shared decoder, from the family's own class otherwise."""
    if arch in ARCHITECTURES:
        model = load_split_model(path, SplitOptions(device="cpu", layer_split=(k,)), ctx, "f32", "f32").model
        assert isinstance(model, SplitModel)
        return model
    return family_split(path, k)


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
    of another bigram law (`draft[t]`): small enough that the exact law of a sampled sequence is known. Its
    "hidden state" at position i is the number i, and the draft layer's own output at slot s is -1 - s, so the
    recorded calls show which state each slot of the draft layer read."""

    def __init__(self, target: torch.Tensor, draft: torch.Tensor) -> None:
        self.target = target  # [V, V] logits
        self.draft = draft  # [V, V] logits
        self.device = torch.device("cpu")
        self.dtype = torch.float32
        self.draft_layer_count = 1
        self.rows = torch.zeros(0, 1)
        self.draft_calls: list[list[tuple[int, int, float]]] = []  # per call: (slot, token, hidden) per row

    def new_cache(self, max_ctx: int, kv_type: str) -> KVCache:
        return KVCache(range(0), max_ctx, 1, 1, 1, "f32", self.device)

    def forward(self, tokens: torch.Tensor, cache: KVCache, start: int) -> torch.Tensor:
        t = tokens.shape[0]
        cache.length = start + t
        self.rows = torch.arange(start, start + t, dtype=torch.float32)[:, None]  # [T, 1]
        return self.target[tokens]  # [T, V]

    def take_head_rows(self, n: int) -> torch.Tensor:
        return self.rows[:n]

    def nextn_step(
        self, tokens: torch.Tensor, hidden: torch.Tensor, cache: KVCache, start: int, depth: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        t = tokens.shape[0]
        self.draft_calls.append([(start + i, int(tokens[i]), float(hidden[i, 0])) for i in range(t)])
        own = -1.0 - torch.arange(start, start + t, dtype=torch.float32)[:, None]
        return self.draft[tokens], own  # [T, V], [T, 1]

"""What a draft source proposes in a verify window (engine/pipeline/spec.py): the tokens, the distributions they were
drawn from, and how long a match of earlier context they continue; and the source's interface."""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class Draft:
    tokens: list[int]
    # [len(tokens), V] the distribution each token was drawn from; None: deterministic drafts (point masses)
    probs: torch.Tensor | None = None
    match: int = 0  # length of the earlier context the drafts continue (suffix drafts), 0 otherwise


NO_DRAFT = Draft([])


class DraftSource(Protocol):
    """Proposes tokens to follow a sequence. The committed sequence is what the KV cache holds (prompt and kept
    tokens); `pending` tokens follow it but are not committed (the token decided last, or a guessed window)."""

    def reset(self, tokens: Sequence[int]) -> None: ...

    def commit(self, tokens: Sequence[int]) -> None: ...

    def propose(self, pending: Sequence[int], n: int) -> Draft: ...

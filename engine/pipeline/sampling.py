"""Token sampling: penalties, top-k, top-p, min-p, temperature, seeded draws; temperature 0 is greedy."""

from dataclasses import dataclass

import torch


class SamplingError(ValueError):
    pass


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repeat_last_n: int = 64
    seed: int | None = None

    def __post_init__(self) -> None:
        checks = [
            (self.temperature >= 0, "temperature must be >= 0"),
            (self.top_k >= 0, "top_k must be >= 0 (0 = off)"),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (0 <= self.min_p <= 1, "min_p must be in [0, 1]"),
            (self.repeat_penalty > 0, "repeat_penalty must be > 0 (1 = off)"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty must be in [-2, 2]"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty must be in [-2, 2]"),
            (self.repeat_last_n >= -1, "repeat_last_n must be >= -1 (-1 = whole context)"),
        ]
        for ok, msg in checks:
            if not ok:
                raise SamplingError(msg)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


GREEDY = SamplingParams(temperature=0.0)


class Sampler:
    def __init__(self, params: SamplingParams) -> None:
        self.p = params
        self.gen = torch.Generator()
        if params.seed is not None:
            self.gen.manual_seed(params.seed)
        else:
            self.gen.seed()

    def _penalize(self, logits: torch.Tensor, history: list[int]) -> torch.Tensor:
        p = self.p
        if p.repeat_penalty == 1 and p.presence_penalty == 0 and p.frequency_penalty == 0:
            return logits
        recent = history if p.repeat_last_n == -1 else history[-p.repeat_last_n :] if p.repeat_last_n else []
        if not recent:
            return logits
        ids, counts = torch.unique(torch.tensor(recent, dtype=torch.long), return_counts=True)
        sel = logits[ids]
        if p.repeat_penalty != 1:  # as llama.cpp and HF: shrink positive logits, grow negative ones
            sel = torch.where(sel > 0, sel / p.repeat_penalty, sel * p.repeat_penalty)
        sel = sel - counts.float() * p.frequency_penalty - p.presence_penalty
        logits = logits.clone()
        logits[ids] = sel
        return logits

    def sample(self, logits: torch.Tensor, history: list[int]) -> int:
        """logits [V] (any device) -> token id."""
        if self.p.greedy:
            return int(torch.argmax(self._penalize(logits.float().cpu(), history)))
        return self.draw(self.probs(logits, history))

    def probs(self, logits: torch.Tensor, history: list[int]) -> torch.Tensor:
        """The distribution `sample` draws from: logits [V] (any device) -> probabilities [V] (float32, CPU).
        Greedy gives the one-hot of the argmax. Speculative sampling compares drafts against it."""
        logits = self._penalize(logits.float().cpu(), history)
        p = self.p
        if p.greedy:
            return torch.zeros_like(logits).scatter_(0, torch.argmax(logits).view(1), 1.0)
        if p.top_k > 0 and p.top_k < logits.numel():
            kth = torch.topk(logits, p.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if p.top_p < 1:
            sorted_l, order = torch.sort(logits, descending=True)
            probs = torch.softmax(sorted_l, dim=-1)
            # keep the smallest prefix whose mass reaches top_p (always at least one token)
            drop = (probs.cumsum(-1) - probs) >= p.top_p
            logits = logits.scatter(0, order[drop], float("-inf"))
        if p.min_p > 0:
            probs = torch.softmax(logits, dim=-1)
            logits = logits.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
        return torch.softmax(logits / p.temperature, dim=-1)

    def draw(self, probs: torch.Tensor) -> int:
        """A token from probabilities [V] (CPU; need not sum to 1), with this sampler's generator."""
        return int(torch.multinomial(probs, 1, generator=self.gen))

    def uniform(self) -> float:
        """A draw from U[0, 1) with this sampler's generator (the accept test of speculative sampling)."""
        return float(torch.rand(1, generator=self.gen))

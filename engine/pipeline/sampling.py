"""Token sampling: penalties, top-k, top-p, min-p, temperature, seeded draws; temperature 0 is greedy."""

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from installer.engine_options import SamplingDefaults

if TYPE_CHECKING:
    from engine.pipeline.constrain import Constraint


class SamplingError(ValueError):
    pass


@dataclass(frozen=True)
class SamplingParams(SamplingDefaults):
    """One request's sampling: the defaults of installer.engine_options where the request names none."""

    seed: int | None = None
    # OpenAI's logit_bias: (token id, added to its logit before any filter); -100 bans a token, +100 forces it
    logit_bias: tuple[tuple[int, float], ...] = ()

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
ROWS_TOP_K = 256  # the most top-k draw_rows batches


class Sampler:
    def __init__(self, params: SamplingParams, constraint: "Constraint | None" = None) -> None:
        """`constraint`: a grammar the tokens drawn must follow (engine.pipeline.constrain); each draw is then
        made among the tokens it allows, and consumed by it."""
        self.p = params
        self.constraint = constraint
        self.gen = torch.Generator()
        if params.seed is not None:
            self.gen.manual_seed(params.seed)
        else:
            self.gen.seed()

    def _penalize(self, logits: torch.Tensor, history: list[int]) -> torch.Tensor:
        """The logit bias, then the penalties; on the logits' own device (the ids go there, not the logits to the
        host)."""
        p = self.p
        if p.logit_bias:
            ids = torch.tensor([i for i, _ in p.logit_bias], dtype=torch.long).to(
                logits.device, non_blocking=True
            )
            bias = torch.tensor([b for _, b in p.logit_bias], dtype=logits.dtype).to(
                logits.device, non_blocking=True
            )
            logits = logits.index_add(0, ids, bias)
        if p.repeat_penalty == 1 and p.presence_penalty == 0 and p.frequency_penalty == 0:
            return logits
        recent = history if p.repeat_last_n == -1 else history[-p.repeat_last_n :] if p.repeat_last_n else []
        if not recent:
            return logits
        ids, counts = torch.unique(
            torch.tensor(recent, dtype=torch.long).to(logits.device, non_blocking=True), return_counts=True
        )
        sel = logits[ids]
        if p.repeat_penalty != 1:  # as llama.cpp and HF: shrink positive logits, grow negative ones
            sel = torch.where(sel > 0, sel / p.repeat_penalty, sel * p.repeat_penalty)
        sel = sel - counts.float() * p.frequency_penalty - p.presence_penalty
        logits = logits.clone()
        logits[ids] = sel
        return logits

    def sample(self, logits: torch.Tensor, history: list[int]) -> int:
        """logits [V] (any device) -> token id."""
        c = self.constraint
        if c is not None:
            logits = c.mask(logits.float())
        if self.p.greedy:
            token = int(torch.argmax(self._penalize(logits.float(), history)))
        else:
            ids, law = self._kept(logits, history)
            token = int(ids[self.draw(law)])
        if c is not None:
            c.consume(token)
        return token

    def prepare(self, device: torch.device) -> None:
        """The step whose logits this sampler draws from was just queued on `device`: a grammar computes the next
        token's mask now, while the device works (Constraint.prepare)."""
        if self.constraint is not None:
            self.constraint.prepare(device.type == "cuda")

    @property
    def finished(self) -> bool:
        """The constraint's grammar is complete: nothing may follow the last token drawn."""
        return self.constraint is not None and self.constraint.done

    def probs(self, logits: torch.Tensor, history: list[int]) -> torch.Tensor:
        """The distribution `sample` draws from: logits [V] (any device) -> probabilities [V] (float32, CPU).
        Greedy gives the one-hot of the argmax. Speculative sampling compares drafts against it."""
        out = torch.zeros(logits.shape[-1], dtype=torch.float32)
        if self.p.greedy:
            out[int(torch.argmax(self._penalize(logits.float(), history)))] = 1.0
            return out
        ids, law = self._kept(logits, history)
        out[ids] = law
        return out

    def _kept(self, logits: torch.Tensor, history: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The tokens the filters keep and their probabilities (both on the CPU): penalties, top-k, top-p, min-p,
        then temperature, as llama.cpp orders them. The filtering runs where the logits are: on a GPU, only the
        few kept tokens cross to the host (sorting a 150k vocabulary on the CPU took longer than a decode step)."""
        p = self.p
        x = self._penalize(logits.float(), history)
        v = x.shape[-1]
        if 0 < p.top_k < v:
            vals, ids = torch.topk(x, p.top_k)  # sorted, largest first: probabilities within the top k
            return self._filter(vals, ids)
        if p.top_p < 1:
            # No top-k: the nucleus is usually a few dozen tokens, so take the largest in growing batches until
            # they hold top_p of the mass instead of sorting the whole vocabulary.
            norm = torch.logsumexp(x, dim=-1)
            k = 64
            while True:
                vals, ids = torch.topk(x, min(k, v))
                if k >= v or float(torch.exp(vals - norm).sum()) >= p.top_p:
                    break
                k *= 8
            return self._filter(vals, ids, norm)
        return self._filter(x, torch.arange(v, device=x.device))

    def _filter(
        self, vals: torch.Tensor, ids: torch.Tensor, norm: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-p, min-p and temperature on candidates sorted largest first (vals, ids), `norm` the log of the
        total mass top-p measures against (default: the candidates' own) -> the kept ids and their probabilities,
        on the CPU."""
        p = self.p
        if p.top_p < 1:
            pr = torch.exp(vals - (torch.logsumexp(vals, dim=-1) if norm is None else norm))
            # keep the smallest prefix whose mass reaches top_p (always at least one token)
            n = max(1, int(((pr.cumsum(-1) - pr) < p.top_p).sum()))
            vals, ids = vals[:n], ids[:n]
        if p.min_p > 0:
            pr = torch.softmax(vals, dim=-1)
            keep = pr >= p.min_p * pr.max()
            vals, ids = vals[keep], ids[keep]
        law = torch.softmax(vals / p.temperature, dim=-1)
        return ids.cpu(), law.cpu()

    @property
    def plain(self) -> bool:
        """No grammar, bias or penalty, and greedy or a top-k of at most ROWS_TOP_K: a draw needs only the row's
        top tokens, so draw_rows can take it with other rows."""
        p = self.p
        return (
            self.constraint is None
            and not p.logit_bias
            and p.repeat_penalty == 1
            and p.presence_penalty == 0
            and p.frequency_penalty == 0
            and (p.greedy or 0 < p.top_k <= ROWS_TOP_K)
        )

    def draw(self, probs: torch.Tensor) -> int:
        """An index drawn from probabilities (CPU; need not sum to 1), with this sampler's generator: the first
        whose running sum passes a uniform draw times the total (draw_rows makes the same draw on the device)."""
        cdf = probs.float().cumsum(0)
        return min(int((cdf <= self.uniform() * cdf[-1]).sum()), probs.shape[0] - 1)

    def uniform(self) -> float:
        """A draw from U[0, 1) with this sampler's generator (the accept test of speculative sampling)."""
        return float(torch.rand(1, generator=self.gen))


def draw_rows(samplers: list["Sampler"], logits: torch.Tensor) -> torch.Tensor:
    """The next token of each row of logits [R, V], every sampler `plain`, as a long tensor [R] on the logits'
    device, with no wait for the device: greedy rows from one argmax, the others from one top-k over their rows
    and each row's own top-p, min-p and temperature, drawn with a uniform from the row's own generator (the same
    law and draw as Sampler.sample). A step of several slots then waits for the device once, and the tokens can
    feed the next step before the host has read them (BatchRunner's overlap)."""
    x = logits.float()
    out = x.argmax(-1)
    drawn = [j for j, s in enumerate(samplers) if not s.p.greedy]
    if not drawn:
        return out
    dev, v = x.device, x.shape[-1]
    ps = [samplers[j].p for j in drawn]
    at_rows = rows_on(drawn, dev)
    sub = x if len(drawn) == x.shape[0] else x.index_select(0, at_rows)
    vals, ids = torch.topk(sub, min(max(p.top_k for p in ps), v))  # sorted, largest first
    k = vals.shape[-1]
    par = torch.tensor(
        [
            [p.top_k, p.top_p, p.min_p, p.temperature, samplers[j].uniform()]
            for p, j in zip(ps, drawn, strict=True)
        ],
        dtype=torch.float32,
    ).to(dev, non_blocking=True)
    top_k, top_p, min_p, temp, u = (par[:, i : i + 1] for i in range(5))
    col = torch.arange(k, device=dev)
    vals = vals.masked_fill(col >= top_k, float("-inf"))
    pr = torch.softmax(vals, dim=-1)  # top-p against the candidates' own mass, as _filter
    keep = ((pr.cumsum(-1) - pr) < top_p) | (top_p >= 1) | (col == 0)
    vals = vals.masked_fill(~keep, float("-inf"))
    pr = torch.softmax(vals, dim=-1)
    vals = vals.masked_fill(~((pr >= min_p * pr[:, :1]) | (min_p <= 0)), float("-inf"))
    cdf = torch.softmax(vals / temp, dim=-1).cumsum(-1)
    at = (cdf <= u * cdf[:, -1:]).sum(-1, keepdim=True).clamp(max=k - 1)
    return out.index_copy(0, at_rows, ids.gather(1, at)[:, 0])


def rows_on(rows: list[int], device: torch.device) -> torch.Tensor:
    """Row indices as a long tensor on `device`, with no wait for the device: indexing a card's tensor with a
    Python list copies the list there synchronously, which waits for every queued kernel (a whole step)."""
    return torch.tensor(rows, dtype=torch.long).to(device, non_blocking=True)

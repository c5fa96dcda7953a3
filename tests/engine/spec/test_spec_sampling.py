"""Speculative sampling keeps the target's law: chi-square tests (fixed seeds) on a tiny vocabulary, against laws
computed here from the logits with numpy, for deterministic drafts (point masses), for drafts drawn from another
law, and for whole sampled sequences of a toy bigram target drafted by a toy bigram draft layer through `Runner`."""

import itertools

import numpy as np
import torch

from engine.pipeline.generate import DoneEvent, GenerationRequest, Runner
from engine.pipeline.mtp import draft_layer_of
from engine.pipeline.sampling import Sampler, SamplingParams
from engine.pipeline.spec import Draft, SpecConfig, verify
from engine.testing.tokenizer_fixture import tiny_bpe_metadata
from engine.tokenizer import Tokenizer
from tests.engine.spec.toys import BigramToy

PLAIN = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)  # the sampler's law is softmax(logits)
ALPHA = 1e-3


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _chi2_pvalue(counts: np.ndarray, expected_p: np.ndarray) -> float:
    n = counts.sum()
    exp = expected_p * n
    assert exp.min() >= 5, "cells too small for the chi-square approximation"
    stat = float(((counts - exp) ** 2 / exp).sum())
    dof = len(counts) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0), torch.tensor(stat / 2.0)))


LOGITS = np.array([1.2, 0.3, -0.4, 0.9, 0.0, -1.0], dtype=np.float32)
P = _softmax(LOGITS.astype(np.float64))


def test_point_mass_drafts_keep_the_law() -> None:
    """A deterministic draft d is kept with probability p(d), else the token comes from p without d."""
    sampler = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=1234))
    rows = torch.tensor(np.stack([LOGITS, LOGITS]))  # [2, V]: the draft's row and the bonus row
    counts = np.zeros(len(LOGITS))
    kept = 0
    trials = 12000
    for i in range(trials):
        d = (0, 0, 0, 2, 5)[i % 5]  # skewed: a residual that kept d would show
        verdict = verify(rows, Draft([d]), sampler, [0])
        first = d if verdict.accepted else verdict.token
        kept += verdict.accepted
        if not verdict.accepted:
            assert verdict.token != d
        counts[first] += 1
    assert _chi2_pvalue(counts, P) > ALPHA
    # kept with probability p(d)
    mean = (3 * P[0] + P[2] + P[5]) / 5
    sd = np.sqrt(mean * (1 - mean) / trials)
    assert abs(kept / trials - mean) < 5 * sd


def test_drawn_drafts_keep_the_law() -> None:
    """Drafts drawn from q: kept with min(1, p/q), else drawn from the residual max(0, p - q)."""
    q_logits = np.array([0.0, 1.0, 0.5, -0.5, 1.5, 0.2], dtype=np.float32)
    q = torch.tensor(_softmax(q_logits.astype(np.float64)), dtype=torch.float32)
    sampler = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=99))
    drafter = torch.Generator().manual_seed(7)
    rows = torch.tensor(np.stack([LOGITS, LOGITS]))
    counts = np.zeros(len(LOGITS))
    for _ in range(12000):
        d = int(torch.multinomial(q, 1, generator=drafter))
        verdict = verify(rows, Draft([d], q.unsqueeze(0)), sampler, [0])
        counts[d if verdict.accepted else verdict.token] += 1
    assert _chi2_pvalue(counts, P) > ALPHA


def test_sequences_through_runner_keep_the_law() -> None:
    """Three sampled tokens of a bigram target, drafted three at a time by a bigram draft layer of another law:
    the 64 sequences come out with the target's probabilities."""
    gen = np.random.default_rng(5)
    v = 4
    target = gen.normal(0, 0.35, (v, v)).astype(np.float32)
    draft = gen.normal(0, 0.35, (v, v)).astype(np.float32)
    toy = BigramToy(torch.tensor(target), torch.tensor(draft))
    assert draft_layer_of(toy) is toy
    tok = Tokenizer.from_metadata(tiny_bpe_metadata())
    runner = Runner(toy, tok, 16, "f32", 8, spec=SpecConfig(n=3, suffix=False))
    pt = _softmax(target.astype(np.float64))
    expected = np.array([pt[0, a] * pt[a, b] * pt[b, c] for a, b, c in itertools.product(range(v), repeat=3)])
    counts = np.zeros(v**3)
    proposed = accepted = 0
    for seed in range(4000):
        params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=seed)
        req = GenerationRequest([0], max_tokens=3, sampling=params, ignore_eos=True)
        done = [e for e in runner.generate(req) if isinstance(e, DoneEvent)][0]
        a, b, c = done.tokens
        counts[a * v * v + b * v + c] += 1
        proposed += done.timings.drafts_proposed
        accepted += done.timings.drafts_accepted
    assert _chi2_pvalue(counts, expected) > ALPHA
    assert 0 < accepted < proposed  # the draft law differs: some drafts kept, some not

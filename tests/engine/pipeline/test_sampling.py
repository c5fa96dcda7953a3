"""The sampler's law against transformers' logits processors chained in llama.cpp's order (penalties, top-k, top-p,
min-p, then temperature), its draws against that law, seeds, and the same law from logits on the GPU."""

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from engine.pipeline.sampling import Sampler, SamplingParams


def _reference(logits: torch.Tensor, history: list[int], p: SamplingParams) -> torch.Tensor:
    ids = torch.tensor([history])
    s = logits.double().view(1, -1)
    if p.repeat_penalty != 1:
        s = RepetitionPenaltyLogitsProcessor(p.repeat_penalty)(ids, s)
    if p.top_k:
        s = TopKLogitsWarper(p.top_k)(ids, s)
    if p.top_p < 1:
        s = TopPLogitsWarper(p.top_p)(ids, s)
    if p.min_p > 0:
        s = MinPLogitsWarper(p.min_p)(ids, s)
    s = TemperatureLogitsWarper(p.temperature)(ids, s)
    return torch.softmax(s, dim=-1)[0].float()


CASES = [
    SamplingParams(),  # the defaults: top-k 40, top-p 0.95, min-p 0.05, temperature 0.8
    SamplingParams(temperature=1.3, top_k=0, top_p=0.9, min_p=0.0),
    SamplingParams(temperature=0.5, top_k=0, top_p=1.0, min_p=0.1),
    SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0),  # the plain law
    SamplingParams(temperature=0.7, top_k=5, top_p=1.0, min_p=0.0, repeat_penalty=1.3),
]


@pytest.mark.parametrize("params", CASES)
def test_the_law_is_transformers_chain(params: SamplingParams) -> None:
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(3000, generator=gen) * 3
    history = [3, 17, 17, 2999, 40]
    got = Sampler(params).probs(logits, history)
    want = _reference(logits, history, params)
    assert got.shape == want.shape
    assert (got - want).abs().max().item() < 1e-6
    assert abs(got.sum().item() - 1) < 1e-5


def test_draws_follow_the_law_and_seeds_repeat() -> None:
    params = SamplingParams(temperature=1.0, top_k=6, top_p=0.97, min_p=0.0, seed=3)
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])
    law = Sampler(params).probs(logits, [])
    s = Sampler(params)
    n = 20000
    counts = torch.bincount(torch.tensor([s.sample(logits, []) for _ in range(n)]), minlength=8).float()
    assert counts[law == 0].sum() == 0  # filtered tokens never come out
    assert (counts / n - law).abs().max().item() < 0.015  # ~4 standard deviations at these sizes
    again = Sampler(params)
    first = Sampler(params)
    assert [again.sample(logits, []) for _ in range(50)] == [first.sample(logits, []) for _ in range(50)]


def test_greedy_is_the_argmax_after_penalties() -> None:
    logits = torch.tensor([0.0, 5.0, 4.9, 1.0])
    greedy = Sampler(SamplingParams(temperature=0.0))
    assert greedy.sample(logits, [1]) == 1
    penalised = Sampler(SamplingParams(temperature=0.0, repeat_penalty=1.1))
    assert penalised.sample(logits, [1]) == 2  # 5.0 / 1.1 < 4.9
    assert torch.equal(greedy.probs(logits, []), torch.tensor([0.0, 1.0, 0.0, 0.0]))


@pytest.mark.gpu
@pytest.mark.parametrize("params", CASES)
def test_logits_on_the_gpu_give_the_same_law_and_draws(params: SamplingParams) -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    logits = torch.randn(151936, generator=torch.Generator().manual_seed(9)) * 3
    history = [3, 17, 17, 40]
    cpu = Sampler(params).probs(logits, history)
    gpu = Sampler(params).probs(logits.cuda(), history)
    assert gpu.device.type == "cpu" and (gpu - cpu).abs().max().item() < 1e-6
    seeded = SamplingParams(**{**params.__dict__, "seed": 4})
    a, b = Sampler(seeded), Sampler(seeded)
    assert [a.sample(logits, history) for _ in range(20)] == [
        b.sample(logits.cuda(), history) for _ in range(20)
    ]

"""sample_rows: a step's decode rows sampled together give each row's own Sampler.sample."""

import torch

from engine.pipeline.sampling import GREEDY, Sampler, SamplingParams, sample_rows


def test_rows_sampled_together_match_each_rows_own_draw() -> None:
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 1000, generator=gen) * 3
    params = [
        GREEDY,
        SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, seed=11),
        SamplingParams(temperature=1.0, top_k=5, seed=12),
        SamplingParams(temperature=0.7, top_k=0, top_p=0.9, seed=13),  # no top-k: alone
        SamplingParams(temperature=0.0, repeat_penalty=1.3),  # a penalty: alone
        SamplingParams(temperature=1.2, top_k=256, min_p=0.1, seed=14),
    ]
    together = [Sampler(p) for p in params]
    alone = [Sampler(p) for p in params]
    for _ in range(5):  # several steps: the seeded generators advance alike
        got = sample_rows(together, logits)
        assert [g is None for g in got] == [False, False, False, True, True, False]
        want = [s.sample(logits[j], [1, 2, 3]) for j, s in enumerate(alone)]
        assert [g for g in got if g is not None] == [
            w for g, w in zip(got, want, strict=True) if g is not None
        ]
        logits = logits.roll(7, dims=-1)
    assert sample_rows([], logits[:0]) == []

"""draw_rows: a step's plain decode rows drawn together on the logits' device give each row's own Sampler.sample."""

import torch

from engine.pipeline.sampling import GREEDY, Sampler, SamplingParams, draw_rows


def test_rows_drawn_together_match_each_rows_own_draw() -> None:
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
    assert [s.plain for s in together] == [True, True, True, False, False, True]
    rows = [j for j, s in enumerate(together) if s.plain]
    for _ in range(5):  # several steps: the seeded generators advance alike
        got = draw_rows([together[j] for j in rows], logits[rows])
        assert got.dtype == torch.long and got.device == logits.device
        assert got.tolist() == [alone[j].sample(logits[j], [1, 2, 3]) for j in rows]
        logits = logits.roll(7, dims=-1)
    greedy = draw_rows([Sampler(GREEDY)] * 3, logits[:3])
    assert greedy.tolist() == logits[:3].argmax(-1).tolist()

"""logit_bias in the sampler: +100 forces a token, -100 bans it, greedy or drawn, and a greedy verify window goes
through the bias too (one argmax over the raw logits would skip it)."""

import torch

from engine.pipeline.sampling import Sampler, SamplingParams
from engine.pipeline.spec import Draft, verify

LOGITS = torch.tensor([0.0, 3.0, 2.5, 1.0, -1.0])


def test_a_bias_forces_or_bans_a_token() -> None:
    assert Sampler(SamplingParams(temperature=0.0)).sample(LOGITS, []) == 1
    assert Sampler(SamplingParams(temperature=0.0, logit_bias=((4, 100.0),))).sample(LOGITS, []) == 4
    assert Sampler(SamplingParams(temperature=0.0, logit_bias=((1, -100.0),))).sample(LOGITS, []) == 2
    drawn = {
        Sampler(
            SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=s, logit_bias=((1, -100.0),))
        ).sample(LOGITS, [])
        for s in range(200)
    }
    assert 1 not in drawn and len(drawn) > 1


def test_a_greedy_window_is_verified_through_the_bias() -> None:
    rows = torch.stack(
        [LOGITS, LOGITS]
    )  # the window's rows: the draft (token 1, the raw argmax), then the next
    sampler = Sampler(SamplingParams(temperature=0.0, logit_bias=((1, -100.0),)))
    v = verify(rows, Draft([1], None, 1), sampler, [7])
    assert v.accepted == 0 and v.token == 2

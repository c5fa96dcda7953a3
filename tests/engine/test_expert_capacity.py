"""The VRAM slots' plan per layer (engine/experts/capacity.py): pure, checked against brute force."""

import itertools

import numpy as np
import pytest
import torch

from engine.experts.capacity import PRIOR_TOKENS, layer_costs, plan_capacity


def _total(cap: dict[int, int], profile: torch.Tensor, top_k: int) -> float:
    out = 0.0
    for li, c in cap.items():
        counts = profile[li].double().numpy() + PRIOR_TOKENS * top_k / profile.shape[1]
        out += layer_costs(counts * top_k / counts.sum())[c]
    return out


def test_layer_cost_counts_the_misses_and_the_chance_of_any() -> None:
    cost = layer_costs(np.array([0.5, 0.25, 0.25, 0.0]), layer_cost=2.0)
    assert cost[4] == 0.0 and cost[3] == 0.0  # the last expert is never picked
    assert cost[2] == pytest.approx(0.25 + 2.0 * 0.25)
    assert cost[1] == pytest.approx(0.5 + 2.0 * (1 - 0.75 * 0.75))
    assert cost[0] == pytest.approx(1.0 + 2.0 * (1 - 0.5 * 0.75 * 0.75))
    assert all(np.diff(cost) <= 0)  # a slot more never costs more


@pytest.mark.parametrize("seed", range(6))
def test_the_plan_costs_least_of_every_plan_within_the_budget(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    profile = torch.randint(0, 20, (3, 5), generator=g) ** 2
    budget = int(torch.randint(1, 15, (1,), generator=g))
    cap = plan_capacity({0: 10, 1: 10, 2: 10}, 5, budget * 10, profile, top_k=2)
    assert sum(cap.values()) <= budget
    best = min(
        _total(dict(enumerate(c)), profile, 2)
        for c in itertools.product(range(6), repeat=3)
        if sum(c) <= budget
    )
    assert _total(cap, profile, 2) == pytest.approx(best)


def test_near_uniform_routing_gathers_the_misses_in_whole_layers() -> None:
    g = torch.Generator().manual_seed(0)
    profile = 1000 + torch.randint(0, 30, (8, 64), generator=g)  # every expert about as likely
    cap = plan_capacity(dict.fromkeys(range(8), 100), 64, 100 * 64 * 6, profile, top_k=8)
    assert sorted(cap.values()) == [0, 0, 64, 64, 64, 64, 64, 64]
    spread = plan_capacity(dict.fromkeys(range(8), 100), 64, 100 * 64 * 6, profile, top_k=8, layer_cost=None)
    assert max(spread.values()) < 64  # the hottest pairs alone spread them over every layer
    assert _total(cap, profile, 8) < _total(spread, profile, 8)


def test_skewed_routing_keeps_each_layers_hot_experts() -> None:
    profile = torch.ones(4, 32)
    profile[:, :4] = 1000  # four experts take almost every pick in each layer
    cap = plan_capacity(dict.fromkeys(range(4), 100), 32, 100 * 16, profile, top_k=4)
    assert cap == dict.fromkeys(range(4), 4)


def test_budget_widths_and_slot_limits_hold() -> None:
    profile = torch.ones(3, 8)
    widths = {0: 100, 1: 250, 2: 100}  # a layer of a wider type
    cap = plan_capacity(widths, 8, 1500, profile, top_k=2)
    assert 1500 - 100 < sum(c * widths[li] for li, c in cap.items()) <= 1500  # the wider layer's units filled
    cap = plan_capacity(widths, 8, 10_000, profile, max_pairs=5, top_k=2)
    assert sum(cap.values()) <= 5
    assert plan_capacity(widths, 8, 10**6, profile) == dict.fromkeys(range(3), 8)
    assert plan_capacity(widths, 8, 0, profile) == dict.fromkeys(range(3), 0)
    assert plan_capacity({0: 100, 1: 100}, 4, 500, None, top_k=2) == {0: 4, 1: 1}  # no profile: in order


def test_a_short_profile_still_fills_the_budget() -> None:
    """A chat's first profile names few experts a layer; the slots beyond them still fill the budget (the prior
    keeps every expert possible), as many as the budget holds."""
    profile = torch.zeros(4, 64)
    profile[:, :8] = 500  # the same 8 experts a layer, nothing else seen
    cap = plan_capacity(dict.fromkeys(range(4), 100), 64, 100 * 100, profile, top_k=8)
    assert sum(cap.values()) == 100 and min(cap.values()) >= 8

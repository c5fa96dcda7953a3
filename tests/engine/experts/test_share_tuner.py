"""The tuner of the CPU's share of decode misses (engine/experts/share_tuner.py) on step times from a model of a
machine: the step is slowest far from the share where the CPU and PCIe sides take as long, plus noise."""

import random
from collections.abc import Callable

from engine.experts import share_tuner as st
from engine.experts.share_tuner import ShareTuner

Cost = Callable[[float, int], float]


def _v(best: float, slope: float = 0.02, base: float = 0.011) -> Cost:
    return lambda r, _n: base + slope * abs(r - best)


def _run(t: ShareTuner, cost: Cost, steps: int, noise: float = 2e-4, seed: int = 0) -> list[float]:
    """Steps at the shares the tuner gives; -> the share of each step."""
    rng = random.Random(seed)
    shares = []
    for n in range(steps):
        r = t.current()
        shares.append(r)
        t.observe(max(1e-4, cost(r, n) + rng.gauss(0.0, noise)))
    return shares


def test_walks_to_the_fastest_share_and_holds_it() -> None:
    t = ShareTuner(0.5)
    shares = _run(t, _v(0.62), 1500)
    assert t.ratio == 0.6 and t.holding
    assert [r for r, _ in t.decisions][:3] == [0.6, 0.6, 0.6]
    settled = shares.index(0.6, 48 * 3)  # three comparisons of 48 steps: moved, then won twice
    assert set(shares[settled + 1 :]) == {0.6}  # held: no more neighbours tried


def test_walks_down_when_the_cpu_is_slow() -> None:
    t = ShareTuner(0.5)
    _run(t, _v(0.28), 1500)
    assert t.ratio == 0.3


def test_stays_at_the_best_and_explores_only_until_settled() -> None:
    t = ShareTuner(0.6)
    shares = _run(t, _v(0.6), 1000)
    assert [r for r, _ in t.decisions] == [0.6, 0.6]
    assert t.holding
    n = st.TURN * st.TURNS * 3
    assert set(shares[2 * n :]) == {0.6}
    assert shares[:n].count(0.6) == n // 3  # each arm ran a third of the comparison


def test_noise_and_a_flat_cost_do_not_move_it() -> None:
    """No share is faster by MIN_GAIN: it stays, also with a drift (a context that grows) under the noise."""
    t = ShareTuner(0.5)
    _run(t, lambda _r, n: 0.011 + 2e-6 * n, 400, noise=1e-4, seed=3)
    assert {r for r, _ in t.decisions} == {0.5}


def test_pauses_between_requests_are_not_steps() -> None:
    t = ShareTuner(0.5)
    cost = _v(0.62)
    rng = random.Random(1)
    for n in range(1500):
        r = t.current()
        if n % 37 == 0:
            t.observe(5.0)  # an idle pause, or a prompt read between two requests' decodes
        else:
            t.observe(cost(r, n) + rng.gauss(0.0, 2e-4))
    assert t.ratio == 0.6


def test_looks_again_after_holding_when_the_machine_changed() -> None:
    t = ShareTuner(0.5)
    _run(t, _v(0.62), 600)
    assert t.ratio == 0.6 and t.holding
    _run(t, _v(0.3), st.HOLD + 1000, seed=2)  # another program now loads the CPU
    assert t.ratio == 0.3


def test_arms_stay_within_zero_and_one() -> None:
    t = ShareTuner(0.0)
    assert t.arms == [0.0, 0.1]
    _run(t, _v(0.0), 300)
    assert t.ratio == 0.0
    t = ShareTuner(1.0)
    assert t.arms == [1.0, 0.9]


def _joint(turns: tuple[int, int], steps: int = 4000) -> tuple[float, float]:
    """Two cards of one split tuning on the same step time: card A's best share is 0.6, card B's 0.3."""
    a, b = ShareTuner(0.5, turn=turns[0]), ShareTuner(0.5, turn=turns[1])
    rng = random.Random(4)
    for _ in range(steps):
        ra, rb = a.current(), b.current()
        t = 0.02 + 0.02 * abs(ra - 0.6) + 0.02 * abs(rb - 0.3) + rng.gauss(0.0, 2e-4)
        a.observe(t)
        b.observe(t)
    return a.ratio, b.ratio


def test_the_tuners_of_a_split_nest_their_turns() -> None:
    assert [st.nested_turn(i) for i in range(4)] == [4, 12, 36, 36]
    assert _joint((st.nested_turn(0), st.nested_turn(1))) == (0.6, 0.3)
    # in lockstep, one card's better share arrives with the other's worse one: they cancel, and neither moves
    assert _joint((4, 4)) == (0.5, 0.5)

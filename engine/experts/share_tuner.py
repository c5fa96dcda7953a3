"""The CPU's share of a decode step's missed experts, tuned while serving (the default of `--cpu-ratio`).

The share that makes steps fastest is where the CPU's experts (host RAM's bandwidth, its cores) take as long as the
GPU's copies over PCIe, and it moves with the machine and its load: on an H200's host, 5 of 8 misses read 97 tok/s
in one process and 69 in another, where 4 of 8 read 88 and 86. So the tuner measures. It runs the current share
and its two neighbours (one step of `DELTA` either side) in turns of a few decode steps each, compares the median
step time of each, and moves to the fastest; once the current share wins twice in a row it holds it for `HOLD`
steps and then looks again. Running the arms in alternating turns, not one after the other, keeps a slow drift
(a growing context, another program) from favouring one of them.

Several cards of one process (a layer split) each tune their own share on the same step time. Their turns are
nested (`turn`: 4 steps for the first tuner, 12 for the second, 36 for a third), so that each arm of one tuner runs
under every arm of the others in equal measure: with equal turns the arms would change in lockstep, and a card's
better share could be masked by another card's worse one at the same moment.

Pure logic on the step times it is given: engine/experts/cpu_misses.py times the steps and applies the share."""

from dataclasses import dataclass, field
from statistics import median

DELTA = 0.1  # one step of the search: ~1 of 8 misses at Qwen3's 8 experts a token
TURN = (
    4  # decode steps an arm runs per turn; the first of them is not timed (it may have read the last quota)
)
TURNS = 4  # turns per arm before the arms are compared
HOLD = 4096  # steps the share is held once settled, before it is looked at again
GAP = 3.0  # a step longer than this times the last comparison's best median is a pause between requests: ignored
MAX_STEP_S = 1.0  # the same before the first comparison
MIN_GAIN = 0.01  # a neighbour must be this much faster (median step time) to be taken


@dataclass(eq=False)  # identity: the live tuners of a process are kept in a weak set
class ShareTuner:
    ratio: float
    turn: int = TURN  # steps per turn (tuners of one process: TURN x 3^i, `nested_turn`)
    lo: float = 0.0
    hi: float = 1.0
    arms: list[float] = field(default_factory=list)
    times: dict[float, list[float]] = field(default_factory=dict)
    step: int = 0  # steps into the current comparison (or hold)
    settled: int = 0  # comparisons in a row the current share won
    holding: bool = False
    best_median: float = 0.0
    decisions: list[tuple[float, float]] = field(
        default_factory=list
    )  # (share taken, its median step seconds)

    def __post_init__(self) -> None:
        self._start()

    def _start(self) -> None:
        r = self.ratio
        arms = [r, round(max(self.lo, r - DELTA), 3), round(min(self.hi, r + DELTA), 3)]
        self.arms = list(dict.fromkeys(arms))
        self.times = {a: [] for a in self.arms}
        self.step = 0

    def current(self) -> float:
        """The share the next steps should run with."""
        if self.holding:
            return self.ratio
        return self.arms[(self.step // self.turn) % len(self.arms)]

    def observe(self, seconds: float) -> float:
        """A decode step took `seconds` (at the share `current()` gave before it); -> the share for the next."""
        if self.holding:
            self.step += 1
            if self.step >= HOLD:
                self.holding = False
                self._start()
            return self.current()
        if seconds > (GAP * self.best_median if self.best_median else MAX_STEP_S):
            return self.current()  # a pause between requests (or a prompt), not a step: the turn goes on
        arm = self.current()
        if self.step % self.turn:
            self.times[arm].append(seconds)
        self.step += 1
        if self.step >= self.turn * TURNS * len(self.arms):
            self._decide()
        return self.current()

    def _decide(self) -> None:
        med = {a: median(t) for a, t in self.times.items() if t}
        here = med.get(self.ratio)
        best = min(med, key=lambda a: med[a])
        if here is None or (best != self.ratio and med[best] < here * (1 - MIN_GAIN)):
            self.ratio, self.settled = best, 0
        else:
            self.settled += 1
        self.best_median = med[self.ratio] if self.ratio in med else med[best]
        self.decisions.append((self.ratio, self.best_median))
        if self.settled >= 2:
            self.holding, self.settled = True, 0
            self.step = 0
        else:
            self._start()


def nested_turn(index: int) -> int:
    """The turn of the index-th tuner alive in a process (0 for the first): TURN x 3^index, three arms per turn of
    the one before it; past the third, the third's (the design is balanced for three cards, close for more)."""
    return TURN * 3 ** min(index, 2)

"""The built-in `chain` task: long worked answers whose length is a knob.

    Start at 4 and add 7, 5 times. What number do you reach?
    5 left: 4 + 7 = 11
    4 left: 11 + 7 = 18
    3 left: 18 + 7 = 25
    2 left: 25 + 7 = 32
    1 left: 32 + 7 = 39
    #### 39

One line per addition, counting down the additions left, so the answer is
`times` lines long (about 10 tokens each with the tiny policy's tokenizer)
while every line depends only on the one before it (the countdown makes the
stop local: the answer follows "1 left") and the first on the question: a
~1M-parameter decoder can learn it, and its mistakes (a carry, a miscount)
compound with length, as a long chain of thought's do. (Numbering the lines
upwards instead left the stop to a comparison with the question's count,
which a first tiny policy never learned: it added on past the last line.) It exists for the answer-length study
(docs/precision-study.md, part 4): the off-policy drift of an FP8 rollout grows
with the number of sampled tokens, and here that number is set by
`min_times`/`max_times` while the skill stays the same.

Train and test are split by a hash of the skeleton (start, addend, times): a
held-out problem's computation never appears in training, at any length.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, fields
from typing import Any, Iterator

from fp8rl.tasks import Problem, coerce, held_out, train_stream
from fp8rl.tasks.rewards import reward as final_answer_reward
from fp8rl.tasks.rewards import steps_reward

# {a} start, {b} addend, {n} times. A few phrasings, so the question is read, not matched.
QUESTIONS = (
    "Start at {a} and add {b}, {n} times. What number do you reach?",
    "A counter shows {a}. It goes up by {b} each tick, for {n} ticks. What does it show at the end?",
    "A jar has {a} coins. Each day {b} more coins go in, for {n} days. How many coins are in the jar?",
)

TEST_SEED = "fp8rl-chain-test"


@dataclass(frozen=True)
class ChainTask:
    """Knobs of the `chain` task.

    min_times, max_times: additions per problem (answer lines), drawn uniformly.
    max_start:            start values are drawn from 1..max_start.
    max_add:              addends are drawn from 1..max_add.
    test_fraction:        share of skeletons (start, addend, times) held out.
    check_steps:          the RL reward also requires every line's sum to be right
                          (`rewards.steps_reward`); False = final answer only.
    """

    min_times: int = 4
    max_times: int = 40
    max_start: int = 9
    max_add: int = 9
    test_fraction: float = 0.1
    check_steps: bool = True
    name: str = "chain"

    def __post_init__(self) -> None:
        if not 1 <= self.min_times <= self.max_times:
            raise ValueError(f"chain: need 1 <= min_times <= max_times, got {self.min_times}, {self.max_times}")
        if self.max_start < 1 or self.max_add < 1:
            raise ValueError(f"chain: max_start and max_add must be >= 1, got {self.max_start}, {self.max_add}")
        if not 0.0 < self.test_fraction < 1.0:
            raise ValueError(f"chain: test_fraction must be in (0, 1), got {self.test_fraction}")

    @classmethod
    def from_options(cls, options: dict[str, Any]) -> "ChainTask":
        """Build from spec options (strings) or keyword arguments, checking names and types."""
        knobs = {f.name: f.default for f in fields(cls) if f.name != "name"}
        unknown = set(options) - set(knobs)
        if unknown:
            raise ValueError(f"chain: unknown knob(s) {sorted(unknown)}; valid: {sorted(knobs)}")
        return cls(**{k: coerce(v, knobs[k], f"chain: {k}") for k, v in options.items()})

    def _draw(self, rng: random.Random) -> tuple[Problem, str]:
        """One random problem and its skeleton key, e.g. "14+7x5"."""
        a = rng.randint(1, self.max_start)
        b = rng.randint(1, self.max_add)
        n = rng.randint(self.min_times, self.max_times)
        question = rng.choice(QUESTIONS).format(a=a, b=b, n=n)
        lines, value = [], a
        for left in range(n, 0, -1):
            lines.append(f"{left} left: {value} + {b} = {value + b}")
            value += b
        lines.append(f"#### {value}")
        return Problem(question=question, solution="\n".join(lines), answer=str(value)), f"{a}+{b}x{n}"

    def train_problems(self, seed: int) -> Iterator[Problem]:
        """Endless stream of training problems; the same seed gives the same stream."""
        return train_stream(self._draw, seed, self.test_fraction, f"chain: knobs {self.describe()}")

    def test_problems(self, n: int) -> list[Problem]:
        """The first `n` distinct held-out problems (fewer only if the knobs allow fewer)."""
        return held_out(self._draw, n, self.test_fraction, TEST_SEED)

    def describe(self) -> dict[str, Any]:
        return asdict(self)

    def reward(self, completion: str, problem: Problem) -> float:
        if self.check_steps:
            return steps_reward(completion, problem.answer)
        return final_answer_reward(completion, problem.answer)

"""The built-in `arith` task: short multi-step arithmetic word problems in GSM8K form.

    Mia has 8 apples. She buys 7 more. She gives away 5. How many apples does Mia have now?
    8 + 7 = 15
    15 - 5 = 10
    #### 10

Texts are kept short and numbers small on purpose: a ~1-3M parameter
transformer trained for a few minutes on a CPU should solve a fair share of
held-out problems (not all), which leaves room for RL to show an improvement.

Train and test are split by a hash of the problem's arithmetic skeleton (start
value, then each operator and operand, e.g. "12+7-5"): a held-out problem's
computation never appears in training, whatever names or objects dress it.
"""

from __future__ import annotations

import math
import operator
import random
from dataclasses import asdict, dataclass, fields
from typing import Any, Iterator

from fp8rl.tasks import Problem, coerce, held_out, train_stream
from fp8rl.tasks.rewards import MAX_DIGITS
from fp8rl.tasks.rewards import reward as final_answer_reward
from fp8rl.tasks.rewards import steps_reward

NAMES = (
    ("Mia", "She"), ("Tom", "He"), ("Ana", "She"), ("Ben", "He"), ("Zoe", "She"),
    ("Sam", "He"), ("Lily", "She"), ("Max", "He"), ("Emma", "She"), ("Leo", "He"),
)
OBJECTS = ("apples", "pens", "cards", "stamps", "shells", "books", "coins", "marbles", "eggs", "toys")

# One template per story; each operator has a few phrasings for variety.
# Placeholders: {n} name, {p} pronoun, {o} object, {a} start value, {b} operand.
TEMPLATES: tuple[dict[str, Any], ...] = (
    {
        "start": "{n} has {a} {o}.",
        "+": ("{p} buys {b} more.", "{p} finds {b} more.", "{p} gets {b} more."),
        "-": ("{p} gives away {b}.", "{p} loses {b}.", "{p} sells {b}."),
        "*": ("{p} ends up with {b} times as many.",),
        "ask": "How many {o} does {n} have now?",
    },
    {
        "start": "A box has {a} {o}.",
        "+": ("{n} puts in {b} more.", "{n} adds {b}."),
        "-": ("{n} takes out {b}.", "{n} removes {b}."),
        "*": ("Then there are {b} times as many.",),
        "ask": "How many {o} are in the box now?",
    },
    {
        "start": "{n} has {a} dollars.",
        "+": ("{p} earns {b} more.", "{p} is given {b} more."),
        "-": ("{p} spends {b}.", "{p} pays {b} for lunch."),
        "*": ("{p} ends up with {b} times as much.",),
        "ask": "How many dollars does {n} have now?",
    },
    {
        "start": "A bus has {a} people.",
        "+": ("{b} more get on.",),
        "-": ("{b} get off.",),
        "*": ("Then there are {b} times as many.",),
        "ask": "How many people are on the bus now?",
    },
)

_APPLY = {"+": operator.add, "-": operator.sub, "*": operator.mul}

# Seed of the held-out stream; any value works since the hash split keeps it disjoint.
TEST_SEED = "fp8rl-arith-test"


@dataclass(frozen=True)
class ArithTask:
    """Difficulty knobs of the synthetic arithmetic task.

    steps:          operations per problem (one solution line each).
    max_operand:    start values and +/- operands are drawn from 1..max_operand.
    max_factor:     `*` operands are drawn from 2..max_factor.
    ops:            allowed operators, a subset of "+-*".
    allow_negative: let subtraction go below zero (default: answers are >= 0).
    test_fraction:  share of arithmetic skeletons reserved for the test split.
    check_steps:    the RL reward also requires every worked step to be right
                    (`rewards.steps_reward`); False = final answer only.
    """

    steps: int = 2
    max_operand: int = 10
    max_factor: int = 3
    ops: str = "+-*"
    allow_negative: bool = False
    test_fraction: float = 0.1
    check_steps: bool = True
    name: str = "arith"

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"arith: steps must be >= 1, got {self.steps}")
        if self.max_operand < 1:
            raise ValueError(f"arith: max_operand must be >= 1, got {self.max_operand}")
        if self.max_factor < 2:
            raise ValueError(f"arith: max_factor must be >= 2, got {self.max_factor}")
        if not self.ops or set(self.ops) - set("+-*"):
            raise ValueError(f"arith: ops must be a non-empty subset of '+-*', got {self.ops!r}")
        if not 0.0 < self.test_fraction < 1.0:
            raise ValueError(f"arith: test_fraction must be in (0, 1), got {self.test_fraction}")
        digits = self.max_answer_digits()
        if digits > MAX_DIGITS:
            raise ValueError(
                f"arith: steps, max_operand and max_factor allow answers of up to ~{digits} digits; "
                f"the reward reads numbers of at most {MAX_DIGITS} digits"
            )

    def max_answer_digits(self) -> int:
        """An upper bound on the digits of any answer (or intermediate result).

        Every value v has |v| <= B, where B starts at max_operand and each step
        turns it into B + max_operand <= 2B (+, -) or B * max_factor (*). So
        B <= max_operand * max_factor**steps when "*" is allowed (max_factor >= 2),
        else B <= max_operand * (steps + 1)."""
        if "*" in self.ops:
            log_bound = math.log10(self.max_operand) + self.steps * math.log10(self.max_factor)
        else:
            log_bound = math.log10(self.max_operand * (self.steps + 1))
        return math.floor(log_bound) + 1

    @classmethod
    def from_options(cls, options: dict[str, Any]) -> "ArithTask":
        """Build from spec options (strings) or keyword arguments, checking names and types."""
        knobs = {f.name: f.default for f in fields(cls) if f.name != "name"}
        unknown = set(options) - set(knobs)
        if unknown:
            raise ValueError(f"arith: unknown knob(s) {sorted(unknown)}; valid: {sorted(knobs)}")
        return cls(**{k: coerce(v, knobs[k], f"arith: {k}") for k, v in options.items()})

    def _draw(self, rng: random.Random) -> tuple[Problem, str] | None:
        """One random problem and its skeleton key, or None on a dead end
        (only '-' allowed and the count already at zero)."""
        template = rng.choice(TEMPLATES)
        name, pronoun = rng.choice(NAMES)
        obj = rng.choice(OBJECTS)
        value = rng.randint(1, self.max_operand)
        sentences = [template["start"].format(n=name, a=value, o=obj)]
        lines, key = [], str(value)
        for _ in range(self.steps):
            ops = [op for op in self.ops if op != "-" or self.allow_negative or value >= 1]
            if not ops:
                return None
            op = rng.choice(ops)
            if op == "*":
                operand = rng.randint(2, self.max_factor)
            elif op == "-" and not self.allow_negative:
                operand = rng.randint(1, min(value, self.max_operand))
            else:
                operand = rng.randint(1, self.max_operand)
            phrase = rng.choice(template[op])
            sentences.append(phrase.format(n=name, p=pronoun, b=operand))
            result = _APPLY[op](value, operand)
            lines.append(f"{value} {op} {operand} = {result}")
            key += f"{op}{operand}"
            value = result
        sentences.append(template["ask"].format(n=name, o=obj))
        lines.append(f"#### {value}")
        problem = Problem(question=" ".join(sentences), solution="\n".join(lines), answer=str(value))
        return problem, key

    def train_problems(self, seed: int) -> Iterator[Problem]:
        """Endless stream of training problems; the same seed gives the same stream."""
        return train_stream(self._draw, seed, self.test_fraction, f"arith: knobs {self.describe()}")

    def test_problems(self, n: int) -> list[Problem]:
        """The first `n` distinct held-out problems (fewer only if the knobs allow fewer)."""
        return held_out(self._draw, n, self.test_fraction, TEST_SEED)

    def describe(self) -> dict[str, Any]:
        return asdict(self)

    def reward(self, completion: str, problem: Problem) -> float:
        if self.check_steps:
            return steps_reward(completion, problem.answer)
        return final_answer_reward(completion, problem.answer)

"""Math tasks with verifiable answers: what the policy is asked, and what counts as right.

A task hands out `Problem`s in GSM8K form: a question, a worked solution whose
last line is `#### N`, and the canonical final answer `N`. Four sources:

    make_task("arith")                           built-in synthetic arithmetic (default)
    make_task("arith:steps=3,max_operand=50")    ... with difficulty knobs
    make_task("chain:min_times=28,max_times=36") built-in long worked answers (length is the knob)
    make_task("gsm8k:data/train.jsonl")          a GSM8K-format JSONL or Parquet file
    make_task("gsm8k:train.jsonl,test=test.jsonl")
    make_task("reasoning-gym:gsm_symbolic")      a reasoning-gym generator (optional extra)

Every task keeps its held-out problems disjoint from its training stream, so
`test_problems` measures generalisation, not memory. Rewards live in
`fp8rl.tasks.rewards`.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Protocol, runtime_checkable


@dataclass(frozen=True)
class Problem:
    """One question with its worked solution and final answer.

    `solution` ends with the line `#### {answer}` (the GSM8K convention), so SFT
    on `question + solution` teaches exactly the format the reward reads.
    `answer` is canonical: no thousands commas, no units, e.g. "42", "-3", "7/2".
    """

    question: str
    solution: str
    answer: str

    def __post_init__(self) -> None:
        if not self.solution.endswith(f"#### {self.answer}"):
            raise ValueError(
                f"solution must end with '#### {self.answer}', got ...{self.solution[-40:]!r}"
            )


@runtime_checkable
class Task(Protocol):
    """What the trainer, `fp8rl eval` and `fp8rl sft` need from a task."""

    name: str

    def train_problems(self, seed: int) -> Iterator[Problem]:
        """An endless stream of training problems; same seed, same stream."""
        ...

    def test_problems(self, n: int) -> list[Problem]:
        """Up to `n` held-out problems, always the same ones, never in the train stream."""
        ...

    def describe(self) -> dict[str, Any]:
        """JSON-ready settings, written into a run's config.json."""
        ...

    def reward(self, completion: str, problem: Problem) -> float:
        """The RL reward of one completion (1.0 or 0.0)."""
        ...


def in_test_split(key: str, test_fraction: float) -> bool:
    """Deterministic train/test partition by a hash of `key`.

    A stable hash (not Python's salted `hash`) puts every key on the same side
    in every process and every run, so generated test and train streams are
    disjoint by construction, whatever their seeds or lengths.
    """
    digest = hashlib.blake2b(key.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0**64 < test_fraction


# A generated task's draw: one random problem and its skeleton key (what the split
# hashes), or None on a dead end of the knobs.
Draw = Callable[[random.Random], "tuple[Problem, str] | None"]


def train_stream(draw: Draw, seed: int, test_fraction: float, what: str) -> Iterator[Problem]:
    """Endless stream of `draw`'s problems outside the test split; the same seed
    gives the same stream. `what` names the task and its knobs in the error
    raised when 10,000 draws in a row find no training problem."""
    rng = random.Random(seed)
    misses = 0
    while True:
        drawn = draw(rng)
        if drawn is None or in_test_split(drawn[1], test_fraction):
            misses += 1
            if misses > 10_000:
                raise RuntimeError(f"{what} leave no training problems")
            continue
        misses = 0
        yield drawn[0]


def held_out(draw: Draw, n: int, test_fraction: float, test_seed: str) -> list[Problem]:
    """The first `n` distinct (by question) problems of the test split drawn from
    `random.Random(test_seed)`; fewer only if the knobs allow fewer (a long run of
    draws with nothing new)."""
    rng = random.Random(test_seed)
    found: dict[str, Problem] = {}
    misses = 0
    while len(found) < n and misses < 10_000:
        drawn = draw(rng)
        if drawn is None or not in_test_split(drawn[1], test_fraction) or drawn[0].question in found:
            misses += 1
        else:
            found[drawn[0].question] = drawn[0]
            misses = 0
    return list(found.values())


def parse_value(text: str) -> bool | int | float | str:
    """Guess the type of a spec value: true/false, an int, a float, else the string."""
    lowered = text.strip().lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    for convert in (int, float):
        try:
            return convert(text)
        except ValueError:
            continue
    return text.strip()


def coerce(value: Any, like: Any, what: str) -> Any:
    """Give `value` the type of `like` (a knob's default): spec strings are
    converted ("3" -> 3, "false" -> False), typed values are checked."""
    kind = type(like)
    converted = parse_value(value) if isinstance(value, str) and kind is not str else value
    if kind is float and type(converted) is int:
        converted = float(converted)
    if type(converted) is not kind:
        raise ValueError(f"{what} must be {kind.__name__}, got {value!r}")
    return converted


def parse_options(text: str, spec: str) -> dict[str, str]:
    """Parse `key=val,key=val` (the part of a spec after the colon) into strings."""
    options: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"task spec {spec!r}: expected key=value, got {item!r}")
        options[key.strip()] = value.strip()
    return options


SPEC_FORMS = (
    "arith",
    "arith:key=val,...  (knobs: steps, max_operand, max_factor, ops, allow_negative, test_fraction)",
    "chain:key=val,...  (knobs: min_times, max_times, max_start, max_add, test_fraction, check_steps)",
    "gsm8k:PATH[,test=TEST_PATH][,test_fraction=F][,strip_calculator=false]  (PATH: .jsonl or .parquet)",
    "reasoning-gym:NAME[,key=val,...]  (needs pip install fp8rl[reasoning-gym])",
)


GSM8K_OPTIONS = {"test": "", "test_fraction": 0.1, "strip_calculator": True}


def make_task(spec: str, **kwargs: Any) -> Task:
    """Build a task from a command-line spec such as `arith:steps=3` or `gsm8k:train.jsonl`.

    Keyword arguments (already typed) add to and override the spec's options.
    """
    kind, _, rest = spec.partition(":")
    kind = kind.strip()
    if kind == "arith":
        from fp8rl.tasks.arithmetic import ArithTask

        return ArithTask.from_options({**parse_options(rest, spec), **kwargs})
    if kind == "chain":
        from fp8rl.tasks.chain import ChainTask

        return ChainTask.from_options({**parse_options(rest, spec), **kwargs})
    if kind == "gsm8k":
        from fp8rl.tasks.gsm8k import load_gsm8k

        path, _, opts = rest.partition(",")
        if not path.strip():
            raise ValueError(f"task spec {spec!r} needs a file: gsm8k:PATH")
        options = parse_options(opts, spec)
        unknown = (set(options) | set(kwargs)) - set(GSM8K_OPTIONS)
        if unknown:
            raise ValueError(f"gsm8k: unknown option(s) {sorted(unknown)}; valid: {sorted(GSM8K_OPTIONS)}")
        typed = {k: coerce(v, GSM8K_OPTIONS[k], f"gsm8k: {k}") for k, v in options.items()}
        return load_gsm8k(path.strip(), **{**typed, **kwargs})
    if kind == "reasoning-gym":
        from fp8rl.tasks.reasoning_gym import ReasoningGymTask

        name, _, opts = rest.partition(",")
        if not name.strip():
            raise ValueError(f"task spec {spec!r} needs a dataset name: reasoning-gym:NAME")
        options = {k: parse_value(v) for k, v in parse_options(opts, spec).items()}
        return ReasoningGymTask.from_options(name.strip(), {**options, **kwargs})
    raise ValueError(f"unknown task spec {spec!r}; valid forms: " + " | ".join(SPEC_FORMS))


__all__ = ["Problem", "Task", "make_task", "in_test_split", "coerce", "SPEC_FORMS"]

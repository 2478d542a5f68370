"""reasoning-gym generators as tasks (optional extra: pip install fp8rl[reasoning-gym]).

    make_task("reasoning-gym:gsm_symbolic")
    make_task("reasoning-gym:basic_arithmetic,min_terms=2,max_terms=3")

Options other than `test_fraction` go to `reasoning_gym.create_dataset` as the
dataset's config. Entries become Problems: the solution is the dataset's worked
solution when its metadata has one (`answer_cot` in gsm_symbolic), else just
`#### answer`. Train and test are split by a hash of the question, as in
`arith`, so they never overlap. Rewards use `fp8rl.tasks.rewards`, which suits
datasets with numeric answers; other datasets need their own scorer.

Entries whose answer that reward could never match (`rewards.check_gold`: a
number of more than `rewards.MAX_DIGITS` digits, an empty answer, ...) are
dropped from both streams; if the dataset's first entry is one, the task
fails to load, before any training.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from itertools import islice
from typing import Any, Iterator

from fp8rl.tasks import Problem, in_test_split
from fp8rl.tasks.rewards import check_gold
from fp8rl.tasks.rewards import reward as final_answer_reward

# Metadata keys that hold a worked solution in some reasoning-gym datasets.
SOLUTION_KEYS = ("answer_cot", "solution", "cot")
CHUNK = 256  # entries generated per create_dataset call
TEST_SEED = 7_357  # held-out stream; the hash split keeps it disjoint from any train seed


def _import_reasoning_gym() -> Any:
    try:
        import reasoning_gym
    except ImportError:
        raise ImportError(
            "the reasoning-gym task needs the reasoning-gym package: pip install fp8rl[reasoning-gym]"
        ) from None
    return reasoning_gym


def entry_to_problem(entry: dict[str, Any]) -> Problem:
    """Convert one reasoning-gym entry ({'question', 'answer', 'metadata'}) to a Problem.

    Raises ValueError if the reward could not use its answer (`rewards.check_gold`)."""
    try:
        answer = str(entry["answer"]).strip()
    except ValueError as err:  # an int past Python's 4300-digit conversion limit
        raise ValueError(f"answer cannot be written out: {err}") from None
    check_gold(answer)
    metadata = entry.get("metadata") or {}
    body = ""
    for key in SOLUTION_KEYS:
        if isinstance(metadata.get(key), str) and metadata[key].strip():
            body = metadata[key].strip()
            break
    if "####" in body:
        body = body.rpartition("####")[0]  # drop the dataset's own final line; we write ours
    body = body.rstrip()
    solution = f"{body}\n#### {answer}" if body else f"#### {answer}"
    return Problem(question=str(entry["question"]).strip(), solution=solution, answer=answer)


@dataclass(frozen=True)
class ReasoningGymTask:
    """A reasoning-gym dataset, regenerated in seeded chunks of CHUNK entries.

    dataset:       the reasoning-gym name, e.g. "gsm_symbolic".
    options:       config passed to `reasoning_gym.create_dataset`.
    test_fraction: share of questions (by hash) reserved for the test split.
    """

    dataset: str
    options: dict[str, Any] = field(default_factory=dict)
    test_fraction: float = 0.1
    name: str = "reasoning-gym"

    def __post_init__(self) -> None:
        if isinstance(self.test_fraction, bool) or not 0.0 < self.test_fraction < 1.0:
            raise ValueError(f"reasoning-gym: test_fraction must be in (0, 1), got {self.test_fraction!r}")
        # Fail now, not mid-training: with the library's message on a bad name or
        # option, with ours if the answers are unusable.
        for entry in islice(self._entries(seed=0, size=1), 1):
            try:
                entry_to_problem(entry)
            except ValueError as err:
                raise ValueError(f"reasoning-gym {self.dataset}: first entry (seed 0): {err}") from None

    @classmethod
    def from_options(cls, dataset: str, options: dict[str, Any]) -> "ReasoningGymTask":
        """Split spec options into our `test_fraction` and the dataset's own config."""
        options = dict(options)
        test_fraction = options.pop("test_fraction", 0.1)
        return cls(dataset=dataset, options=options, test_fraction=test_fraction)

    def _entries(self, seed: int, size: int) -> Any:
        rg = _import_reasoning_gym()
        return rg.create_dataset(self.dataset, seed=seed, size=size, **self.options)

    def _chunk(self, seed: int, size: int = CHUNK) -> list[Problem]:
        """The usable problems among `size` seeded entries (see `entry_to_problem`)."""
        problems = []
        for entry in self._entries(seed, size):
            try:
                problems.append(entry_to_problem(entry))
            except ValueError:
                continue  # an answer the reward cannot score: not worth training on
        return problems

    def _split_chunks(self, seed: int, want_test: bool) -> Iterator[list[Problem]]:
        """Endless seeded chunks, each filtered to one side of the hash split."""
        rng = random.Random(seed)
        while True:
            chunk = self._chunk(rng.randrange(2**31))
            yield [p for p in chunk if in_test_split(p.question, self.test_fraction) == want_test]

    def train_problems(self, seed: int) -> Iterator[Problem]:
        """Endless stream of training problems; same seed, same stream."""
        empty = 0
        for chunk in self._split_chunks(seed, want_test=False):
            empty = 0 if chunk else empty + 1
            if empty > 100:
                raise RuntimeError(f"reasoning-gym {self.dataset}: no training problems generated")
            yield from chunk

    def test_problems(self, n: int) -> list[Problem]:
        """Up to `n` distinct held-out problems, the same ones every call."""
        found: dict[str, Problem] = {}
        # Bounded: a dataset with a small question space may never reach n.
        max_chunks = 10 + int(4 * n / (CHUNK * self.test_fraction))
        for _, chunk in zip(range(max_chunks), self._split_chunks(TEST_SEED, want_test=True)):
            for problem in chunk:
                found.setdefault(problem.question, problem)
            if len(found) >= n:
                break
        return list(found.values())[:n]

    def reward(self, completion: str, problem: Problem) -> float:
        """Final-answer correctness (`fp8rl.tasks.rewards.reward`)."""
        return final_answer_reward(completion, problem.answer)

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "dataset": self.dataset,
            "options": dict(self.options),
            "test_fraction": self.test_fraction,
        }

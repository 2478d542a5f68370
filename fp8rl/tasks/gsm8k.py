"""GSM8K-format files: JSONL or Parquet rows with `question` and `answer`.

The `answer` field is a worked solution ending with `#### N`, as in GSM8K:

    {"question": "Natalia sold clips to 48 friends ...",
     "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\\n...\\n#### 72"}

The `<<48/2=24>>` calculator annotations are stripped from the solution (knob
`strip_calculator`), and thousands commas from the final answer ("1,000" ->
"1000"). A row whose final answer the reward could never match (a number of
more than `rewards.MAX_DIGITS` digits, nothing but "$", ...; see
`rewards.check_gold`) is an error at load time, like a malformed row: the
message names the file and the line (JSONL) or row (Parquet).

Held-out split (`test_problems`):
- `gsm8k:TRAIN,test=TEST`: the test file is the held-out set, all of TRAIN trains;
- `gsm8k:PATH`: the last `test_fraction` of PATH's rows (default 10%, at least
  one row) are held out, in file order, and the rest trains.
Either way a training problem whose question also appears in the test set is
dropped, so the two never overlap.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from fp8rl.tasks import Problem
from fp8rl.tasks.rewards import check_gold
from fp8rl.tasks.rewards import reward as final_answer_reward

_CALCULATOR = re.compile(r"<<[^<>]*>>")


def to_problem(question: Any, answer: Any, *, strip_calculator: bool = True) -> Problem:
    """Turn one GSM8K row into a Problem; raises ValueError with a short reason."""
    if not isinstance(question, str) or not question.strip():
        raise ValueError("'question' must be a non-empty string")
    if not isinstance(answer, str):
        raise ValueError("'answer' must be a string")
    body, sep, final = answer.rpartition("####")
    if not sep:
        raise ValueError("'answer' has no '#### N' final line")
    final = final.strip().replace(",", "")
    if not final or "\n" in final:
        raise ValueError(f"'answer' has an empty or multi-line final answer after '####': {final[:60]!r}")
    try:
        check_gold(final)
    except ValueError as err:
        raise ValueError(f"'answer' has an unusable final answer after '####': {err}") from None
    if strip_calculator:
        body = _CALCULATOR.sub("", body)
    body = body.rstrip()
    solution = f"{body}\n#### {final}" if body else f"#### {final}"
    return Problem(question=question.strip(), solution=solution, answer=final)


def read_gsm8k(path: str | Path, *, strip_calculator: bool = True) -> list[Problem]:
    """Read every row of a `.jsonl` / `.json` (one object per line) or `.parquet` file.

    Errors name the file and the 1-based line (JSONL) or row (Parquet).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GSM8K file not found: {path}")
    if path.suffix == ".parquet":
        rows = _read_parquet_rows(path)
        where = "row"
    else:
        rows = _read_jsonl_rows(path)
        where = "line"
    problems = []
    for number, row in rows:
        missing = [key for key in ("question", "answer") if key not in row]
        if missing:
            raise ValueError(f"{path}, {where} {number}: missing key(s) {missing}")
        try:
            problems.append(to_problem(row["question"], row["answer"], strip_calculator=strip_calculator))
        except ValueError as err:
            raise ValueError(f"{path}, {where} {number}: {err}") from None
    if not problems:
        raise ValueError(f"{path}: no problems in file")
    return problems


def _read_jsonl_rows(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """(1-based line number, object) for each non-blank line; lines end at "\\n"."""
    with path.open("rb") as f:  # bytes, so that a decoding error can name its line
        for number, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise ValueError(f"{path}, line {number}: not UTF-8 ({err.reason} at byte {err.start})") from None
            if not line.strip():
                continue  # blank lines (a trailing newline) are not rows
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}, line {number}: invalid JSON ({err.msg})") from None
            except ValueError as err:  # an integer literal past Python's 4300-digit limit
                raise ValueError(f"{path}, line {number}: unreadable JSON ({err})") from None
            except RecursionError:
                raise ValueError(f"{path}, line {number}: JSON nested too deeply") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}, line {number}: not a JSON object")
            yield number, row


def _read_parquet_rows(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError(f"reading {path} needs pyarrow: pip install fp8rl[parquet]") from None
    table = pq.read_table(path)
    missing = [key for key in ("question", "answer") if key not in table.column_names]
    if missing:
        raise ValueError(f"{path}: Parquet file lacks column(s) {missing}; has {table.column_names}")
    table = table.select(["question", "answer"])
    yield from enumerate(table.to_pylist(), start=1)


@dataclass(frozen=True)
class GSM8KTask:
    """Problems from GSM8K-format files, already split into train and test."""

    train: tuple[Problem, ...]
    test: tuple[Problem, ...]
    source: str
    test_rule: str
    name: str = "gsm8k"

    def train_problems(self, seed: int) -> Iterator[Problem]:
        """Endless stream: the training rows, reshuffled every epoch by a seeded RNG."""
        rng = random.Random(seed)
        order = list(self.train)
        while True:
            rng.shuffle(order)
            yield from order

    def test_problems(self, n: int) -> list[Problem]:
        """The first `n` held-out problems in file order (all of them if fewer)."""
        return list(self.test[:n])

    def reward(self, completion: str, problem: Problem) -> float:
        """Final-answer correctness (`fp8rl.tasks.rewards.reward`)."""
        return final_answer_reward(completion, problem.answer)

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "source": self.source,
            "n_train": len(self.train),
            "n_test": len(self.test),
            "test_rule": self.test_rule,
        }


def load_gsm8k(
    path: str | Path,
    *,
    test: str | Path | None = None,
    test_fraction: float = 0.1,
    strip_calculator: bool = True,
) -> GSM8KTask:
    """Load a GSM8K-format file as a task (see the module docstring for the split)."""
    if isinstance(test_fraction, bool) or not 0.0 < test_fraction < 1.0:
        raise ValueError(f"gsm8k: test_fraction must be in (0, 1), got {test_fraction!r}")
    if not isinstance(strip_calculator, bool):
        raise ValueError(f"gsm8k: strip_calculator must be true or false, got {strip_calculator!r}")
    rows = read_gsm8k(path, strip_calculator=strip_calculator)
    if test:  # "" (an empty spec value) means no test file
        train, held_out = rows, read_gsm8k(test, strip_calculator=strip_calculator)
        rule = f"test file {test}"
    else:
        if len(rows) < 2:
            raise ValueError(f"{path}: need at least 2 rows to hold one out, got {len(rows)}")
        n_test = max(1, round(len(rows) * test_fraction))
        train, held_out = rows[:-n_test], rows[-n_test:]
        rule = f"last {n_test} of {len(rows)} rows (test_fraction={test_fraction})"
    test_questions = {p.question for p in held_out}
    train = [p for p in train if p.question not in test_questions]
    if not train:
        raise ValueError(f"{path}: every training question also appears in the test set")
    return GSM8KTask(train=tuple(train), test=tuple(held_out), source=str(path), test_rule=rule)

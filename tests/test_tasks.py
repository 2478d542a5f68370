"""Tasks: the arith generator, GSM8K-format files, reasoning-gym, make_task."""

import json
import re
import sys
import types
from itertools import islice

import pytest

from fp8rl.tasks import Problem, Task, make_task
from fp8rl.tasks.arithmetic import ArithTask
from fp8rl.tasks.gsm8k import load_gsm8k, read_gsm8k
from fp8rl.tasks.rewards import reward

STEP = re.compile(r"(-?\d+) ([-+*]) (\d+) = (-?\d+)")


def take(task, seed, n):
    return list(islice(task.train_problems(seed), n))


def check_solution(problem: Problem) -> list[tuple[str, int]]:
    """Verify every step line of an arith solution; return its (op, operand) list."""
    *steps, final = problem.solution.split("\n")
    assert final == f"#### {problem.answer}"
    ops, value = [], None
    for line in steps:
        match = STEP.fullmatch(line)
        assert match, f"bad step line {line!r}"
        left, op, right, result = int(match[1]), match[2], int(match[3]), int(match[4])
        assert value is None or left == value, "each step continues from the previous result"
        assert result == {"+": left + right, "-": left - right, "*": left * right}[op], line
        ops.append((op, right))
        value = result
    assert str(value) == problem.answer
    return ops


# ------------------------------------------------------------------ arith


def test_arith_same_seed_same_stream_other_seed_differs():
    task = make_task("arith")
    assert take(task, 0, 50) == take(task, 0, 50)
    assert take(task, 0, 50) != take(task, 1, 50)
    assert task.test_problems(20) == task.test_problems(20)


def test_arith_does_not_touch_global_rng():
    import random

    random.seed(123)
    expected = random.random()
    random.seed(123)
    take(make_task("arith"), 0, 20)
    make_task("arith").test_problems(5)
    assert random.random() == expected


def test_arith_train_and_test_are_disjoint():
    task = make_task("arith")
    test = task.test_problems(300)
    assert len(test) == 300 and len({p.question for p in test}) == 300
    train = take(task, 0, 3000) + take(task, 7, 3000)
    assert not {p.question for p in train} & {p.question for p in test}
    # Stronger: the arithmetic itself (start value, ops and operands) never repeats.
    def skeleton(p):
        return (p.solution.split(" ", 1)[0], tuple(check_solution(p)))

    assert not {skeleton(p) for p in train} & {skeleton(p) for p in test}


def test_arith_solutions_check_and_are_rewarded():
    task = make_task("arith")
    problems = take(task, 3, 500) + task.test_problems(100)
    for p in problems:
        ops = check_solution(p)
        assert len(ops) == task.steps
        assert int(p.answer) >= 0  # default: no negatives
        assert p.answer.lstrip("-").isdigit()
        assert reward(p.solution, p.answer) == 1.0
        # The question carries the operands the solution uses.
        assert all(str(operand) in p.question for _, operand in ops)


def test_arith_default_texts_are_short():
    problems = take(make_task("arith"), 0, 1000)
    assert max(len(p.question) for p in problems) < 150
    assert max(len(p.solution) for p in problems) < 60
    assert len({p.question.split()[0] for p in problems}) > 3  # names / templates vary


def test_arith_knobs():
    task = make_task("arith:steps=3,ops=+,max_operand=9")
    for p in take(task, 0, 200):
        ops = check_solution(p)
        assert len(ops) == 3 and all(op == "+" and 1 <= b <= 9 for op, b in ops)
    negative = make_task("arith:ops=-,allow_negative=true,steps=3")
    assert any(int(p.answer) < 0 for p in take(negative, 0, 200))
    to_zero = make_task("arith:ops=-*,steps=4,max_operand=3")  # runs into zero often
    assert all(int(p.answer) >= 0 for p in take(to_zero, 0, 200))
    with pytest.raises(RuntimeError, match="no training problems"):
        take(make_task("arith:ops=-,steps=4,max_operand=3"), 0, 1)  # 4 subtractions from <= 3
    assert make_task("arith:steps=3", steps=1) == ArithTask(steps=1)  # kwargs override
    assert make_task("arith:max_operand=50").describe()["max_operand"] == 50


def test_arith_rejects_knobs_with_unreadable_answers():
    task = make_task("arith:steps=3,max_operand=99,max_factor=9")
    bound = task.max_answer_digits()
    assert all(len(p.answer.lstrip("-")) <= bound for p in take(task, 0, 500))
    # 200 steps of up to x10^30: answers of ~6,000 digits, which raised Python's
    # 4300-digit error when a problem was drawn, mid-training.
    with pytest.raises(ValueError, match=r"arith: .*6002 digits.* at most 1000"):
        make_task("arith:steps=200,max_factor=1000000000000000000000000000000")
    with pytest.raises(ValueError, match="digits"):
        ArithTask(steps=10**4, max_operand=10**999, ops="+")
    ArithTask(steps=10, max_operand=10**900)  # big but readable


def test_arith_tiny_space_terminates():
    task = make_task("arith:steps=1,max_operand=2,ops=+,test_fraction=0.5")
    test = task.test_problems(10_000)
    assert 0 < len(test) < 10_000


@pytest.mark.parametrize(
    "spec, message",
    [
        ("arith:steps=0", "steps must be >= 1"),
        ("arith:ops=+/", "ops must be"),
        ("arith:depth=3", "unknown knob"),
        ("arith:steps=two", "steps must be int"),
        ("arith:steps", "expected key=value"),
        ("arith:test_fraction=1.5", "test_fraction"),
    ],
)
def test_arith_bad_knobs(spec, message):
    with pytest.raises(ValueError, match=message):
        make_task(spec)


# ------------------------------------------------------------------ Problem, make_task


def test_problem_requires_final_line():
    Problem("q?", "1 + 1 = 2\n#### 2", "2")
    with pytest.raises(ValueError, match="#### 3"):
        Problem("q?", "1 + 1 = 2\n#### 2", "3")


def test_make_task_unknown_spec_lists_forms():
    with pytest.raises(ValueError, match="'mnist'") as err:
        make_task("mnist")
    for form in ("arith", "gsm8k:PATH", "reasoning-gym:NAME"):
        assert form in str(err.value)
    with pytest.raises(ValueError, match="needs a file"):
        make_task("gsm8k:")


def test_tasks_follow_the_protocol(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", ROWS)
    for task in (make_task("arith"), make_task(f"gsm8k:{path}")):
        assert isinstance(task, Task)
        assert json.loads(json.dumps(task.describe()))["name"] == task.name


# ------------------------------------------------------------------ GSM8K files

ROWS = [
    {
        "question": f"Q{i}: Natalia sold clips to {48 + i} friends.",
        "answer": f"Natalia sold {48 + i}/2 = <<{48 + i}/2={(48 + i) / 2:g}>>{(48 + i) / 2:g} clips.\n#### {1000 + i:,}",
    }
    for i in range(20)
]


def write_jsonl(path, rows, extra_lines=()):
    lines = [json.dumps(r) for r in rows] + list(extra_lines)
    path.write_text("\n".join(lines) + "\n")
    return path


def test_gsm8k_jsonl_strips_annotations_and_commas(tmp_path):
    problems = read_gsm8k(write_jsonl(tmp_path / "d.jsonl", ROWS))
    assert len(problems) == 20
    first = problems[0]
    assert first.answer == "1000"
    assert first.solution == "Natalia sold 48/2 = 24 clips.\n#### 1000"
    assert reward(first.solution, first.answer) == 1.0
    kept = read_gsm8k(tmp_path / "d.jsonl", strip_calculator=False)[0]
    assert "<<48/2=24>>" in kept.solution


def test_gsm8k_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), path)
    assert read_gsm8k(path) == read_gsm8k(write_jsonl(tmp_path / "d.jsonl", ROWS))
    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist([{"question": "q", "solution": "#### 1"}]), bad)
    with pytest.raises(ValueError, match=r"bad\.parquet.*answer"):
        read_gsm8k(bad)
    null = tmp_path / "null.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS[:2] + [{"question": "q", "answer": None}]), null)
    with pytest.raises(ValueError, match=r"null\.parquet, row 3"):
        read_gsm8k(null)


@pytest.mark.parametrize(
    "bad_line, message",
    [
        ("{not json", "invalid JSON"),
        (json.dumps({"question": "q"}), r"missing key\(s\) \['answer'\]"),
        (json.dumps({"question": "q", "answer": "42"}), "no '#### N'"),
        (json.dumps({"question": "q", "answer": "so\n####"}), "empty"),
        (json.dumps([1, 2]), "not a JSON object"),
    ],
)
def test_gsm8k_malformed_line_names_file_and_line(tmp_path, bad_line, message):
    path = write_jsonl(tmp_path / "broken.jsonl", ROWS[:2], extra_lines=["", bad_line])
    with pytest.raises(ValueError, match=message) as err:
        read_gsm8k(path)
    assert f"{path}, line 4" in str(err.value)  # 2 rows, a blank line, then the bad one


@pytest.mark.parametrize(
    "bad_line, message",
    [
        # Each made training abort, naming no file or line, or loaded a row no completion could match.
        (json.dumps({"question": "q", "answer": "#### " + "1" * 5000}), "unusable final answer.*5000 digits"),
        (json.dumps({"question": "q", "answer": "so\n#### $"}), "unusable final answer.*empty"),
        (json.dumps({"question": "q", "answer": "#### " + "x" * 3000}), "3000 characters"),
        ('{"question": "q", "answer": ' + "1" * 5000 + "}", r"unreadable JSON \(Exceeds the limit"),
        ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
    ],
)
def test_gsm8k_unusable_line_is_rejected_at_load(tmp_path, bad_line, message):
    path = write_jsonl(tmp_path / "broken.jsonl", ROWS[:2], extra_lines=["", bad_line])
    with pytest.raises(ValueError, match=message) as err:
        make_task(f"gsm8k:{path}")
    assert str(err.value).startswith(f"{path}, line 4: ")
    assert "\n" not in str(err.value) and len(str(err.value)) < 300


def test_gsm8k_invalid_utf8_names_the_line(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b"\n".join([json.dumps(r).encode() for r in ROWS[:2]] + [b'{"question": "caf\xe9"}', b""]))
    with pytest.raises(ValueError, match=r"latin1\.jsonl, line 3: not UTF-8"):
        read_gsm8k(path)
    crlf = tmp_path / "crlf.jsonl"
    crlf.write_bytes(b"\r\n".join(json.dumps(r).encode() for r in ROWS) + b"\r\n")
    assert read_gsm8k(crlf) == read_gsm8k(write_jsonl(tmp_path / "lf.jsonl", ROWS))


def test_gsm8k_parquet_unusable_answer_names_the_row(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "huge.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS[:2] + [{"question": "q", "answer": "#### " + "9" * 4400}]), path)
    with pytest.raises(ValueError, match=r"huge\.parquet, row 3: .*4400 digits"):
        read_gsm8k(path)


def test_gsm8k_missing_file_names_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        make_task(f"gsm8k:{tmp_path / 'nope.jsonl'}")


def test_gsm8k_split_last_fraction_and_disjoint(tmp_path):
    rows = ROWS + [ROWS[0]]  # a duplicate question straddling the split
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    task = make_task(f"gsm8k:{path},test_fraction=0.2")
    test = task.test_problems(100)  # round(21 * 0.2) = 4 rows
    assert [p.question for p in test] == [r["question"] for r in rows[-4:]]
    train = take(task, 0, 60)  # endless: rows 1..16 (row 0 is also in test), reshuffled
    assert len(train) == 60
    assert not {p.question for p in train} & {p.question for p in test}
    assert {p.question for p in train} == {r["question"] for r in ROWS[1:17]}
    assert take(task, 0, 30) == take(task, 0, 30)
    assert take(task, 0, 30) != take(task, 1, 30)
    assert task.test_problems(2) == test[:2]


def test_gsm8k_separate_test_file(tmp_path):
    train_path = write_jsonl(tmp_path / "train.jsonl", ROWS[:15])
    test_path = write_jsonl(tmp_path / "test.jsonl", ROWS[14:])
    task = make_task(f"gsm8k:{train_path},test={test_path}")
    assert len(task.test_problems(100)) == 6
    assert task.describe()["n_train"] == 14  # row 14 is in both files: test keeps it
    with pytest.raises(ValueError, match="unknown option"):
        make_task(f"gsm8k:{train_path},tset={test_path}")
    with pytest.raises(ValueError, match="test_fraction must be float"):
        make_task(f"gsm8k:{train_path},test_fraction=half")
    same = load_gsm8k(train_path, test=test_path, strip_calculator=False)
    assert "<<" in same.train[0].solution
    assert make_task(f"gsm8k:{train_path},test={test_path},strip_calculator=false") == same


# ------------------------------------------------------------------ reasoning-gym


def test_reasoning_gym_missing_gives_install_hint(monkeypatch):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # import fails
    with pytest.raises(ImportError, match=r"pip install fp8rl\[reasoning-gym\]"):
        make_task("reasoning-gym:gsm_symbolic")


def test_reasoning_gym_adapter():
    pytest.importorskip("reasoning_gym")
    task = make_task("reasoning-gym:gsm_symbolic")
    test = task.test_problems(5)
    train = take(task, 0, 40)
    assert len(test) == 5 and test == task.test_problems(5)
    assert train == take(task, 0, 40)
    assert not {p.question for p in train} & {p.question for p in test}
    for p in test + train:
        assert p.solution.endswith(f"#### {p.answer}") and len(p.solution) > len(p.answer) + 10
        assert reward(p.solution, p.answer) == 1.0
    plain = make_task("reasoning-gym:basic_arithmetic,min_terms=2,max_terms=3").test_problems(3)
    assert all(p.solution == f"#### {p.answer}" for p in plain)
    with pytest.raises(ValueError):
        make_task("reasoning-gym:no_such_dataset")


def fake_reasoning_gym(monkeypatch, answers):
    """Install a stand-in `reasoning_gym` whose entry i of seed s has answer answers[(s + i) % n]."""

    def create_dataset(name, *, seed, size, **options):
        return [
            {"question": f"{name} q{seed}-{i}?", "answer": answers[(seed + i) % len(answers)], "metadata": {}}
            for i in range(size)
        ]

    monkeypatch.setitem(sys.modules, "reasoning_gym", types.SimpleNamespace(create_dataset=create_dataset))


def test_reasoning_gym_drops_entries_with_unusable_answers(monkeypatch):
    # 10**5000 is an int that str() refuses: it raised mid-training before.
    fake_reasoning_gym(monkeypatch, [7, 10**5000, "", "12", "$", "9" * 1500])
    task = make_task("reasoning-gym:fake")
    problems = take(task, 0, 300) + task.test_problems(20)
    assert {p.answer for p in problems} == {"7", "12"}
    assert all(reward(p.solution, p.answer) == 1.0 for p in problems)


def test_reasoning_gym_unusable_first_entry_fails_at_load(monkeypatch):
    fake_reasoning_gym(monkeypatch, ["$", 1])
    with pytest.raises(ValueError, match=r"reasoning-gym fake: first entry \(seed 0\): gold answer '\$' is empty"):
        make_task("reasoning-gym:fake")
    fake_reasoning_gym(monkeypatch, [10**5000, 1])
    with pytest.raises(ValueError, match="reasoning-gym fake: first entry .* cannot be written out"):
        make_task("reasoning-gym:fake")


# ------------------------------------------------------------------ chain


def test_chain_solutions_are_numbered_sums_of_the_asked_length():
    from fp8rl.tasks.chain import ChainTask

    task = make_task("chain:min_times=3,max_times=5,max_start=9,max_add=9")
    assert isinstance(task, ChainTask) and isinstance(task, Task)
    for p in islice(task.train_problems(0), 50):
        a, b, n = (int(x) for x in re.findall(r"\d+", p.question))
        lines = p.solution.split("\n")
        assert 3 <= n <= 5 and len(lines) == n + 1
        for k, line in enumerate(lines[:-1], start=1):
            assert line == f"{n - k + 1} left: {a + (k - 1) * b} + {b} = {a + k * b}"
        assert p.answer == str(a + n * b) and lines[-1] == f"#### {p.answer}"
        assert task.reward(p.solution, p) == 1.0


def test_chain_reward_checks_every_line():
    task = make_task("chain")
    p = next(task.train_problems(0))
    lines = p.solution.split("\n")
    wrong = lines[:]
    a, rest = wrong[1].split(" = ")
    wrong[1] = f"{a} = {int(rest) + 1}"  # one wrong sum, the right final answer
    assert task.reward("\n".join(wrong), p) == 0.0
    assert make_task("chain:check_steps=false").reward("\n".join(wrong), p) == 1.0
    assert task.reward("\n".join(lines[:-1] + ["#### 0"]), p) == 0.0


def test_chain_split_is_by_skeleton_at_every_length():
    short, long = make_task("chain:min_times=4,max_times=8"), make_task("chain:min_times=20,max_times=24")
    for task in (short, long):
        test = task.test_problems(100)
        assert len(test) >= 80  # ~40 held-out skeletons of 405, in three phrasings
        skeleton = lambda p: tuple(re.findall(r"\d+", p.question))  # (start, addend, times)
        held_out = {skeleton(p) for p in test}
        assert not held_out & {skeleton(p) for p in islice(task.train_problems(0), 3000)}
    # the length knob sets the answer's length
    mean_lines = lambda t: sum(len(p.solution.split("\n")) for p in t.test_problems(50)) / 50
    assert mean_lines(short) < 10 < 20 < mean_lines(long)


@pytest.mark.parametrize("spec,message", [
    ("chain:min_times=9,max_times=3", "min_times <= max_times"),
    ("chain:max_add=0", "max_add must be >= 1"),
    ("chain:loops=3", "unknown knob"),
])
def test_chain_bad_knobs(spec, message):
    with pytest.raises(ValueError, match=message):
        make_task(spec)

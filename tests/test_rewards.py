"""Answer extraction, comparison and rewards on tricky strings."""

import builtins
import signal
import threading
import time

import pytest

from fp8rl.tasks.rewards import (
    Number,
    answers_equal,
    batch_rewards,
    extract_answer,
    format_number,
    last_boxed,
    parse_number,
    reward,
    run_with_time_limit,
)

EXTRACT_CASES = [
    # GSM8K final line
    ("#### 72", "72"),
    ("#### 1,000", "1000"),
    ("#### -3", "-3"),
    ("####42", "42"),
    ("#### 12 apples.", "12"),
    ("#### $1,000.00", "1000"),
    ("#### 50%", "50"),
    ("#### 007", "7"),
    ("#### -0.0", "0"),
    ("#### .5", "0.5"),
    ("#### 3.0", "3"),
    ("#### 5 + 3 = 8", "8"),
    ("#### 5\n#### 6", "6"),  # last occurrence wins
    ("#### 7\nThat is all, 99 times over.", "7"),  # #### beats a later number
    ("#### 0.1+0.2", "0.1+0.2"),  # kept as text, never evaluated
    ("#### 1/0", "1/0"),  # division by zero is not a number
    ("#### 1,2345", "1,2345"),  # malformed thousands: not a number
    # \boxed
    (r"\boxed{\frac{7}{2}}", "7/2"),
    (r"so \boxed{-\dfrac{7}{2}}.", "-7/2"),
    (r"\boxed{\boxed{5}}", "5"),
    (r"\boxed{1} then \boxed{2}", "2"),
    (r"\boxed{12\text{ apples}}", "12"),
    (r"\boxed{x = 5}", "5"),
    (r"\boxed{\sqrt{2}}", r"\sqrt{2}"),
    (r"\boxed{\$12}", "12"),
    (r"\boxed{3", "3"),  # unclosed box: falls back to the last number
    ("#### \n\\boxed{4}", "4"),  # empty #### line: falls back to the box
    # last number
    ("The answer is 3.50.", "3.5"),
    ("$12", "12"),
    ("It costs $12.", "12"),
    ("between 5,000 and 6,000.", "6000"),
    ("It is 7/2", "7/2"),
    (r"It is \frac{14}{4}", "7/2"),
    ("x = -3", "-3"),
    ("\u22123", "-3"),  # unicode minus
    ("5-3", "3"),  # a minus after a digit is an operator, not a sign
    ("48/2 = 24", "24"),
    ("0.1+0.2", "0.2"),
    ("no number here", None),
    ("", None),
]


@pytest.mark.parametrize("text, expected", EXTRACT_CASES)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


REWARD_CASES = [
    ("5 + 3 = 8\n#### 8", "8", 1.0),
    ("#### 9", "8", 0.0),
    ("#### 1,000", "1000", 1.0),
    ("#### 1000", "1,000", 1.0),  # gold written with commas
    (r"\boxed{\frac{7}{2}}", "3.5", 1.0),
    ("#### 7/2", "3.5", 1.0),
    ("#### 3.5", "7/2", 1.0),
    ("#### 3.50", "3.5", 1.0),
    ("#### 0.333333", "1/3", 1.0),  # decimal vs fraction: 1e-6 relative
    ("#### 0.33", "1/3", 0.0),
    ("#### 2/6", "1/3", 1.0),
    ("#### 3", "3.0000001", 1.0),
    ("#### 3", "3.01", 0.0),
    ("#### -3", "-3", 1.0),
    ("#### -3", "3", 0.0),
    ("The answer is 3.50.", "3.5", 1.0),
    ("I don't know.", "5", 0.0),
    ("#### 0.1+0.2", "0.3", 0.0),  # expressions are not evaluated
    ("#### 3+4", "7", 0.0),
    ("0.1+0.2", "0.3", 0.0),
    ("#### 1/0", "0", 0.0),
    (r"\boxed{\sqrt{2}}", r"\sqrt{2}", 1.0),  # non-numeric gold, equal text
    ("#### 5", r"\sqrt{2}", 0.0),
]


@pytest.mark.parametrize("completion, gold, expected", REWARD_CASES)
def test_reward(completion, gold, expected):
    assert reward(completion, gold) == expected


def test_parse_and_format_numbers():
    assert parse_number("7/2") == Number(value=parse_number("3.5").value, decimal=False)
    assert parse_number("3+4") is None
    assert parse_number("12 apples") is not None
    assert parse_number("5x") is None  # algebra, not a unit
    assert format_number(Number(parse_number("1/8").value, decimal=True)) == "0.125"
    assert format_number(Number(parse_number("-1/8").value, decimal=True)) == "-0.125"
    assert format_number(Number(parse_number("1/3").value, decimal=True)) == "1/3"
    assert last_boxed(r"\boxed{a{b}c}") == "a{b}c"


def test_answers_equal_is_numeric_and_symmetric():
    for a, b in [("7/2", "3.5"), (r"\frac{7}{2}", "3.50"), ("1,000", "1000"), ("-0", "0")]:
        assert answers_equal(a, b) and answers_equal(b, a)
    assert not answers_equal("3.5", "3.6")


def test_batch_rewards():
    assert batch_rewards(["#### 1", "#### 2", "none"], ["1", "3", "0"]) == [1.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="2 completions but 1"):
        batch_rewards(["a", "b"], ["1"])


def test_extremely_long_input_is_fast():
    completions = ["1" * 10_000_000 + " #### 5", "(" * 2_000_000, "{" * 2_000_000 + r"\boxed{" * 1000]
    start = time.perf_counter()
    assert batch_rewards(completions, ["5", "5", "5"]) == [1.0, 0.0, 0.0]
    assert time.perf_counter() - start < 1.0


def test_only_the_tail_is_read():
    text = "#### 5" + " pad" * 400  # 1606 characters, the answer at the start
    assert extract_answer(text) == "5"
    assert extract_answer(text, max_chars=100) is None
    assert extract_answer("#### 5" + " pad" * 1000) is None  # beyond the default 2000


def test_model_output_is_never_executed():
    payload = "__import__('builtins').__dict__.__setitem__('FP8RL_PWNED', 1)"
    for completion in (payload, f"#### {payload}", rf"\boxed{{{payload}}}"):
        for gold in ("2", "x+1"):  # numeric path and math-verify path
            assert reward(completion, gold) == 0.0
    assert not hasattr(builtins, "FP8RL_PWNED")


def test_math_verify_equivalence():
    pytest.importorskip("math_verify")
    assert reward(r"\boxed{2^{1/2}}", r"\sqrt{2}") == 1.0
    assert reward(r"\boxed{1+x}", "x+1") == 1.0
    assert reward(r"\boxed{\sqrt{3}}", r"\sqrt{2}") == 0.0


def test_without_math_verify_text_comparison_decides(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "math_verify", None)  # import fails
    assert reward(r"\boxed{2^{1/2}}", r"\sqrt{2}") == 0.0
    assert reward(r"\boxed{\sqrt{2}}", r"\sqrt{ 2 }") == 1.0
    assert reward("#### 8", "8") == 1.0


def test_math_verify_is_time_limited():
    pytest.importorskip("math_verify")
    start = time.perf_counter()
    assert reward(r"\boxed{9^{9^{9^{9^{9^{9}}}}}}", r"\sqrt{2}", timeout_s=0.3) == 0.0
    assert time.perf_counter() - start < 2.0


def test_time_limit_interrupts_and_restores_outer_timer():
    def spin() -> int:
        while True:
            pass

    previous = signal.getsignal(signal.SIGALRM)
    outer = signal.getitimer(signal.ITIMER_REAL)[0]
    if not outer:
        signal.setitimer(signal.ITIMER_REAL, 100.0)  # stands in for pytest-timeout
    try:
        start = time.perf_counter()
        assert run_with_time_limit(spin, 0.05) is None
        assert time.perf_counter() - start < 1.0
        assert run_with_time_limit(lambda: 7, 1.0) == 7
        assert signal.getitimer(signal.ITIMER_REAL)[0] > 0  # outer timer re-armed
        assert signal.getsignal(signal.SIGALRM) is previous
    finally:
        if not outer:
            signal.setitimer(signal.ITIMER_REAL, 0)


def test_worker_threads_skip_math_verify_but_score_numbers():
    results = []
    thread = threading.Thread(
        target=lambda: results.extend([reward("#### 7/2", "3.5"), reward(r"\boxed{2^{1/2}}", r"\sqrt{2}")])
    )
    thread.start()
    thread.join()
    assert results == [1.0, 0.0]

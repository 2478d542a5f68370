"""Answer extraction, comparison and rewards on tricky strings."""

import builtins
import gc
import random
import re
import signal
import sys
import threading
import time

import pytest

from fp8rl.tasks.rewards import (
    MAX_CHARS,
    MAX_DIGITS,
    Number,
    _strip_unit_words,
    answers_equal,
    batch_rewards,
    check_gold,
    equations_correct,
    extract_answer,
    format_number,
    last_boxed,
    normalize_answer,
    parse_number,
    MATH_VERIFY,
    reward,
    steps_reward,
)


def run_with_time_limit(fn, seconds: float):
    """`fn()`, or None if it runs past `seconds` (SIGALRM; main thread only):
    a test's guard against a runaway call in our own (Python-level) code."""
    class TimeLimit(BaseException):
        pass

    def on_alarm(signum, frame):
        raise TimeLimit

    previous = signal.signal(signal.SIGALRM, on_alarm)
    try:
        signal.setitimer(signal.ITIMER_REAL, seconds)
        try:
            return fn()
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    except TimeLimit:
        return None
    finally:
        signal.signal(signal.SIGALRM, previous)

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


def test_math_verify_is_time_limited_even_inside_one_c_level_operation():
    """9^{9^{9^...}} makes sympy spend minutes inside one Python integer power,
    where no timer signal is delivered (a full test run once hung here): the
    child process that runs math-verify is killed at the limit instead."""
    pytest.importorskip("math_verify")
    assert reward(r"\boxed{\sqrt{2}}", r"2^{1/2}") == 1.0  # starts the child (imports sympy)
    first = MATH_VERIFY._proc
    for _ in range(2):
        start = time.perf_counter()
        assert reward(r"\boxed{9^{9^{9^{9^{9^{9}}}}}}", r"\sqrt{2}", timeout_s=0.3) == 0.0
        assert time.perf_counter() - start < 2.0
    assert MATH_VERIFY._proc is None and not first.is_alive()  # killed, not left running
    assert reward(r"\boxed{\sqrt{2}}", r"2^{1/2}") == 1.0  # a fresh child serves the next call


def test_worker_threads_use_math_verify_too():
    pytest.importorskip("math_verify")
    results = []
    thread = threading.Thread(
        target=lambda: results.extend([reward("#### 7/2", "3.5"), reward(r"\boxed{2^{1/2}}", r"\sqrt{2}")])
    )
    thread.start()
    thread.join()
    assert results == [1.0, 1.0]


# ------------------------------------------------------------------ bounded time, no exceptions


def adversarial(n: int) -> dict[str, str]:
    """Inputs of about `n` characters built to make a regex or a loop go superlinear."""
    return {
        "words": "5" + " abc" * (n // 4) + "!",  # the quadratic _TRAILING_WORDS regex
        "unit_words": "5" + " km/h" * (n // 5),
        "whitespace": "5" + " " * n + "!",
        "digits": "1" * n,
        "digits_then_op": "1" * n + "+",  # the quadratic _EQUATION regex
        "hashes": "####" * (n // 4),
        "hash_digits": "#### " + "1" * n,
        "open_braces": r"\boxed{" + "{" * n,
        "open_boxes": r"\boxed{" * (n // 7),  # the quadratic last_boxed loop
        "nested_boxes": r"\boxed{" * (n // 14) + "5" + "}" * (n // 14),
        "frac_chain": r"\frac{1}{" * (n // 9),
        "fracs": r"\frac{1}{2}" * (n // 11),
        "thousands": "1,234" * (n // 5),
        "braced_commas": "1{,}" * (n // 4),
        "text_wrappers": r"\text{" * (n // 6),
        "equations": "12+3=15 " * (n // 8),
        "minus_run": "-" * n + "1",
        "exponent": "1e" + "9" * n,
        "prose": "The answer is 7. " * (n // 17),
    }


def _check_gold_or_reason(text: str) -> None:
    try:
        check_gold(text, max_chars=len(text))
    except ValueError:
        return


# Entry points with their length caps lifted, so that only linear-time code passes...
UNCAPPED = {
    "parse_number": parse_number,
    "normalize_answer": normalize_answer,
    "extract_answer": lambda s: extract_answer(s, max_chars=len(s)),
    "answers_equal(pred)": lambda s: answers_equal(s, "5", max_chars=len(s)),
    "answers_equal(gold)": lambda s: answers_equal("5", s, max_chars=len(s)),
    "equations_correct": lambda s: equations_correct(s, max_chars=len(s)),
    "check_gold": _check_gold_or_reason,
}
# ... and as training calls them, on whole completions and gold answers.
CAPPED = {
    "reward(completion)": lambda s: reward(s, "5"),
    "reward(gold)": lambda s: reward("#### 5", s),
    "reward(both)": lambda s: reward(s, s),
    "steps_reward": lambda s: steps_reward(s, "5"),
}
# The bound: every call above makes a few linear passes over its input; on a
# 2-core dev machine the slowest takes 0.05 s of CPU for 100 KB uncapped (0.45 s
# for 1 MB), and the capped ones a few ms on 1 MB, since they read 2,000
# characters. 0.5 s of the calling thread's CPU time (not wall time, which a busy machine stretches
# many times over) leaves a 10x margin. The code this replaced was quadratic: the
# "words" gold of 16,000 words took over 10 s, and last_boxed on "open_boxes"
# would run for hours, so each call is cut off at 5 s of wall time.
BOUND_S = 0.5


def seconds_taken(call) -> float:
    """CPU seconds of this thread while `call()` ran (it runs here), or 5.0 if it was
    still running after 5 s. The thread's, not the process's: `time.process_time()`
    also counts the test process's other threads (torch's thread pools, left by
    earlier tests), and in one CI run gave 0.745 s for an `extract_answer` call that
    takes 0.03-0.05 s of CPU. Python's garbage collector is run before and kept off during
    the call: a collection that the call's allocations trigger walks every object the
    test process holds (models, caches of earlier tests) on this thread's clock. A full
    local run of the suite gave 0.725 s for an `equations_correct` call that takes
    0.045 s alone, the likely cause."""
    gc.collect()
    gc.disable()
    try:
        start = time.thread_time()
        finished = run_with_time_limit(lambda: [call()], 5.0)
        return time.thread_time() - start if finished is not None else 5.0
    finally:
        gc.enable()


@pytest.mark.parametrize("case", sorted(adversarial(10)))
def test_adversarial_inputs_are_scored_in_bounded_time(case, monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)  # our code's time, not sympy's
    small, large = adversarial(100_000)[case], adversarial(1_000_000)[case]
    times = {name: seconds_taken(lambda: fn(small)) for name, fn in UNCAPPED.items()}
    times |= {name: seconds_taken(lambda: fn(large)) for name, fn in CAPPED.items()}
    slow = {name: round(t, 3) for name, t in times.items() if t >= BOUND_S}
    assert not slow, f"{case}: calls over {BOUND_S} s: {slow}"


def test_reported_long_gold_is_fast():
    gold = "5" + " abc" * 16000 + "!"  # > 40 s before
    assert seconds_taken(lambda: reward("#### 5", gold)) < BOUND_S
    assert seconds_taken(lambda: parse_number(gold)) < BOUND_S
    assert reward("#### 5", gold) == 0.0 and parse_number(gold) is None


def test_unit_words_are_stripped_as_by_the_old_regex():
    old = re.compile(r"(?:\s+[A-Za-z][A-Za-z/]*)+$")  # the quadratic original, kept as the spec
    rng = random.Random(0)
    pieces = ["5", "12", " ", "  ", "\t", "\u00a0", "a", "km", "/", "h", "x2", ".", "-", "{"]
    for _ in range(20_000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 8))).strip()
        assert _strip_unit_words(text) == old.sub("", text), repr(text)
    assert _strip_unit_words("12 apples") == "12"
    assert _strip_unit_words("5 km/h") == "5"
    assert _strip_unit_words("5x") == "5x"


def test_last_boxed_matches_braces_like_a_counter():
    assert last_boxed(r"\boxed{a} } \boxed{b") == "a"  # the last box is open: the one before
    assert last_boxed(r"} \boxed{x}") == "x"  # an unmatched } before a box changes nothing
    assert last_boxed(r"\boxed{a{b} \boxed{c}") == "c"
    assert last_boxed(r"\boxed{a{b}c} \boxed{d") == "a{b}c"
    assert last_boxed(r"\boxed{a{b}") is None
    assert last_boxed("no box") is None


def test_huge_numbers_never_raise():
    huge = "1" * 5000  # Python's int() refuses more than 4300 digits
    assert reward("#### 5", huge) == 0.0
    assert reward(huge, "5") == 0.0
    assert reward("#### " + huge, "5", max_chars=10_000) == 0.0
    assert reward("#### " + huge, huge, max_chars=10_000) == 1.0  # equal as text
    assert extract_answer(huge, max_chars=10_000) is None
    assert equations_correct(f"{huge} + 1 = 2", max_chars=10_000) is False
    assert answers_equal(huge, huge[:-1] + "2") is False
    assert parse_number("1" * MAX_DIGITS) is not None
    assert parse_number("1" * (MAX_DIGITS + 1)) is None
    assert parse_number(rf"\frac{{{'1' * 600}}}{{{'3' * 600}}}") is None  # digits of both parts count


@pytest.mark.parametrize(
    "text",
    ["1e999999999", "1e-999999999", "10**999999999", "9^{9^{9}}", "nan", "NaN", "inf", "-inf",
     "Infinity", "1_000", "0x1F", "1/0", "0/0", "\u0663", "\U0001d7d1"],
)
def test_odd_numbers_are_text_or_numbers_never_errors(text):
    number = parse_number(text)
    assert number is None or isinstance(number.value.numerator, int)
    for completion, gold in [(f"#### {text}", "5"), ("#### 5", text), (rf"\boxed{{{text}}}", text)]:
        assert reward(completion, gold, timeout_s=0.2) in (0.0, 1.0)
    assert parse_number("1e5") is None and parse_number("nan") is None and parse_number("inf") is None


def test_braced_thousands_separator():
    assert reward(r"\boxed{1{,}234}", "1234") == 1.0
    assert reward(r"\boxed{1{,}234{,}567}", "1234567") == 1.0
    assert reward("The total is $1{,}234$.", "1234") == 1.0  # the last-number fallback too
    assert reward(r"\boxed{\frac{1{,}000}{8}}", "125") == 1.0
    assert extract_answer(r"\boxed{1{,}2345}") == "1,2345"  # malformed, like "1,2345": text
    # Unchanged: "," and "\," separate thousands, a plain space does not.
    assert reward(r"\boxed{1,234}", "1234") == 1.0
    assert reward(r"\boxed{1\,234}", "1234") == 1.0
    assert reward(r"\boxed{1 234}", "1234") == 0.0
    assert extract_answer(r"\boxed{1 234}") == "1 234"


def test_empty_answers_never_match():
    assert reward("#### $", "$") == 0.0  # both clean to "": 1.0 before
    assert reward(r"\boxed{\,}", "%") == 0.0
    assert answers_equal("", "") is False
    assert answers_equal("5", "") is False


def test_gold_longer_than_what_is_read_never_matches():
    gold = "x" * (MAX_CHARS + 1)
    assert reward(f"#### {gold}", gold, max_chars=10 * MAX_CHARS) == 1.0
    assert reward(f"#### {gold}", gold) == 0.0  # the completion's answer is read from its last MAX_CHARS


def test_check_gold():
    for good in ["72", "1000", "-3", "7/2", "3.5", r"\sqrt{2}", "x+1", "12 apples", "1/0", "1" * MAX_DIGITS]:
        check_gold(good)
    for bad, message in [
        ("", "empty"),
        ("  ", "empty"),
        ("$", "empty"),
        ("1" * (MAX_DIGITS + 1), f"{MAX_DIGITS + 1} digits"),
        ("-" + "9" * 1500 + " apples", "1500 digits"),
        ("x" * (MAX_CHARS + 1), f"{MAX_CHARS + 1} characters"),
        (5, "must be a string"),
    ]:
        with pytest.raises(ValueError, match=message) as err:
            check_gold(bad)
        assert "\n" not in str(err.value) and len(str(err.value)) < 200


def test_a_time_limit_that_is_not_positive_skips_math_verify():
    pytest.importorskip("math_verify")
    for seconds in (0, 0.0, -1.0, float("nan")):
        assert MATH_VERIFY.equal(r"2^{1/2}", r"\sqrt{2}", seconds) is False
    assert reward(r"\boxed{2^{1/2}}", r"\sqrt{2}", timeout_s=0) == 0.0  # text comparison only
    assert reward(r"\boxed{\sqrt{2}}", r"\sqrt{2}", timeout_s=-1) == 1.0

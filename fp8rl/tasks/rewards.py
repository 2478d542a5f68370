"""Verifiable rewards: pull the final answer out of a completion, compare it with the gold one.

    reward("5 + 3 = 8\\n#### 8", "8")            -> 1.0
    reward("so the answer is \\\\boxed{7/2}", "3.5")  -> 1.0
    reward("0.1+0.2", "0.3")                     -> 0.0   (expressions are never evaluated)

Extraction prefers, in order: the last `#### N` line, the last `\\boxed{...}`,
then the last number in the text. Numbers are normalised ("1,000" and
"1{,}000" -> "1000", "3.50" -> "3.5", "\\frac{7}{2}" -> "7/2", "$12." -> "12",
"12 apples" -> "12"); "1 000" is not a number.

Comparison is exact arithmetic on Fractions (with a 1e-6 relative tolerance
when either side is written as a decimal). A numeric gold answer needs a
numeric prediction: "3+4" does not earn the reward for 7, or a policy could
learn to skip the computation. Only a non-numeric gold answer ("\\sqrt{2}",
"x+1") goes to math-verify, if installed, restricted to its LaTeX parser and
run under a time limit. Model output is never run as code (no eval, exec or
sympify of raw text), and only its last `max_chars` characters are read.

Bounded work, no exceptions: apart from the math-verify call (a child process
killed at its time limit), every function here takes time linear in its input (no regex retries
more than one word or number per start), a gold answer longer than `max_chars`
never matches, and a number written with more than MAX_DIGITS digits is not
read as a number (Python's int() refuses more than 4,300). So `reward` returns
0.0 or 1.0, soon, for any pair of strings. `check_gold` tells a task loader
which gold answers could never be matched.
"""

from __future__ import annotations

import importlib.util
import logging
import multiprocessing
import re
import threading
from fractions import Fraction
from multiprocessing.connection import Connection
from typing import NamedTuple, Sequence

MAX_CHARS = 2000  # the final answer sits at the end; reading less bounds the work
MAX_DIGITS = 1000  # longer numbers are text, not numbers: int() stops at 4300 digits

# A plain number: 1,000 (thousands commas) | 42 | with optional .5 decimals | .5
_NUM = r"(?:(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|\.\d+)"
_FRAC = rf"\\[dt]?frac\{{\s*(?P<fsign>-?)\s*(?P<fnum>{_NUM})\s*\}}\{{\s*(?P<fden>{_NUM})\s*\}}"
_WHOLE_NUMBER = re.compile(
    rf"(?P<sign>[-+]?)\s*(?:{_FRAC}|(?P<num>{_NUM})(?:\s*/\s*(?P<den>{_NUM}))?)"
)
# Numbers in free text. A minus counts as a sign only when it does not follow
# a digit, letter or bracket ("5-3" ends in 3, "x = -3" in -3).
_ANY_NUMBER = re.compile(
    rf"(?:(?<![\w)\]}}])-)?(?:\\[dt]?frac\{{\s*-?(?:{_NUM})\s*\}}\{{\s*(?:{_NUM})\s*\}}|(?:{_NUM})(?:/(?:{_NUM}))?)"
)
_TEXT_WRAPPER = re.compile(r"\\(?:text|textbf|textrm|mathrm|mathbf|mbox)\s*\{([^{}]*)\}")
_NOISE = re.compile(r"\\\$|\$|\\%|%|\\[!,;: ]|\^\{?\\circ\}?|\\left|\\right|\\displaystyle")
# Trailing unit words (" apples", " km/h"), matched on the REVERSED text from its
# start: the forward pattern r"(?:\s+[A-Za-z][A-Za-z/]*)+$" is retried from every
# space and so takes time quadratic in the number of words.
_UNIT_WORDS_REVERSED = re.compile(r"(?:[A-Za-z/]*[A-Za-z]\s+)+")


class Number(NamedTuple):
    """An exact value, and whether it was written with a decimal point."""

    value: Fraction
    decimal: bool


def _plain(text: str) -> str:
    """Unicode minus -> "-", and LaTeX's braced comma "{,}" (1{,}234) -> ","."""
    return text.replace("\u2212", "-").replace("{,}", ",")


def _clean(text: str) -> str:
    """Strip what surrounds an answer: $, %, \\text{...} wrappers, LaTeX spacing,
    a `x =` prefix, trailing periods and whitespace (after `_plain`)."""
    text = _plain(text)
    text = _TEXT_WRAPPER.sub(r" \1 ", text)
    text = _NOISE.sub("", text)
    if "=" in text:
        text = text.rpartition("=")[2]  # "x = 5" -> "5"
    return text.strip().rstrip(".").strip()


def _strip_unit_words(text: str) -> str:
    """`text` without its trailing words, each whitespace then a letter then letters
    or "/": "12 apples" -> "12", "5 km/h" -> "5", "5x" and "5 m2" unchanged."""
    match = _UNIT_WORDS_REVERSED.match(text[::-1])
    return text[: len(text) - match.end()] if match else text


def _count_digits(text: str) -> int:
    return sum(char.isdigit() for char in text)


def _number_parts(text: str) -> tuple[str, str, str | None] | None:
    """(sign, numerator, denominator or None), as written, if `text` has the
    shape of one number once cleaned and stripped of unit words; else None."""
    cleaned = _clean(text)
    match = _WHOLE_NUMBER.fullmatch(cleaned) or _WHOLE_NUMBER.fullmatch(_strip_unit_words(cleaned))
    if match is None:
        return None
    if match["num"] is not None:
        return match["sign"], match["num"], match["den"]
    sign = "-" if (match["sign"] == "-") != (match["fsign"] == "-") else ""
    return sign, match["fnum"], match["fden"]


def parse_number(text: str) -> Number | None:
    """Read `text` as one number (integer, decimal, a/b or \\frac{a}{b}), else None.

    Allows the decorations `_clean` removes and trailing unit words
    ("12 apples"). Anything else, such as "3+4" or "1/0", is not a number, nor
    is one written with more than MAX_DIGITS digits (numerator and denominator
    together), nor "1e5", "inf" or "nan".
    """
    parts = _number_parts(text)
    if parts is None:
        return None
    sign, num, den = parts
    if _count_digits(num + (den or "")) > MAX_DIGITS:
        return None
    value = Fraction(num.replace(",", ""))
    if den is not None:
        divisor = Fraction(den.replace(",", ""))
        if divisor == 0:
            return None
        value /= divisor
    if sign == "-":
        value = -value
    return Number(value, decimal="." in num or "." in (den or ""))


def format_number(number: Number) -> str:
    """Canonical text: "42", "-3", "3.5" (if written as a decimal), "7/2"."""
    value = number.value
    p, q = value.numerator, value.denominator
    if q == 1:
        return str(p)
    twos, fives, rest = 0, 0, q
    while rest % 2 == 0:
        rest, twos = rest // 2, twos + 1
    while rest % 5 == 0:
        rest, fives = rest // 5, fives + 1
    if not number.decimal or rest != 1:
        return f"{p}/{q}"
    places = max(twos, fives)  # q divides 10**places, so the decimal is exact
    digits = str(abs(p) * 10**places // q).rjust(places + 1, "0")
    return f"{'-' if p < 0 else ''}{digits[:-places]}.{digits[-places:]}"


def normalize_answer(text: str) -> str:
    """Canonical form of an answer string: a formatted number if it is one,
    else the cleaned text ("x+1", "\\sqrt{2}")."""
    number = parse_number(text)
    return format_number(number) if number is not None else _clean(text)


def _closing_braces(text: str) -> dict[int, int]:
    """{position of a "{": position of the "}" that closes it}, for every closed
    brace, in one pass. An unmatched "}" closes nothing."""
    closing: dict[int, int] = {}
    open_at: list[int] = []
    for match in re.finditer(r"[{}]", text):
        if match[0] == "{":
            open_at.append(match.start())
        elif open_at:
            closing[open_at.pop()] = match.start()
    return closing


def last_boxed(text: str) -> str | None:
    """Content of the last complete `\\boxed{...}` (or `\\fbox{...}`), nested braces allowed."""
    boxes = list(re.finditer(r"\\(?:boxed|fbox)\s*\{", text))
    if not boxes:
        return None
    closing = _closing_braces(text)
    for match in reversed(boxes):
        end = closing.get(match.end() - 1)
        if end is not None:
            return text[match.end() : end]
    return None


def extract_answer(text: str, *, max_chars: int = MAX_CHARS) -> str | None:
    """The final answer of a completion, normalised, or None when there is none.

    Looks at the last `max_chars` characters only, and prefers the last
    `#### N`, then the last `\\boxed{...}`, then the last number.
    """
    text = _plain(text[-max_chars:])
    if "####" in text:
        final = text.rpartition("####")[2].split("\n", 1)[0]
        if final.strip():
            return normalize_answer(final)
    boxed = last_boxed(text)
    if boxed is not None and boxed.strip():
        return normalize_answer(boxed)
    numbers = _ANY_NUMBER.findall(text)
    if numbers:
        number = parse_number(numbers[-1])
        if number is not None:
            return format_number(number)
    return None


def _close(a: Number, b: Number) -> bool:
    if a.decimal or b.decimal:
        return abs(a.value - b.value) <= Fraction(1, 10**6) * max(abs(a.value), abs(b.value))
    return a.value == b.value


def _squash(text: str) -> str:
    return re.sub(r"\s+", "", _clean(text))


def answers_equal(pred: str, gold: str, *, timeout_s: float = 1.0, max_chars: int = MAX_CHARS) -> bool:
    """Whether an extracted answer matches the gold answer.

    Numeric gold: exact Fraction comparison (1e-6 relative if a decimal is
    involved); the prediction must itself be a number. Non-numeric gold: equal
    text after cleaning, else math-verify's LaTeX equivalence when installed,
    within `timeout_s` seconds (in a child process killed when it overruns:
    `MathVerifyProcess`).
    Never equal: an answer longer than `max_chars`, or a gold answer with
    nothing left after cleaning ("", "$").
    """
    if len(pred) > max_chars or len(gold) > max_chars:
        return False
    gold_number = parse_number(gold)
    if gold_number is not None:
        pred_number = parse_number(pred)
        return pred_number is not None and _close(pred_number, gold_number)
    if not _squash(gold):
        return False
    if _squash(pred) == _squash(gold):
        return True
    return _math_verify_equal(_clean(pred), _clean(gold), timeout_s)


def reward(completion: str, gold: str, *, timeout_s: float = 1.0, max_chars: int = MAX_CHARS) -> float:
    """1.0 if the completion's final answer equals `gold`, else 0.0 (see
    `extract_answer`, `answers_equal`); 0.0 for a gold answer longer than `max_chars`."""
    pred = extract_answer(completion, max_chars=max_chars)
    if pred is None:
        return 0.0
    return 1.0 if answers_equal(pred, gold, timeout_s=timeout_s, max_chars=max_chars) else 0.0


def check_gold(answer: str, *, max_chars: int = MAX_CHARS) -> None:
    """Raise ValueError, with a one-line reason, if `reward` could never give
    `answer` as the gold answer a 1.0: it is not a string, has nothing left after
    cleaning ("", "$"), has the shape of a number with more than MAX_DIGITS
    digits (so is read as text, which no extracted answer matches), or is longer
    than `max_chars` (no longer answer is read from a completion)."""
    if not isinstance(answer, str):
        raise ValueError(f"gold answer must be a string, got {type(answer).__name__}")
    if not _squash(answer):
        raise ValueError(f"gold answer {answer[:60]!r} is empty once $, %, \\text and spacing are removed")
    parts = _number_parts(answer)
    if parts is not None:
        digits = _count_digits(parts[1] + (parts[2] or ""))
        if digits > MAX_DIGITS:
            raise ValueError(f"gold answer is a number with {digits} digits; at most {MAX_DIGITS} are read")
    if len(answer) > max_chars:
        raise ValueError(
            f"gold answer is {len(answer)} characters long; at most {max_chars} are read from a completion"
        )


# The first number never starts inside a run of digits: a match from there would
# also match from the run's start, and retrying every digit is quadratic.
_EQUATION = re.compile(r"(-?(?<!\d)\d+)\s*([-+*x×])\s*(-?\d+)\s*=\s*(-?\d+)")


def equations_correct(text: str, *, max_chars: int = MAX_CHARS) -> bool:
    """True if `text` shows at least one integer equation `a op b = c` (op one of
    + - * x ×) and every such equation is arithmetically right. Parsed with a
    regex and computed with Python ints: nothing is evaluated. An equation with
    a number of more than MAX_DIGITS digits cannot be checked: False."""
    found = _EQUATION.findall(text[-max_chars:])
    if not found:
        return False
    for a, op, b, c in found:
        if max(len(n.lstrip("-")) for n in (a, b, c)) > MAX_DIGITS:
            return False
        x, y = int(a), int(b)
        value = x + y if op == "+" else x - y if op == "-" else x * y
        if value != int(c):
            return False
    return True


def steps_reward(completion: str, gold: str, *, timeout_s: float = 1.0, max_chars: int = MAX_CHARS) -> float:
    """1.0 if the final answer equals `gold` AND every worked step shown is right.

    Outcome-only rewards let a weak policy score with wrong work and a lucky
    final number (with small answers this is most of the positive samples of a
    tiny model), and RL then reinforces the wrong arithmetic. For tasks whose
    solutions are chains of `a op b = c` lines, checking the chain removes that."""
    if reward(completion, gold, timeout_s=timeout_s, max_chars=max_chars) < 1.0:
        return 0.0
    return 1.0 if equations_correct(completion, max_chars=max_chars) else 0.0


def batch_rewards(
    completions: Sequence[str], golds: Sequence[str], *, timeout_s: float = 1.0
) -> list[float]:
    """`reward` for each (completion, gold) pair."""
    if len(completions) != len(golds):
        raise ValueError(f"{len(completions)} completions but {len(golds)} gold answers")
    return [reward(c, g, timeout_s=timeout_s) for c, g in zip(completions, golds)]


# ---------------------------------------------------------------- math-verify


def _quiet_math_verify() -> None:
    # With its own (alarm-based) timeouts off, math-verify warns that the caller
    # must time it; we do (the child process is killed), so hide that warning.
    for name in ("parser", "grader"):
        logging.getLogger(f"math_verify.{name}").disabled = True


def _math_verify_child(conn: Connection) -> None:
    """The child process: import math-verify, say ready, then answer (pred, gold)
    pairs with True/False until the pipe closes."""
    try:
        import math_verify
    except ImportError:
        conn.send("missing")
        return
    _quiet_math_verify()
    # LaTeX only: math-verify's plain-expression parser goes through sympy's
    # parse_expr, which evaluates Python code.
    config = [math_verify.LatexExtractionConfig()]
    conn.send("ready")
    while True:
        try:
            pred, gold = conn.recv()
        except EOFError:
            return
        try:
            gold_parsed = math_verify.parse(f"${gold}$", extraction_config=config, parsing_timeout=None)
            pred_parsed = math_verify.parse(f"${pred}$", extraction_config=config, parsing_timeout=None)
            same = bool(gold_parsed and pred_parsed
                        and math_verify.verify(gold_parsed, pred_parsed, timeout_seconds=None))
        except (ValueError, TypeError, ArithmeticError, RecursionError, MemoryError, AttributeError):
            same = False  # sympy's failures on odd expressions: not equal
        conn.send(same)


class MathVerifyProcess:
    """math-verify in a child process, so that its time limit is hard.

    A timer signal cannot stop sympy while it sits inside one long C-level
    operation (evaluating `9^{9^{9^{9}}}` spends minutes in a single Python
    integer power, measured), so the comparison runs in a child process that
    is killed when it overruns and started again on the next call (spawned,
    not forked: no torch or OpenMP state is copied). Started on first use; a
    lock serialises callers from several threads.
    """

    START_TIMEOUT_S = 60.0  # importing sympy and math-verify in the child

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: multiprocessing.process.BaseProcess | None = None
        self._conn: Connection | None = None
        self.available: bool | None = None  # None: not known yet

    def equal(self, pred: str, gold: str, timeout_s: float) -> bool:
        """math-verify's LaTeX equivalence of `pred` and `gold`; False when it is
        not installed, fails, or takes longer than `timeout_s` (not positive: False)."""
        if not timeout_s > 0 or self.available is False:  # also NaN
            return False
        with self._lock:
            if (self._proc is None or not self._proc.is_alive()) and not self._start():
                return False
            assert self._conn is not None
            self._conn.send((pred, gold))
            if self._conn.poll(timeout_s):
                return bool(self._conn.recv())
            self._stop()  # overran: kill it, a fresh child serves the next call
            return False

    def _start(self) -> bool:
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_math_verify_child, args=(child,), daemon=True, name="fp8rl-math-verify")
        self._proc.start()
        child.close()
        status = self._conn.recv() if self._conn.poll(self.START_TIMEOUT_S) else "timeout"
        if status != "ready":
            self._stop()
            if status == "missing":
                self.available = False
            return False
        self.available = True
        return True

    def _stop(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.join()
        if self._conn is not None:
            self._conn.close()
        self._proc = self._conn = None


# One per process, shared by every reward call (a process is a resource, not state).
MATH_VERIFY = MathVerifyProcess()


def _math_verify_equal(pred: str, gold: str, timeout_s: float) -> bool:
    if importlib.util.find_spec("math_verify") is None:  # not installed: no child to start
        return False
    return MATH_VERIFY.equal(pred, gold, timeout_s)

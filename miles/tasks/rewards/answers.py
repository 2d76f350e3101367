"""The `math` reward: extract a final answer from a response and compare it to the reference.

Extraction, first rule that applies:
1. the contents of the last `\\boxed{...}` (or `\\fbox{...}`), nested braces included;
2. after the last answer marker, "answer is X", "answer: X" or "#### X" (case-insensitive): a
   number at the start of X if there is one, else X up to the end of its line;
3. the last number in the text.

Equivalence: both sides are parsed as exact rationals (`fractions.Fraction`), so integers,
decimals ("0.50" == "0.5" == ".5"), fractions ("1/2", "\\frac{1}{2}", "\\dfrac12", "-\\frac34")
compare by value, after dropping thousands separators ("1,000", "1{,}000"), a leading "+",
surrounding "$" and a trailing "."; "x = 5" compares as its right-hand side. Answers that are not
numbers compare as normalised strings (whitespace, `\\left`/`\\right`, `\\text{}` wrappers and
`\\dfrac`/`\\tfrac` spellings removed; case kept). No symbolic algebra: "2\\sqrt{2}" equals only
itself, and a percent sign or a unit makes an answer non-numeric.
"""

from __future__ import annotations

import re
from fractions import Fraction

from miles.tasks.rewards.scorer import inline

_PLAIN = r"(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+"  # 12, 1,000, 0.5, .5
_SIGN = r"(?:(?<![\w.)}])[-+])?"  # "-3" is a sign, "5-3" a subtraction
_FRAC = r"\\[dt]?frac(?:\{[^{}]*\}\{[^{}]*\}|\d\d)"
NUMBER = re.compile(rf"{_SIGN}(?:{_FRAC}|(?:{_PLAIN})(?:\s*/\s*(?:{_PLAIN}))?)")
ANSWER_MARKER = re.compile(r"(?:\banswer\s*(?:is\b|:)|####)[ \t]*:?", re.IGNORECASE)
_FRAC_PARTS = re.compile(r"\\[dt]?frac(?:\{([^{}]*)\}\{([^{}]*)\}|(\d)(\d))")
_DECIMAL = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)")
_LATEX_NOISE = re.compile(r"\\left|\\right|\\[!,;: ]|\s+")
_TEXT = re.compile(r"\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}")


@inline
def math_answer(response: str, reference: str | None) -> float:
    """1.0 when the answer extracted from `response` equals `reference` (see the module)."""
    if reference is None:
        raise ValueError("the math reward needs a reference answer")
    answer = extract_answer(response)
    if answer is None:
        return 0.0
    return 1.0 if answers_equal(answer, last_boxed(reference) or reference) else 0.0


def extract_answer(text: str) -> str | None:
    """The final answer of `text` by the rules of the module docstring; None if it has none."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    markers = list(ANSWER_MARKER.finditer(text))
    after = text[markers[-1].end():].split("\n", 1)[0].strip() if markers else ""
    if after:
        number = NUMBER.match(after.lstrip("$"))
        return number.group(0) if number else after
    numbers = NUMBER.findall(text)
    return numbers[-1] if numbers else None


def last_boxed(text: str) -> str | None:
    """The contents of the last `\\boxed{...}` or `\\fbox{...}` in `text`, braces balanced."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    begin = text.index("{", start) + 1
    depth = 1
    for i in range(begin, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[begin:i]
    return None  # unbalanced: no answer


def answers_equal(answer: str, reference: str) -> bool:
    """Equal as exact numbers when both parse, else as normalised strings."""
    a, b = parse_number(answer), parse_number(reference)
    if a is not None and b is not None:
        return a == b
    return normalise(answer) == normalise(reference)


def normalise(answer: str) -> str:
    """`answer` without spacing, LaTeX sizing, `\\text{}` wrappers, surrounding `$`, final `.`."""
    text = _TEXT.sub(r"\1", answer)
    text = _LATEX_NOISE.sub("", text).replace("{,}", ",")
    text = text.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    return text.strip("$").rstrip(".")


def parse_number(answer: str) -> Fraction | None:
    """`answer` as an exact rational, or None if it is not one number (see the module)."""
    text = normalise(answer)
    if "=" in text:
        text = text.rsplit("=", 1)[1]
    text = text.strip("$")
    sign = -1 if text.startswith("-") else 1
    text = text[1:] if text[:1] in "+-" else text
    frac = _FRAC_PARTS.fullmatch(text)
    if frac:
        top, bottom = (frac.group(1), frac.group(2)) if frac.group(1) is not None else \
            (frac.group(3), frac.group(4))
        return _ratio(sign, _decimal(top), _decimal(bottom))
    top, slash, bottom = text.partition("/")
    if slash:
        return _ratio(sign, _decimal(top), _decimal(bottom))
    value = _decimal(text)
    return None if value is None else sign * value


def _decimal(text: str) -> Fraction | None:
    """An integer or decimal (thousands separators allowed, no exponent) as a Fraction."""
    text = text.strip()
    if re.fullmatch(r"[-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?", text):
        text = text.replace(",", "")
    if not _DECIMAL.fullmatch(text):
        return None
    try:
        return Fraction(text)
    except ValueError:  # more digits than int() converts
        return None


def _ratio(sign: int, top: Fraction | None, bottom: Fraction | None) -> Fraction | None:
    if top is None or bottom is None or bottom == 0:
        return None
    return sign * top / bottom

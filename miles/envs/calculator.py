"""The `calculator` tool: exact arithmetic on an expression, parsed with `ast`, never `eval`.

Numbers are integers and decimals (`2.5`, `1e3`), computed exactly as fractions; operators
`+ - * / // % **`, unary `+ -` and parentheses. Anything else (names, calls, `^`, comparisons)
is a `ToolError` saying what is not supported. Guards (named below) bound the work: the
expression's length, the exponent, and the size of every intermediate result. A result is
printed as an integer, an exact decimal when it has one (`7/4` -> `1.75`), else `p/q`.
"""

from __future__ import annotations

import ast
import operator
from fractions import Fraction

from miles.errors import ToolError

MAX_EXPRESSION_CHARS = 500
MAX_EXPONENT = 10_000
MAX_RESULT_BITS = 4096
"""Largest numerator or denominator (about 1233 decimal digits) of any intermediate result."""
BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
          ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod}
UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
HINTS = {ast.BitXor: "^ is not a power here, use **", ast.Name: "names are not supported",
         ast.Call: "function calls are not supported"}


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly, e.g. `(12 + 3.5) * 4` or `2 ** 10 // 3`.
    Supports + - * / // % ** and parentheses on integers and decimals."""
    return format_number(evaluate(expression))


def evaluate(expression: str) -> Fraction:
    """The exact value of `expression`; ToolError saying why it cannot be computed."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ToolError(f"expression too long ({len(expression)} characters, at most "
                        f"{MAX_EXPRESSION_CHARS})")
    source = expression.strip()
    try:
        tree = ast.parse(source, mode="eval")
    except SyntaxError:
        raise ToolError(f"not an arithmetic expression: {expression!r}") from None
    return _value(tree.body, source)


def _value(node: ast.AST, source: str) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        literal = ast.get_source_segment(source, node) or repr(node.value)
        return _checked(Fraction(literal.replace("_", "")))
    if isinstance(node, ast.UnaryOp) and type(node.op) in UNARY:
        return UNARY[type(node.op)](_value(node.operand, source))
    if isinstance(node, ast.BinOp) and (type(node.op) in BINARY or isinstance(node.op, ast.Pow)):
        left, right = _value(node.left, source), _value(node.right, source)
        if isinstance(node.op, ast.Pow):
            return _power(left, right)
        if right == 0 and not isinstance(node.op, (ast.Add, ast.Sub, ast.Mult)):
            raise ToolError("division by zero")
        return _checked(BINARY[type(node.op)](left, right))
    hint = HINTS.get(type(getattr(node, "op", node)), f"{type(node).__name__} is not supported")
    raise ToolError(f"unsupported expression: {hint}")


def _power(base: Fraction, exponent: Fraction) -> Fraction:
    if exponent.denominator != 1:
        raise ToolError("only integer exponents are supported")
    power = exponent.numerator
    if abs(power) > MAX_EXPONENT:
        raise ToolError(f"exponent {power} is too large (at most {MAX_EXPONENT})")
    if base == 0 and power < 0:
        raise ToolError("division by zero")
    bits = max(base.numerator.bit_length(), base.denominator.bit_length())
    if (bits - 1) * abs(power) > MAX_RESULT_BITS:
        raise ToolError(f"result too large (more than {MAX_RESULT_BITS} bits)")
    return _checked(base ** power)


def _checked(value: Fraction) -> Fraction:
    if max(value.numerator.bit_length(), value.denominator.bit_length()) > MAX_RESULT_BITS:
        raise ToolError(f"result too large (more than {MAX_RESULT_BITS} bits)")
    return value


def format_number(value: Fraction) -> str:
    """An integer as is, a terminating fraction as an exact decimal, anything else as `p/q`."""
    if value.denominator == 1:
        return str(value.numerator)
    denominator, twos, fives = value.denominator, 0, 0
    while denominator % 2 == 0:
        denominator, twos = denominator // 2, twos + 1
    while denominator % 5 == 0:
        denominator, fives = denominator // 5, fives + 1
    if denominator != 1:
        return f"{value.numerator}/{value.denominator}"
    places = max(twos, fives)
    scaled = abs(value.numerator) * 10 ** places // value.denominator
    whole, fraction = divmod(scaled, 10 ** places)
    sign = "-" if value < 0 else ""
    return f"{sign}{whole}.{str(fraction).rjust(places, '0').rstrip('0')}"

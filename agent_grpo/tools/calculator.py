"""The `calculator` tool: exact arithmetic on a Python-syntax expression, without `eval`.

The expression is parsed with `ast` and only numeric literals, `+ - * / // % **`, unary signs and
parentheses are evaluated; anything else (names, calls, attributes, strings) is rejected with an
error that says which construct is not allowed. Arithmetic is exact (`fractions.Fraction`), so
`0.1 + 0.2` is `0.3` and `7 / 2` is `3.5`; a non-terminating quotient is shown to 12 significant
digits. Exponents and result sizes are capped so a model cannot make the tool hang on `9**9**9`.
"""

import ast
import operator
from collections.abc import Callable
from fractions import Fraction

from agent_grpo.tools.tool import tool

__all__ = ["CalculatorError", "calculator", "evaluate", "format_number"]

MAX_EXPRESSION_CHARS = 500
"""Longer expressions are rejected before parsing (a tool argument, not a program)."""
MAX_EXPONENT = 64
"""Largest exponent magnitude `**` accepts."""
MAX_RESULT_DIGITS = 200
"""Largest numerator or denominator, in decimal digits, of any intermediate value."""

_BINARY: dict[type[ast.operator], Callable[[Fraction, Fraction], Fraction]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: lambda a, b: Fraction(a // b),
    ast.Mod: operator.mod,
}
_SYMBOL = {ast.MatMult: "@", ast.LShift: "<<", ast.RShift: ">>"}


class CalculatorError(ValueError):
    """An expression the calculator refuses or cannot evaluate."""


def _check_size(value: Fraction) -> Fraction:
    limit = 10**MAX_RESULT_DIGITS
    if abs(value.numerator) >= limit or value.denominator >= limit:
        raise CalculatorError(f"result has more than {MAX_RESULT_DIGITS} digits")
    return value


def _power(base: Fraction, exponent: Fraction) -> Fraction:
    if exponent.denominator != 1:
        raise CalculatorError("only whole-number exponents are supported")
    if abs(exponent) > MAX_EXPONENT:
        raise CalculatorError(f"exponent {exponent} is larger than {MAX_EXPONENT}")
    if base == 0 and exponent < 0:
        raise CalculatorError("division by zero")
    return Fraction(base**exponent.numerator)


def _binary(node: ast.BinOp) -> Fraction:
    left, right = _eval(node.left), _eval(node.right)
    if isinstance(node.op, ast.Pow):
        return _power(left, right)
    fn = _BINARY.get(type(node.op))
    if fn is None:
        symbol = _SYMBOL.get(type(node.op), type(node.op).__name__)
        raise CalculatorError(f"operator {symbol} is not supported (use + - * / // % **)")
    if right == 0 and not isinstance(node.op, (ast.Add, ast.Sub, ast.Mult)):
        raise CalculatorError("division by zero")
    return fn(left, right)


def _eval(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        # str() first so 0.1 is the decimal 1/10, not the binary float's exact value.
        return _check_size(Fraction(str(node.value)))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _eval(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp):
        return _check_size(_binary(node))
    raise CalculatorError(f"{type(node).__name__} is not allowed; use numbers and + - * / // % **")


def evaluate(expression: str) -> Fraction:
    """Evaluate an arithmetic expression exactly; raise CalculatorError for anything else."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression is longer than {MAX_EXPRESSION_CHARS} characters")
    # Models often write `×` and `÷`, and `^` for a power (never XOR in arithmetic).
    text = expression.replace("×", "*").replace("÷", "/").replace("^", "**").strip()
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as error:
        raise CalculatorError(f"cannot parse {expression!r}: {error.msg}") from None
    return _eval(tree.body)


def format_number(value: Fraction) -> str:
    """An integer result as digits, anything else as a decimal to 12 significant digits."""
    if value.denominator == 1:
        return str(value.numerator)
    return f"{float(value):.12g}"


@tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression, for example (347 * 29) - 1181."""
    return format_number(evaluate(expression))

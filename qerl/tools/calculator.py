"""An arithmetic tool (the embedded model's recipe: sums it cannot do in its head). It evaluates numbers and
``+ - * / // % **`` with parentheses by walking the expression's syntax tree: nothing else is evaluated."""

from __future__ import annotations

import ast
import operator

OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
             ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
MAX_EXPONENT = 64  # 9**64 is still a quick number; a larger power could take the trainer's memory


def evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Expression):
        return evaluate(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = evaluate(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
        left, right = evaluate(node.left), evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ValueError(f"exponent {right} is too large")
        return OPERATORS[type(node.op)](left, right)
    raise ValueError(f"only numbers and + - * / // % ** are allowed, not {ast.unparse(node)!r}")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression, e.g. "123456 + 654321".

    Args:
        expression: Numbers with + - * / // % ** and parentheses.
    """
    value = evaluate(ast.parse(expression.strip(), mode="eval"))
    return str(int(value) if isinstance(value, float) and value.is_integer() else value)

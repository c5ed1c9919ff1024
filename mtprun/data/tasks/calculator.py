"""Multi-turn tool use: the assistant calls a calculator, reads its long trace, answers.

    user:      What is 37*14+5?
    assistant: <tool_call>{"name":"calculator","arguments":{"expression":"37*14+5"}}</tool_call>
    tool:      calculator 1.4 (exact integer mode) ... result: 523   (hundreds of characters)
    assistant: 523

The tool's trace is long on purpose: like real agentic tool output, it makes most response
tokens tool tokens, which are inserted by the environment and must not be trained.
"""

from __future__ import annotations

import ast
import operator
import random
import re
from collections.abc import Callable

from mtprun.data.environment import Environment, EnvStep
from mtprun.data.messages import Conversation, Message, Prompt, ToolCall
from mtprun.data.tasks.base import DrawnTask

TOOL_NAME = "calculator"
_OPERATORS: dict[type[ast.operator], tuple[str, Callable[[int, int], int]]] = {
    ast.Add: ("+", operator.add),
    ast.Sub: ("-", operator.sub),
    ast.Mult: ("*", operator.mul),
}
_MAX_DIGITS = 30
_TOKEN = re.compile(r"\d+|\S")


class CalculatorError(ValueError):
    pass


class CalculatorEnvironment(Environment):
    """Runs the calculator on each call of the model's turn; a turn without calls (the
    answer) ends the episode. The task's reward scores it (this environment gives none)."""

    def step(self, messages: Conversation) -> EnvStep:
        calls = messages[-1].tool_calls
        if not calls:
            return EnvStep(done=True)
        return EnvStep([Message("tool", "\n".join(run_tool_call(call) for call in calls))])


class CalculatorToolTask(DrawnTask):
    """Prompts `a*b+c` with two-digit factors: hard to do in one's head, easy with the tool."""

    name = "calculator_tool"
    environment = CalculatorEnvironment

    def draw(self, rng: random.Random) -> tuple[str, str]:
        a, b, c = rng.randint(10, 99), rng.randint(10, 99), rng.randint(1, 99)
        return f"What is {a}*{b}+{c}?", str(a * b + c)

    def expert_reply(self, conversation: Conversation, prompt: Prompt) -> Message:
        if conversation[-1].role == "tool":
            return Message("assistant", prompt.answer)
        expression = prompt.messages[-1].content.removeprefix("What is ").removesuffix("?")
        return Message("assistant", "", (ToolCall(TOOL_NAME, {"expression": expression}),))


def run_tool_call(call: ToolCall) -> str:
    """The tool's output for one call; mistakes come back as text the model can read."""
    if call.name != TOOL_NAME:
        return f"error: unknown tool {call.name!r}; the only tool is {TOOL_NAME!r}"
    expression = call.arguments.get("expression")
    if not isinstance(expression, str):
        return 'error: calculator takes {"expression": "<integer arithmetic>"}'
    try:
        return calculator_trace(expression)
    except CalculatorError as err:
        return f"calculator 1.4 (exact integer mode)\ninput: {expression}\nerror: {err}"


def calculator_trace(expression: str) -> str:
    """Evaluate integer + - * arithmetic and report every step, as a verbose tool would."""
    try:
        tree = ast.parse(expression, mode="eval")
    except SyntaxError as err:
        raise CalculatorError(f"cannot parse: {err.msg}") from None
    steps: list[str] = []
    result = _evaluate(tree.body, steps)
    lines = [
        "calculator 1.4 (exact integer mode)",
        f"input: {expression}",
        "tokens: " + " | ".join(_TOKEN.findall(expression)),
        f"parsed: {ast.unparse(tree)}",
        *(f"step {i}: {step}" for i, step in enumerate(steps, 1)),
        f"digits: {len(str(abs(result)))}, sign: {'-' if result < 0 else '+'}, "
        f"parity: {'odd' if result % 2 else 'even'}",
        "checks: overflow none, rounding none, precision exact",
        f"result: {result}",
    ]
    return "\n".join(lines)


def _evaluate(node: ast.expr, steps: list[str]) -> int:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_evaluate(node.operand, steps)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        symbol, apply = _OPERATORS[type(node.op)]
        left, right = _evaluate(node.left, steps), _evaluate(node.right, steps)
        value = apply(left, right)
        if len(str(abs(value))) > _MAX_DIGITS:
            raise CalculatorError(f"result has more than {_MAX_DIGITS} digits")
        steps.append(f"{left} {symbol} {right} = {value}")
        return value
    raise CalculatorError(f"unsupported syntax {ast.unparse(node)!r}: use integers, + - * ( )")

"""A multi-turn verifiers (0.4) taskset: `What is a*b+c?`, with a calculator tool to call.

The tool lives in a `vf.Toolset` (`@vf.tool` methods; verifiers serves it over MCP to its own
harnesses). mtprun calls the tools in-process between the policy's turns: a turn with tool
calls gets one tool message per call, a turn without ends the episode, which the task's
`@vf.reward`s then score. The questions and the call (`{"expression": "37*14+5"}`) are those
of mtprun's built-in calculator_tool task, so its demonstrations can warm-start the policy.

    task:
      environment: verifiers:verifiers_calculator.py
      max_turns: 2  # a tool call, then the answer
"""

from __future__ import annotations

import ast
import operator
import random
from collections.abc import Iterator

import verifiers.v1 as vf

ROWS = 200
_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def evaluate(node: ast.expr) -> int:
    """Integer arithmetic with + - * only (no names, calls or powers)."""
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](evaluate(node.left), evaluate(node.right))
    raise ValueError(f"unsupported: {ast.unparse(node)!r} (integers and + - * only)")


class Calculator(vf.Toolset[vf.ToolsetConfig]):
    TOOL_PREFIX = None  # the tool is called `calculator`, not `calculator_calculator`

    @vf.tool
    async def calculator(self, expression: str) -> str:
        """Evaluate integer arithmetic with + - * and parentheses."""
        value = evaluate(ast.parse(expression, mode="eval").body)
        return f"input: {expression}\nresult: {value}"


class QuestionData(vf.TaskData):
    answer: str


class CalculatorTask(vf.Task[QuestionData, vf.State, vf.TaskConfig]):
    @classmethod
    def toolsets(cls, config: vf.TaskConfig) -> list[vf.Toolset]:
        return [Calculator(vf.ToolsetConfig())]

    @vf.reward(weight=1.0)
    async def correct(self, task: QuestionData, trace: vf.Trace) -> float:
        return float(trace.last_reply == task.answer)

    @vf.reward(weight=0.2)
    async def used_tool(self, trace: vf.Trace) -> float:
        return float(len(trace.tool_messages) > 0)


class CalculatorTaskset(vf.Taskset[CalculatorTask, vf.TasksetConfig]):
    def load(self) -> Iterator[CalculatorTask]:
        rng = random.Random(0)
        for _ in range(ROWS):
            a, b, c = rng.randint(10, 99), rng.randint(10, 99), rng.randint(1, 99)
            data = QuestionData(prompt=f"What is {a}*{b}+{c}?", answer=str(a * b + c))
            yield CalculatorTask(data, self.config.task)


__all__ = ["CalculatorTaskset"]

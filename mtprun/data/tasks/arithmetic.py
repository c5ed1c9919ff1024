"""Arithmetic: "12+7=" -> "19". Small operands so a 2-layer, hidden-128 model learns it in a
few CPU minutes."""

from __future__ import annotations

from mtprun.data.messages import Conversation, Message
from mtprun.data.tasks.base import Prompt, Task, rng_for


class ArithmeticTask(Task):
    """Sums and differences of integers in [0, max_operand]; differences are never negative."""

    name = "arithmetic"

    def __init__(self, max_operand: int = 20) -> None:
        self.max_operand = max_operand

    def prompts(self, n: int, seed: int) -> list[Prompt]:
        rng = rng_for(self.name, seed)
        out = []
        for _ in range(n):
            a, b = rng.randint(0, self.max_operand), rng.randint(0, self.max_operand)
            if rng.random() < 0.5:
                question, answer = f"{a}+{b}=", a + b
            else:
                a, b = max(a, b), min(a, b)
                question, answer = f"{a}-{b}=", a - b
            out.append(Prompt((Message("user", question),), str(answer)))
        return out

    def expert_reply(self, conversation: Conversation, prompt: Prompt) -> Message:
        return Message("assistant", prompt.answer)

"""Arithmetic: "12+7=" -> "19". Small operands so a 2-layer, hidden-128 model learns it in a
few CPU minutes."""

from __future__ import annotations

import random

from mtprun.data.tasks.base import DrawnTask


class ArithmeticTask(DrawnTask):
    """Sums and differences of integers in [0, max_operand]; differences are never negative."""

    name = "arithmetic"

    def __init__(self, max_operand: int = 20) -> None:
        self.max_operand = max_operand

    def draw(self, rng: random.Random) -> tuple[str, str]:
        a, b = rng.randint(0, self.max_operand), rng.randint(0, self.max_operand)
        if rng.random() < 0.5:
            return f"{a}+{b}=", str(a + b)
        a, b = max(a, b), min(a, b)
        return f"{a}-{b}=", str(a - b)

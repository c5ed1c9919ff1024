"""Single-digit addition: "3+4=" -> "7". The quickstart's task: 100 distinct problems with
answers 0..18, easy enough that a short SFT warm-start gets the format right and leaves
GRPO a policy whose pass@k is high but pass@1 at temperature 1 is low: the case GRPO sharpens
fast."""

from __future__ import annotations

import random

from mtprun.data.tasks.base import DrawnTask


class AdditionTask(DrawnTask):
    """Sums a+b of integers a, b in [0, 9], drawn uniformly (with replacement)."""

    name = "addition"

    def draw(self, rng: random.Random) -> tuple[str, str]:
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        return f"{a}+{b}=", str(a + b)

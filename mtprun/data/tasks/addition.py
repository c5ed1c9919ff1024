"""Single-digit addition: "3+4=" -> "7". The quickstart's task: 100 distinct problems with
answers 0..18, easy enough that a short SFT warm-start gets the format right and leaves
GRPO a policy whose pass@k is high but pass@1 at temperature 1 is low: the case GRPO sharpens
fast."""

from __future__ import annotations

from mtprun.data.messages import Conversation, Message
from mtprun.data.tasks.base import Prompt, Task, rng_for


class AdditionTask(Task):
    """Sums a+b of integers a, b in [0, 9], drawn uniformly (with replacement)."""

    name = "addition"

    def prompts(self, n: int, seed: int) -> list[Prompt]:
        rng = rng_for(self.name, seed)
        out = []
        for _ in range(n):
            a, b = rng.randint(0, 9), rng.randint(0, 9)
            out.append(Prompt((Message("user", f"{a}+{b}="),), str(a + b)))
        return out

    def expert_reply(self, conversation: Conversation, prompt: Prompt) -> Message:
        return Message("assistant", prompt.answer)

"""An example user environment: the model answers, is told when it is wrong, and tries again.

mtprun makes one object per episode (called with no arguments), `reset`s it with the prompt
(its `messages`, its `answer` and its `record`: every column of the dataset row), then calls
`step` with the whole conversation after each of the model's turns, until `done` or
task.max_turns. It rewards every episode itself, so the recipe needs no task.reward.
"""

from __future__ import annotations

from mtprun.data.environment import Environment, EnvStep


class TryAgain(Environment):  # the base class is optional: reset and step are what counts
    """1 for a right first answer, halved for each retry; 0 while it is still wrong."""

    def reset(self, prompt):
        self.answer = prompt.answer  # a string: the dataset's answer column
        carry = prompt.columns().get("difficulty") == "carry"  # any column of the row
        self.hint = "Mind the carry." if carry else ""
        self.tries = 0
        return prompt.messages

    def step(self, messages):
        self.tries += 1
        if messages[-1].content.strip() == self.answer:
            return EnvStep(done=True, reward=0.5 ** (self.tries - 1))
        # The last reward given counts: an episode out of turns ends with this 0.
        return EnvStep([{"role": "user", "content": f"No. {self.hint}".strip()}], reward=0.0)

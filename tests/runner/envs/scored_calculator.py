"""A user environment, given to the agentic end-to-end run as `file.py:Class`: it answers
calculator calls (async, as an environment calling a service would) and scores every step
itself, offset by REWARD_OFFSET so the run's rewards show they are its own (GRPO's
group-normalised advantages do not see a constant offset)."""

from __future__ import annotations

from mtprun.data.environment import EnvStep
from mtprun.data.tasks.calculator import run_tool_call

REWARD_OFFSET = 10.0


class ScoredCalculator:  # no base class: any class with reset and step is an environment
    def reset(self, prompt):
        self.answer = prompt.answer
        return prompt.messages

    async def step(self, messages):
        last = messages[-1]
        if last.tool_calls:
            trace = "\n".join(run_tool_call(call) for call in last.tool_calls)
            return EnvStep([{"role": "tool", "content": trace}], reward=REWARD_OFFSET)
        correct = last.content.strip() == self.answer
        return EnvStep(done=True, reward=REWARD_OFFSET + float(correct))

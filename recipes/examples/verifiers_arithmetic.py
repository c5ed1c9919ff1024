"""A single-turn verifiers (0.4) taskset: `a+b=` sums, scored by exact match.

verifiers 0.4 describes an environment as a taskset package: a `Taskset` subclass exported
through `__all__` whose `load()` yields tasks, each a `Task` holding its row (`TaskData`:
the prompt plus any fields of its own, here the answer) with `@vf.reward` methods that score
a finished trace, weighted (the rubric). mtprun reads the prompts from the tasks, samples the
policy itself, and scores each episode with the task's rewards: `reward/<name>` each, their
weighted sum the episode's reward.

    task:
      environment: verifiers:verifiers_arithmetic.py  # or verifiers:<installed module>
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import verifiers.v1 as vf

ROWS = 300  # generated, no downloads


class SumData(vf.TaskData):
    answer: str


class SumTask(vf.Task[SumData, vf.State, vf.TaskConfig]):
    @vf.reward(weight=1.0)
    async def exact_match(self, task: SumData, trace: vf.Trace) -> float:
        return float(trace.last_reply == task.answer)

    @vf.reward(weight=0.1)
    async def digits_only(self, trace: vf.Trace) -> float:
        return float(trace.last_reply.isdigit())


class SumTaskset(vf.Taskset[SumTask, vf.TasksetConfig]):
    def load(self) -> Iterator[SumTask]:
        rng = random.Random(0)
        for _ in range(ROWS):
            a, b = rng.randint(0, 49), rng.randint(0, 49)
            yield SumTask(SumData(prompt=f"{a}+{b}=", answer=str(a + b)), self.config.task)


__all__ = ["SumTaskset"]

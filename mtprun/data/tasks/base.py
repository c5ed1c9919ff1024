"""What an RL task is: prompts with a reference answer, a scripted expert, optional tools."""

from __future__ import annotations

import random
from abc import ABC, abstractmethod

from mtprun.data.environment import (
    SingleTurn,
    inserted_messages,
    make_environment,
    reset_all,
    step_all,
)
from mtprun.data.messages import Conversation, Message, Prompt

EVAL_PROMPTS = 32  # prompts an evaluation draws from a synthetic task


class Task(ABC):
    """A source of prompts for RL, and of demonstrations for SFT warm starts.

    The runner's rollout loop per prompt: an `environment` object (one per episode) starts the
    conversation from the prompt, the policy samples an assistant turn, the environment
    answers it (see `mtprun.data.environment`), until it says done or task.max_turns is
    reached. The recipe's task.environment replaces the task's own; task.reward names the
    reward (see `mtprun.data.rewards`) that scores episodes the environment gives no reward.
    """

    name: str
    # The task's own environment; built-in tool tasks set theirs.
    environment: type = SingleTurn

    @abstractmethod
    def prompts(self, n: int, seed: int) -> list[Prompt]:
        """`n` prompts, the same for the same seed."""

    def step_prompts(self, n: int, seed: int, step: int, sampling_round: int = 0) -> list[Prompt]:
        """The `n` prompts of RL step `step` (of its dynamic-sampling round `sampling_round`
        after the first): the same for the same seed, step and round (a resumed step sees the
        prompts it saw), distinct from step to step and round to round."""
        uses = (step, sampling_round) if sampling_round else (step,)
        return self.prompts(n, seed=step_seed(seed, *uses))

    def heldout_prompts(self, n: int | None, seed: int) -> list[Prompt]:
        """Evaluation prompts: a synthetic task draws them from a stream of their own (which
        may repeat training prompts of a small task); datasets hold rows out."""
        return self.prompts(n or EVAL_PROMPTS, seed=step_seed(seed, "eval"))

    def expert_reply(self, conversation: Conversation, prompt: Prompt) -> Message:
        """The scripted expert's next assistant message: the oracle behind demonstrations.
        By default it states the reference answer (single-turn tasks); tool tasks override
        it."""
        return Message("assistant", prompt.answer or "")

    def demonstration(self, prompt: Prompt, max_turns: int = 8) -> Conversation:
        """The full conversation the expert has on `prompt` in the task's environment."""
        env = make_environment(self.environment)
        (conversation,) = reset_all([env], [prompt])
        for _ in range(max_turns):
            conversation = (*conversation, self.expert_reply(conversation, prompt))
            (result,) = step_all([env], [conversation])
            if result.done:
                return conversation
            conversation = (*conversation, *inserted_messages(result))
        raise RuntimeError(f"task {self.name}: the expert did not finish in {max_turns} turns")

    def sft_examples(self, n: int, seed: int) -> list[Conversation]:
        """`n` expert demonstrations: SFT data for a warm start."""
        return [self.demonstration(p) for p in self.prompts(n, seed)]


class DrawnTask(Task):
    """A task whose prompts are one user question each, drawn one by one from a stream
    seeded by the task's name and the seed."""

    def prompts(self, n: int, seed: int) -> list[Prompt]:
        rng = rng_for(self.name, seed)
        return [Prompt((Message("user", q),), a) for q, a in (self.draw(rng) for _ in range(n))]

    @abstractmethod
    def draw(self, rng: random.Random) -> tuple[str, str]:
        """One (question, reference answer) pair from `rng`."""


def rng_for(task: str, seed: int) -> random.Random:
    # Seeded per task so two tasks in one recipe do not share a stream.
    return random.Random(f"{task}:{seed}")


def step_seed(seed: int, *use: int | str) -> int:
    """The seed of one use of the recipe's seed: an RL step's prompts (step, and its
    dynamic-sampling round after the first), an evaluation ("eval")."""
    return random.Random(":".join(map(str, (seed, *use)))).randrange(2**31)

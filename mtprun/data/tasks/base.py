"""What an RL task is: prompts with a reference answer, a scripted expert, optional tools."""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

from mtprun.data.environment import (
    SingleTurn,
    inserted_messages,
    make_environment,
    reset_all,
    step_all,
)
from mtprun.data.messages import Conversation, Message

# A reward scores a finished conversation against its prompt's reference answer, in [0, 1].
RewardFn = Callable[[Conversation, "Prompt"], float]


@dataclass(frozen=True)
class Prompt:
    messages: Conversation
    answer: str


class Task(ABC):
    """A source of prompts for RL, and of demonstrations for SFT warm starts.

    The runner's rollout loop per prompt: an `environment` object (one per episode) starts the
    conversation from the prompt, the policy samples an assistant turn, the environment
    answers it (see `mtprun.data.environment`), until it says done or task.max_turns is
    reached. The recipe's task.environment replaces the task's own; task.reward names the
    reward (see `get_reward`) that scores episodes the environment gives no reward.
    """

    name: str
    # The task's own environment; built-in tool tasks set theirs.
    environment: type = SingleTurn

    @abstractmethod
    def prompts(self, n: int, seed: int) -> list[Prompt]:
        """`n` prompts, the same for the same seed."""

    def expert_reply(self, conversation: Conversation, prompt: Prompt) -> Message:
        """The scripted expert's next assistant message: the oracle behind demonstrations.
        By default it states the reference answer (single-turn tasks); tool tasks override
        it."""
        return Message("assistant", prompt.answer)

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


def final_answer(conversation: Conversation) -> str | None:
    """The content of the last assistant message without tool calls, stripped."""
    for message in reversed(conversation):
        if message.role == "assistant":
            return None if message.tool_calls else message.content.strip()
    return None


def exact_answer_reward(conversation: Conversation, prompt: Prompt) -> float:
    """1 when the final assistant answer equals the reference answer, else 0."""
    return float(final_answer(conversation) == prompt.answer)

"""What an RL task is: prompts with a reference answer, a scripted expert, optional tools."""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

from mtprun.data.messages import Conversation, Message

# A reward scores a finished conversation against its prompt's reference answer, in [0, 1].
RewardFn = Callable[[Conversation, "Prompt"], float]


@dataclass(frozen=True)
class Prompt:
    messages: Conversation
    answer: str


class Task(ABC):
    """A source of prompts for RL, and of demonstrations for SFT warm starts.

    The runner's rollout loop per prompt: render `prompt.messages` with a generation prompt,
    sample an assistant turn, append it, ask `tool_response`; stop on None (or at the
    recipe's task.max_turns), else append the tool message and sample again. The recipe's
    task.reward names the reward (see `get_reward`) that scores the finished conversation.
    """

    name: str

    @abstractmethod
    def prompts(self, n: int, seed: int) -> list[Prompt]:
        """`n` prompts, the same for the same seed."""

    def expert_reply(self, conversation: Conversation, prompt: Prompt) -> Message:
        """The scripted expert's next assistant message: the oracle behind demonstrations.
        By default it states the reference answer (single-turn tasks); tool tasks override
        it."""
        return Message("assistant", prompt.answer)

    def tool_response(self, conversation: Conversation) -> Message | None:
        """The environment's answer to the last assistant turn, or None when it ends the
        episode. Tasks without tools always end after one turn."""
        return None

    def demonstration(self, prompt: Prompt, max_turns: int = 8) -> Conversation:
        """The full conversation the expert has on `prompt`, through the rollout loop."""
        conversation = prompt.messages
        for _ in range(max_turns):
            conversation = (*conversation, self.expert_reply(conversation, prompt))
            tool_message = self.tool_response(conversation)
            if tool_message is None:
                return conversation
            conversation = (*conversation, tool_message)
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

from __future__ import annotations

import random

from mtprun.data.messages import Message
from mtprun.data.tasks import get_task


def test_addition_prompts_are_single_digit_sums() -> None:
    for prompt in get_task("addition").prompts(50, random.randrange(10_000)):
        (question,) = prompt.messages
        a, b = question.content.removesuffix("=").split("+")
        assert len(a) == len(b) == 1
        assert prompt.answer == str(int(a) + int(b))


def test_addition_draws_all_one_hundred_problems() -> None:
    prompts = get_task("addition").prompts(2000, random.randrange(10_000))
    assert len({p.messages[0].content for p in prompts}) == 100


def test_addition_reward_scores_the_exact_sum(reward_of) -> None:
    task, reward = get_task("addition"), reward_of("addition")
    for prompt in task.prompts(10, random.randrange(10_000)):
        demonstration = task.demonstration(prompt)
        assert reward(demonstration, prompt) == 1.0
        wrong = (*demonstration[:-1], Message("assistant", str(int(prompt.answer) + 1)))
        assert reward(wrong, prompt) == 0.0
        padded = (*demonstration[:-1], Message("assistant", f" {prompt.answer}\n"))
        assert reward(padded, prompt) == 1.0

"""Built-in rewards. They follow the calling convention of user rewards (call.py)."""

from __future__ import annotations

from mtprun.data.rewards.registry import register_reward


# The synthetic tasks' names are aliases: their recipes name the reward after the task.
@register_reward("exact_answer", "addition", "arithmetic", "calculator_tool")
def exact_answer(completion: str, answer: str | None) -> float:
    """1 when the final answer, stripped, is the reference answer, else 0."""
    return float(answer is not None and completion.strip() == answer.strip())


@register_reward("math")
def math_answer(completion: str, answer: str | None) -> float:
    """1 when math-verify finds the completion's final answer mathematically equal to the
    reference answer (LaTeX, \\boxed{}, fractions, plain numbers), else 0."""
    from math_verify import parse, verify

    if answer is None:
        return 0.0
    gold = parse(answer if "$" in answer or "\\boxed" in answer else f"${answer}$")
    return float(bool(gold) and verify(gold, parse(completion)))


@register_reward("reasoning_gym")
def reasoning_gym(prompt: dict, completion: str) -> float:
    """The reasoning-gym dataset's own `score_answer` of the completion (the text of its
    `<answer>` tag when it has one), for prompts of task.prompts: {reasoning_gym: <name>}."""
    from mtprun.data.reasoning_gym import score

    return score(prompt, completion)

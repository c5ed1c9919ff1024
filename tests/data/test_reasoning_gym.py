"""reasoning-gym prompts and their scorer: a dataset's entries as prompts (a seeded stream of
epochs, evaluation entries of their own), the built-in `reasoning_gym` reward (the dataset's
score_answer, given the answer without its reasoning), and the endpoint judge's template and
score parsing."""

from __future__ import annotations

import pytest

from mtprun.data.messages import Message
from mtprun.data.reasoning_gym import dataset_problem
from mtprun.data.rewards import RewardInput, RewardValueError, call_reward, load_reward
from mtprun.data.rewards.endpoint import parse_score, render, template_problem
from mtprun.data.tasks import Prompt, task_for
from mtprun.data.tasks.gym_prompts import gym_eval_prompts
from mtprun.spec.data import ReasoningGymSpec, TaskSection

CONFIG = {"min_terms": 2, "max_terms": 2, "max_digits": 1, "operators": ["+", "-"]}


def _task(size: int = 5, **extra):
    spec = {"reasoning_gym": "basic_arithmetic", "size": size, "config": CONFIG, **extra}
    return task_for(TaskSection(prompts=spec), seed=3)


def _score(prompt: Prompt, content: str, reasoning: str = "") -> float:
    conversation = (*prompt.messages, Message("assistant", content, reasoning_content=reasoning))
    return call_reward(load_reward("reasoning_gym"), RewardInput.of(prompt, conversation))["total"]


def test_steps_walk_the_dataset_epoch_by_epoch() -> None:
    task = _task(size=5)
    prompts = [p for step in (1, 2, 3, 4, 5) for p in task.step_prompts(2, seed=3, step=step)]
    first, second = prompts[:5], prompts[5:10]
    assert sorted(p.messages[0].content for p in first) == sorted(
        p.messages[0].content for p in second
    )  # each epoch visits every entry once
    assert [p.answer for p in task.step_prompts(2, 3, 2)] == [p.answer for p in prompts[2:4]]
    question = first[0].messages[0].content
    assert question.startswith("Calculate ") and first[0].messages[0].role == "user"
    assert first[0].record["reasoning_gym"]["dataset"] == "basic_arithmetic"


def test_evaluation_entries_come_from_a_seed_of_their_own() -> None:
    task = _task(size=50)
    training = {p.messages[0].content for p in task.step_prompts(50, 3, 1)}
    heldout = task.heldout_prompts(8, seed=3)
    assert len(heldout) == 8 and heldout == task.heldout_prompts(8, seed=3)
    assert sum(p.messages[0].content in training for p in heldout) < 4
    spec = ReasoningGymSpec(reasoning_gym="leg_counting", size=3)
    own = gym_eval_prompts(spec, seed=3, n=None)
    assert len(own) == 3 and "legs" in own[0].messages[0].content
    assert [p.answer for p in gym_eval_prompts(spec.model_copy(update={"seed": 7}), 3, 2)] == [
        p.answer for p in gym_eval_prompts(spec.model_copy(update={"seed": 7}), 9, 2)
    ]  # an explicit seed, whatever the recipe's


def test_the_dataset_scores_the_answer_without_its_reasoning() -> None:
    (prompt,) = _task().prompts(1, seed=0)
    assert _score(prompt, prompt.answer) == 1.0
    assert _score(prompt, f"<answer>{prompt.answer}</answer>") == 1.0
    assert _score(prompt, f" {prompt.answer}\n", reasoning="the sum is 12345") == 1.0
    assert _score(prompt, "12345", reasoning=prompt.answer) == 0.0


def test_the_reasoning_gym_reward_needs_a_reasoning_gym_prompt() -> None:
    prompt = Prompt((Message("user", "1+1="),), "2")
    with pytest.raises(ValueError, match="no 'reasoning_gym' column"):
        _score(prompt, "2")


def test_dataset_problems_name_the_value() -> None:
    assert dataset_problem("basic_arithmetic", CONFIG) is None
    field, message = dataset_problem("leg_countin", {})
    assert field == "name" and "(did you mean 'leg_counting' or " in message
    field, message = dataset_problem("basic_arithmetic", {"max_term": 2})
    assert field == "config" and "no config field 'max_term' (did you mean 'max_terms'?)" in message
    field, message = dataset_problem("basic_arithmetic", {"min_terms": 3, "max_terms": 2})
    assert field == "config" and "max_terms must be >= min_terms" in message


def test_judge_templates_render_known_fields_only(tmp_path) -> None:
    good = tmp_path / "good.txt"
    good.write_text('Q: {question} A: {completion} R: {answer} {prompt[op]} {{"json": 1}}')
    assert template_problem(str(good)) is None
    prompt = Prompt((Message("user", "6*7?"),), None, {"op": "*"})
    episode = RewardInput.of(prompt, (*prompt.messages, Message("assistant", "42")))
    assert render(good.read_text(), episode) == 'Q: 6*7? A: 42 R:  * {"json": 1}'
    bad = tmp_path / "bad.txt"
    bad.write_text("Q: {question} A: {completoin}")
    assert "field {completoin} is not one mtprun fills (did you mean 'completion'?)" in (
        template_problem(str(bad))
    )
    bad.write_text('{"score": 1}')
    assert "is not one mtprun fills" in template_problem(str(bad))
    bad.write_text("{question")
    assert "is not a format template" in template_problem(str(bad))
    assert "cannot read" in template_problem(str(tmp_path / "none.txt"))


def test_scores_are_parsed_or_rejected() -> None:
    assert parse_score(r"Score: (\d+)", "ok\nScore: 7\nScore: 3") == 7.0
    assert parse_score(r"-?\d+(\.\d+)?", "it is 0.75") == 0.75  # first group
    assert parse_score(r"\d+", "it is 12") == 12.0  # no group: the whole match
    with pytest.raises(RewardValueError, match="no match"):
        parse_score(r"Score: (\d+)", "I refuse")
    with pytest.raises(RewardValueError, match="not a number"):
        parse_score(r"Score: (\w+)", "Score: high")

"""reasoning-gym prompts, endpoint judges and weighted `task.rewards` as `mtprun validate`
checks them: each problem at the value that caused it."""

from __future__ import annotations

from mtprun.preflight import check_recipe

HEAD = """\
name: t
model:
  tiny:
    hidden: 128
    heads: 2
    kv_heads: 1
losses: [{kind: grpo}]
task:
"""  # the task's fields start on line 9


def test_reasoning_gym_prompts_need_no_reward_and_draw_their_eval(write_recipe, located) -> None:
    path = write_recipe(
        HEAD + "  prompts: {reasoning_gym: leg_counting, size: 10, config: {max_animals: 4}}\n"
        "eval: {num_prompts: 4}\n"
    )
    assert located(path) == []
    recipe = check_recipe(path).recipe
    assert recipe.task.effective_reward == "reasoning_gym"
    assert recipe.task.prompts.seed is None and recipe.task.prompts.config == {"max_animals": 4}


def test_an_unknown_dataset_or_config_field_is_an_error_at_its_value(write_recipe, located) -> None:
    path = write_recipe(
        HEAD + "  prompts: {reasoning_gym: leg_countin}\n"
        "eval:\n  prompts: {reasoning_gym: basic_arithmetic, config: {max_term: 3}}\n"
    )
    found = located(path)
    assert len(found) == 2, found
    assert found[0].startswith(
        f"{path}:9:28: unknown reasoning-gym dataset 'leg_countin' (did you mean 'leg_counting'"
    )
    assert found[1].startswith(
        f"{path}:11:46: reasoning-gym dataset 'basic_arithmetic' has no config field 'max_term' "
        "(did you mean 'max_terms'?); its fields: min_terms, max_terms"
    )
    path = write_recipe(
        HEAD + "  prompts: {reasoning_gym: chain_sum, config: {min_terms: 5, max_terms: 2}}\n"
    )
    assert located(path) == [
        f"{path}:9:39: reasoning-gym dataset 'chain_sum' rejects this config: AssertionError: "
        "max_terms must be >= min_terms"
    ]
    path = write_recipe(HEAD + "  prompts: {reasoning_gym: chain_sum, config: {seed: 1}}\n")
    assert located(path) == [
        f"{path}:9:39: task.prompts.config: set seed beside reasoning_gym (prompts.seed), not in "
        "config"
    ]


def test_an_endpoint_judge_template_is_relative_and_checked(write_recipe, located) -> None:
    judge = "  reward: {url: 'http://127.0.0.1:9/v1', model: m, prompt: judge/p.txt}\n"
    recipe = HEAD + "  name: arithmetic\n" + judge
    path = write_recipe(recipe)
    assert located(path) == [
        f"{path}:10:60: cannot read the judge's prompt template: No such file or directory: "
        f"{path.parent}/judge/p.txt"
    ]
    (path.parent / "judge").mkdir()
    (path.parent / "judge" / "p.txt").write_text("{question} -> {completion} ({answr})")
    assert located(path) == [
        f"{path}:10:60: {path.parent}/judge/p.txt: the template's field {{answr}} is not one "
        "mtprun fills (did you mean 'answer'?); fields: {question}, {completion}, {answer}, "
        "{reasoning}, {prompt} ({prompt[<column>]}: a column of the prompt's record); write {{ "
        "and }} for literal braces"
    ]
    (path.parent / "judge" / "p.txt").write_text("{question} -> {completion} ({answer})")
    assert located(path) == []
    assert check_recipe(path).recipe.task.reward.prompt == f"{path.parent}/judge/p.txt"
    bad = HEAD + "  name: arithmetic\n  reward: {url: 'localhost:8000', model: m, prompt: p}\n"
    assert located(write_recipe(bad)) == [
        f"{path}:10:17: task.reward.url: url 'localhost:8000' is not an http:// or https:// URL"
    ]


def test_weighted_rewards_are_checked_one_by_one(write_recipe, located, tmp_path) -> None:
    (tmp_path / "mine.py").write_text("def score(completion):\n    return 1.0\n")
    (tmp_path / "p.txt").write_text("{completion}")
    rewards = (
        "  name: arithmetic\n"
        "  rewards:\n"
        "    - {reward: mine.py:score, weight: 1.0}\n"  # line 11
        "    - {url: 'http://127.0.0.1:9/v1', model: m, prompt: p.txt, weight: 0.1}\n"
        "    - {reward: exact_answer, name: correct, weight: 2}\n"
    )
    path = write_recipe(HEAD + rewards)
    assert located(path) == []
    terms = check_recipe(path).recipe.task.rewards
    assert [t.label for t in terms] == ["score", "judge", "correct"]
    assert terms[0].reward == f"{tmp_path}/mine.py:score" and terms[1].prompt == f"{tmp_path}/p.txt"
    broken = HEAD + (
        "  name: arithmetic\n"
        "  reward: exact_answer\n"
        "  rewards:\n"
        "    - {reward: mine.py:scor}\n"  # line 12
        "    - {reward: exact_answer, name: scor}\n"
        "    - {reward: exact_answer, name: mean}\n"
    )
    found = located(write_recipe(broken))
    assert found == [
        f"{path}:14:36: task.rewards.2.name: name 'mean' is reserved (mtprun logs reward/mean "
        "itself); rename it"
    ]
    found = located(write_recipe(broken.replace("name: mean", "name: other")))
    assert found == [
        f"{path}:11:3: a task sets `reward:` (one reward) or `rewards:` (several, by weight), "
        "not both",
        f"{path}:12:16: {tmp_path}/mine.py has no attribute 'scor' (did you mean 'score'?)",
        f"{path}:13:36: a second reward named 'scor': give each of task.rewards its own "
        "`name:` (its metric is reward/<name>)",
    ]


def test_a_task_without_any_reward_is_an_error(write_recipe, located) -> None:
    path = write_recipe(HEAD + "  name: arithmetic\n")
    (found,) = located(path)
    assert found.startswith(f"{path}:8:1: a task needs `reward:`")
    assert "or `rewards:`, unless its prompts come from reasoning-gym" in found


def test_a_misspelt_key_of_either_prompt_source_gets_a_hint(write_recipe, located) -> None:
    path = write_recipe(HEAD + "  prompts: {reasoning_gym: chain_sum, sise: 3}\n")
    assert located(path) == [
        f"{path}:9:39: unknown key 'sise' in 'task.prompts' (did you mean 'size'?)"
    ]
    path = write_recipe(HEAD + "  prompts: {path: p.jsonl, heldot: 3}\n  reward: math\n")
    assert located(path) == [
        f"{path}:9:28: unknown key 'heldot' in 'task.prompts' (did you mean 'heldout'?)"
    ]

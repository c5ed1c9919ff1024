"""verifiers environments end to end through the `mtprun` console script (real Ray, vLLM,
Megatron-core, MLflow): `task.environment: verifiers:<file.py>` names a verifiers (0.4)
taskset, whose tasks are the prompts and whose rubric (weighted @vf.reward functions) scores
every episode sampled by mtprun's engines, each reward logged as reward/<name>.

The run: recipes/examples/verifiers_calculator.py, multi-turn, on the tiny chatml policy
(whose template prints no tool specs: it learns the call from demonstrations in a warm
start), so that its rollouts call the toolset's tool, the toolset answers, and the policy
samples again. A single-turn taskset (recipes/examples/verifiers_arithmetic.py) goes through
the same episode and scoring code, checked in process in tests/data/test_verifiers_env.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from .cli_run import E2E_TINY, finished_run, write_recipe

pytestmark = pytest.mark.slow

EXAMPLES = Path(__file__).resolve().parents[2] / "recipes" / "examples"
STEPS = 2


CALCULATOR = f"verifiers:{EXAMPLES / 'verifiers_calculator.py'}"
# Enough for the call's format (its expression is still a guess): after 50 steps 3 of a step's
# 8 episodes called the tool, after 80 steps 7 or 8.
WARMSTART_STEPS = 60


def write_demonstrations(path: Path, count: int) -> Path:
    """SFT conversations: the first `count` tasks of the calculator taskset solved with one
    call, the toolset's answer and the answer."""
    from mtprun.data.tasks.verifiers_env import load_verifiers_taskset

    source = load_verifiers_taskset(CALCULATOR)
    rows = []
    for prompt, task in list(zip(source.prompts, source.tasks, strict=True))[:count]:
        expression = task.data.prompt.removeprefix("What is ").removesuffix("?")
        call = {"name": "calculator", "arguments": {"expression": expression}}
        messages = [
            *(m.to_dict() for m in prompt.messages),
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "content": f"input: {expression}\nresult: {task.data.answer}"},
            {"role": "assistant", "content": task.data.answer},
        ]
        rows.append({"messages": messages})
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.fixture(scope="module")
def multi_turn_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("vf2")
    demonstrations = write_demonstrations(folder / "demos.jsonl", 200)
    recipe = {
        "name": "e2e-verifiers-tools",
        "model": {"tiny": {**E2E_TINY, "hidden": 128, "intermediate": 256, "max_seq_len": 256}},
        "warmstart": {
            "data": {"source": str(demonstrations), "template": "chatml", "packing_length": 256},
            "steps": WARMSTART_STEPS,
            "lr": 2e-3,
        },
        "task": {
            "environment": CALCULATOR,
            "template": "chatml",
            "samples_per_prompt": 4,
            "prompts_per_step": 2,
            "max_turns": 2,
        },
        "losses": [{"kind": "grpo"}],
        "mask": "sampled",
        "rollout": {"max_tokens": 64, "temperature": 0.7},
        "trainer": {"lr": 1e-4, "steps": STEPS, "micro_batch_tokens": 1024},
        "resources": {"num_cpus": 2},
    }
    with finished_run(write_recipe(folder, recipe), prefix="vf2") as record:
        yield record


def test_rollouts_call_the_toolset_and_go_on_after_its_answer(multi_turn_run):
    record = multi_turn_run
    tool_turns = record.values("rollout/tool_turns")
    assert len(tool_turns) == STEPS and max(tool_turns) > 0, tool_turns
    rl_steps = record.steps("reward/mean")
    for key in ("reward/used_tool", "reward/correct", "reward/errors"):
        assert record.steps(key) == rl_steps, key  # each rubric reward, every RL step
    used, correct = record.values("reward/used_tool"), record.values("reward/correct")
    assert max(used) > 0, used
    # Every episode is scored by the rubric: the mean reward is the weighted sum of the means.
    for mean, c, u in zip(record.values("reward/mean"), correct, used, strict=True):
        assert mean == pytest.approx(1.0 * c + 0.2 * u, abs=1e-6)
    assert record.values("reward/errors") == [0.0] * STEPS
    fractions = record.values("train/trained_token_frac")[-STEPS:]
    assert all(0.0 < f < 1.0 for f in fractions)  # prompts and the toolset's answers never train

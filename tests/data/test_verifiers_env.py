"""`task.environment: verifiers:<module>`: a verifiers (0.4) taskset as an mtprun task. Its
tasks are the prompts, its tools answer the model's calls, its rubric (the tasks' weighted
@vf.reward functions) scores the episodes exactly as verifiers scores the same conversation;
every recipe it cannot serve is refused at the value.

verifiers is imported where a test uses it (its import is ~5 CPU-s): `make test`'s workers
both collect every file, and the one that does not run these tests need not pay it."""

from __future__ import annotations

import asyncio
import math
import sys
import textwrap
from pathlib import Path

import pytest

from mtprun.data.environment import (
    EnvStep,
    episode_tools,
    make_environment,
    reset_all,
    step_all,
)
from mtprun.data.messages import Message, ToolCall
from mtprun.data.tasks import load_environment_class, task_for
from mtprun.data.tasks.verifiers_env import load_verifiers_taskset
from mtprun.preflight import check_recipe
from mtprun.runner.rollout.rewards import EpisodeScorer, component_means
from mtprun.spec.data import TaskSection

EXAMPLES = Path(__file__).resolve().parents[2] / "recipes" / "examples"
ARITHMETIC = f"verifiers:{EXAMPLES / 'verifiers_arithmetic.py'}"
CALCULATOR = f"verifiers:{EXAMPLES / 'verifiers_calculator.py'}"


def episode(reference: str, prompt):
    """A fresh episode environment of `reference`, reset with `prompt`."""
    env = make_environment(load_environment_class(reference))
    (start,) = reset_all([env], [prompt])
    return env, start


def rubric_directly(task, messages: list) -> tuple[float, dict[str, float]]:
    """verifiers' own scoring of a conversation (its message types, built here by hand)."""
    import verifiers.v1 as vf
    from verifiers.v1.graph import MessageNode

    nodes = [
        MessageNode(parent=k - 1 if k else None, message=m, sampled=m.role == "assistant")
        for k, m in enumerate(messages)
    ]
    trace = vf.Trace(
        task=vf.TraceTask(type=type(task).__name__, data=task.data),
        agent=vf.AgentInfo(config=vf.AgentConfig()),
        nodes=nodes,
    )
    asyncio.run(task.score(trace))
    return trace.reward, {name: r.score for name, r in trace.rewards.items()}


def test_the_prompts_are_the_tasks_rows() -> None:
    task = task_for(TaskSection(environment=ARITHMETIC), seed=3)
    source = load_verifiers_taskset(ARITHMETIC)
    assert len(source.tasks) == 300
    first = source.prompts[0]
    data = source.tasks[0].data
    assert first.messages == (Message("user", data.prompt),)
    assert first.answer == data.answer and first.record["idx"] == 0
    # RL steps walk every task once per epoch (in a seeded order), then start again.
    epoch = [p.record["idx"] for s in range(1, 31) for p in task.step_prompts(10, 3, s)]
    assert sorted(epoch) == list(range(300))
    assert task.step_prompts(10, 3, 31) != task.step_prompts(10, 3, 1)
    assert task.step_prompts(10, 3, 2) == task_for(
        TaskSection(environment=ARITHMETIC), seed=3
    ).step_prompts(10, 3, 2)


@pytest.mark.parametrize("reply", ["{answer}", "7", "{answer}!", ""])
def test_a_single_turn_episode_is_scored_as_verifiers_scores_it(reply: str) -> None:
    import verifiers.v1 as vf

    source = load_verifiers_taskset(ARITHMETIC)
    prompt, task = source.prompts[5], source.tasks[5]
    env, start = episode(ARITHMETIC, prompt)
    text = reply.format(answer=task.data.answer)
    (result,) = step_all([env], [(*start, Message("assistant", text))])
    expected, components = rubric_directly(
        task, [vf.UserMessage(content=task.data.prompt), vf.AssistantMessage(content=text)]
    )
    assert result.done and result.messages == []
    assert result.reward == expected and dict(result.components) == components
    # The rubric by hand, in float64: exact match weighs 1, digits only 0.1.
    exact, digits = float(text == task.data.answer), float(text.isdigit())
    assert result.reward == pytest.approx(1.0 * exact + 0.1 * digits, abs=1e-12)
    assert components == {"exact_match": exact, "digits_only": digits}


def test_a_tool_episode_calls_the_toolset_and_is_scored_after_every_turn() -> None:
    import verifiers.v1 as vf

    source = load_verifiers_taskset(CALCULATOR)
    prompt, task = source.prompts[0], source.tasks[0]
    expression = task.data.prompt.removeprefix("What is ").removesuffix("?")
    env, start = episode(CALCULATOR, prompt)
    [spec] = env.tools
    assert spec["function"]["name"] == "calculator"
    assert spec["function"]["description"].startswith("Evaluate integer arithmetic")
    assert spec["function"]["parameters"]["required"] == ["expression"]

    call = Message("assistant", "", (ToolCall("calculator", {"expression": expression}),))
    (turn1,) = step_all([env], [(*start, call)])
    result = f"input: {expression}\nresult: {task.data.answer}"
    assert not turn1.done and [m.to_dict() for m in turn1.messages] == [
        {"role": "tool", "content": result}
    ]
    # Scored already (no answer yet, no tool result in the conversation yet): an episode
    # cut short by task.max_turns keeps this score.
    assert turn1.reward == 0.0 and dict(turn1.components) == {"correct": 0.0, "used_tool": 0.0}

    # mtprun's tiny templates print no tool specs: the tool is then called unprinted.
    assert episode_tools(env, prompt, prints_tools=False) == ()
    assert episode_tools(env, prompt) == (spec,)

    conversation = (*start, call, *turn1.messages, Message("assistant", task.data.answer))
    (turn2,) = step_all([env], [conversation])
    arguments = f'{{"expression": "{expression}"}}'
    expected, components = rubric_directly(
        task,
        [
            vf.UserMessage(content=task.data.prompt),
            vf.AssistantMessage(
                content="",
                tool_calls=[vf.ToolCall(id="c", name="calculator", arguments=arguments)],
            ),
            vf.ToolMessage(tool_call_id="c", content=result),
            vf.AssistantMessage(content=task.data.answer),
        ],
    )
    assert turn2.done and turn2.reward == expected == pytest.approx(1.2)
    assert dict(turn2.components) == components == {"correct": 1.0, "used_tool": 1.0}


def test_the_rubric_rewards_reach_the_metrics_and_a_failing_one_is_a_reward_error(
    tmp_path: Path,
) -> None:
    failing = tmp_path / "failing.py"
    failing.write_text(
        (EXAMPLES / "verifiers_arithmetic.py")
        .read_text()
        .replace("return float(trace.last_reply.isdigit())", "raise RuntimeError('judge down')")
    )
    reference = f"verifiers:{failing}"
    prompts = load_verifiers_taskset(ARITHMETIC).prompts[:2]
    steps = []
    for source in (ARITHMETIC, ARITHMETIC, reference):
        env, start = episode(source, prompts[len(steps) % 2])
        answer = prompts[len(steps) % 2].answer
        (step,) = step_all([env], [(*start, Message("assistant", answer))])
        steps.append(step)
    assert math.isnan(steps[2].reward) and steps[2].components is None
    scorer = EpisodeScorer(None, workers=1, timeout_s=30, on_error=-1.0)
    conversations = [(Message("assistant", p.answer),) for p in [*prompts, prompts[0]]]
    scores = scorer.score(
        [*prompts, prompts[0]],
        conversations,
        given=[s.reward for s in steps],
        given_components=[s.components for s in steps],
    )
    assert scores.totals == [pytest.approx(1.1), pytest.approx(1.1), -1.0]
    assert component_means(scores.outcomes) == {
        "reward/exact_match": 1.0,
        "reward/digits_only": 1.0,
    }
    assert scores.errors == 1 and "not finite" in scores.outcomes[2].error


@pytest.mark.parametrize(
    "step", [EnvStep(done=True, components={"a": 1.0}), EnvStep(reward=1.0, components={"a": "1"})]
)
def test_components_are_numbers_given_with_their_reward(step: EnvStep) -> None:
    class Gives:
        def reset(self, prompt):
            return prompt.messages

        def step(self, messages):
            return step

    prompt = load_verifiers_taskset(ARITHMETIC).prompts[0]
    env = make_environment(Gives)
    (start,) = reset_all([env], [prompt])
    with pytest.raises(TypeError, match="components must be numbers, given with the reward"):
        step_all([env], [(*start, Message("assistant", "1"))])


@pytest.mark.parametrize(
    ("call", "answer"),
    [
        (ToolCall("add", {"a": 1}), "error: unknown tool 'add'"),
        (ToolCall("calculator", {}), "error: tool 'calculator' failed: ValidationError: 1 valid"),
        (
            ToolCall("calculator", {"expression": "2**8"}),
            "error: tool 'calculator' failed: ValueError: unsupported: '2 ** 8'",
        ),
    ],
)
def test_a_bad_tool_call_is_answered_as_text(call: ToolCall, answer: str) -> None:
    source = load_verifiers_taskset(CALCULATOR)
    env, start = episode(CALCULATOR, source.prompts[1])
    (result,) = step_all([env], [(*start, Message("assistant", "", (call,)))])
    assert not result.done
    assert result.messages[0].content.startswith(answer), result.messages[0].content


RECIPE = """\
name: t
model:
  tiny: {{hidden: 128, heads: 2, kv_heads: 1}}
task:
  environment: {environment}
  template: chatml
{extra}losses: [{{kind: grpo}}]
"""
AT = "5:16"  # where the environment's value is written


def diagnostics(tmp_path: Path, environment: str, extra: str = "", files=None) -> list[str]:
    for name, text in (files or {}).items():
        (tmp_path / name).write_text(textwrap.dedent(text))
    path = tmp_path / "r.yaml"
    path.write_text(RECIPE.format(environment=environment, extra=extra))
    return [str(d).removeprefix(f"{path}:") for d in check_recipe(path).diagnostics]


def test_a_shipped_taskset_named_relative_to_the_recipe_validates(tmp_path: Path) -> None:
    (tmp_path / "envs").mkdir()
    (tmp_path / "envs" / "sums.py").write_text((EXAMPLES / "verifiers_arithmetic.py").read_text())
    assert diagnostics(tmp_path, "verifiers:envs/sums.py") == []


TASKSETS = """
import verifiers.v1 as vf

class Row(vf.TaskData):
    answer: str = "1"

class Scored(vf.Task[Row, vf.State, vf.TaskConfig]):
    @vf.reward
    async def right(self, trace) -> float:
        return 1.0

class Stops(Scored):
    @vf.stop
    async def early(self, trace) -> bool:
        return True

class NeedsBox(Scored):
    NEEDS_CONTAINER = True

class Unscored(vf.Task[Row, vf.State, vf.TaskConfig]):
    pass

def taskset_of(task_cls, infinite=False):
    class Rows(vf.Taskset[task_cls, vf.TasksetConfig]):
        INFINITE = infinite

        def load(self):
            yield task_cls(Row(prompt="1+0="))

    return Rows(vf.TasksetConfig())
"""
BROKEN = {
    "no_taskset.py": "import verifiers.v1 as vf\n__all__ = []\n",
    "not_a_taskset.py": "def load_environment():\n    return {'dataset': []}\n",
    "raises.py": "def load_environment():\n    raise RuntimeError('no API key')\n",
    "infinite.py": "from tasks import *\ndef load_environment():\n"
    "    return taskset_of(Scored, infinite=True)\n",
    "stops.py": "from tasks import *\ndef load_environment():\n    return taskset_of(Stops)\n",
    "box.py": "from tasks import *\ndef load_environment():\n    return taskset_of(NeedsBox)\n",
    "unscored.py": "from tasks import *\ndef load_environment():\n"
    "    return taskset_of(Unscored)\n",
}


@pytest.mark.parametrize(
    ("environment", "message"),
    [
        ("verifiers:no_such_taskset_module", "no module named 'no_such_taskset_module': write "),
        ("verifiers:no_taskset.py", "is not a verifiers environment: it has no load_environment"),
        ("verifiers:not_a_taskset.py", "load_environment() returned dict, not a verifiers Tasks"),
        ("verifiers:raises.py", "load_environment() raised RuntimeError: no API key"),
        ("verifiers:infinite.py", "Rows is infinite (INFINITE = True)"),
        ("verifiers:stops.py", "task Stops has @vf.stop conditions (early): not supported"),
        ("verifiers:box.py", "task NeedsBox needs a container (NEEDS_CONTAINER)"),
        ("verifiers:unscored.py", "task Unscored has no @vf.reward (nor judge)"),
        ("verifiers:gone.py", "file not found: "),
    ],
)
def test_an_environment_that_cannot_serve_is_reported_at_the_value(
    tmp_path: Path, environment: str, message: str
) -> None:
    [diagnostic] = diagnostics(tmp_path, environment, files={"tasks.py": TASKSETS, **BROKEN})
    assert diagnostic.startswith(f"{AT}: task.environment: "), diagnostic
    assert message in diagnostic, diagnostic


def test_an_installed_module_and_a_load_environment_function_validate(
    tmp_path: Path, monkeypatch
) -> None:
    (tmp_path / "sums_taskset.py").write_text((EXAMPLES / "verifiers_arithmetic.py").read_text())
    monkeypatch.syspath_prepend(str(tmp_path))  # an importable module, as if installed
    assert diagnostics(tmp_path, "verifiers:sums_taskset") == []
    scored = "from tasks import *\ndef load_environment():\n    return taskset_of(Scored)\n"
    files = {"tasks.py": TASKSETS, "scored.py": scored}
    assert diagnostics(tmp_path, "verifiers:scored.py", files=files) == []
    source = load_verifiers_taskset(f"verifiers:{tmp_path / 'scored.py'}")
    assert [p.answer for p in source.prompts] == ["1"]


@pytest.mark.parametrize("environment", ["verifiers:", "verifiers:envs.sums:SumTaskset"])
def test_a_malformed_verifiers_value_is_refused(tmp_path: Path, environment: str) -> None:
    [diagnostic] = diagnostics(tmp_path, f"'{environment}'")
    assert diagnostic.startswith(f"{AT}: ") and "write verifiers:<module>" in diagnostic


@pytest.mark.parametrize(
    ("extra", "where", "message"),
    [
        ("  reward: exact_answer\n", "7:11", "remove task.reward (or add it to the taskset"),
        ("  rewards: [{reward: exact_answer}]\n", "7:3", "remove task.rewards"),
        ("  name: arithmetic\n", "7:9", "gives the prompts (its taskset's tasks): remove task.n"),
    ],
)
def test_the_taskset_owns_its_prompts_and_rewards(
    tmp_path: Path, extra: str, where: str, message: str
) -> None:
    [diagnostic] = diagnostics(tmp_path, ARITHMETIC, extra)
    assert diagnostic.startswith(f"{where}: ") and message in diagnostic, diagnostic


def test_without_verifiers_installed_the_package_is_named(tmp_path: Path, monkeypatch) -> None:
    load_verifiers_taskset.cache_clear()
    monkeypatch.setitem(sys.modules, "verifiers.v1", None)  # import verifiers.v1 fails
    try:
        [diagnostic] = diagnostics(tmp_path, ARITHMETIC)
    finally:
        load_verifiers_taskset.cache_clear()
    assert diagnostic.startswith(f"{AT}: task.environment: ")
    assert "needs the `verifiers` package (>= 0.4), which is not installed" in diagnostic
    assert "pip install 'verifiers>=0.4'" in diagnostic

from __future__ import annotations

import random

import pytest
import torch

from mtprun.data.mask import token_mask
from mtprun.data.messages import Message
from mtprun.data.render import ROLE_IDS, Renderer
from mtprun.data.tasks import get_task
from mtprun.data.trajectory import TrajectoryBuilder, expert_rollout

from .conftest import sampled_runs


def test_engine_turns_and_tool_outputs_reassemble_the_conversation(
    renderer: Renderer, tool_conversation
) -> None:
    """Prompt + engine-sampled turns + inserted continuations = the rendered conversation,
    with only the engine's tokens sampled and their logprobs in place."""
    conversation = tool_conversation[:5]  # ... tool call, tool output, final answer
    full = renderer.render(conversation)
    (call_start, call_end), (answer_start, answer_end) = sampled_runs(full.is_sampled)
    logprobs = -torch.rand(len(full))

    builder = TrajectoryBuilder(renderer.render(conversation[:2], add_generation_prompt=True))
    builder.add_sampled(full.token_ids[call_start:call_end].tolist(), logprobs[call_start:call_end])
    builder.add_inserted(renderer.continuation(conversation[:3], conversation[3:4]))
    builder.add_sampled(
        full.token_ids[answer_start:answer_end].tolist(), logprobs[answer_start:answer_end]
    )
    trajectory = builder.build()

    n = len(trajectory)
    assert builder.num_turns == 2 and builder.num_tokens == n
    assert torch.equal(trajectory.token_ids, full.token_ids[:n])
    assert torch.equal(trajectory.is_sampled, full.is_sampled[:n])
    assert not full.is_sampled[n:].any()  # only chatml's newline after <|im_end|> is left
    expected_logprobs = torch.where(full.is_sampled[:n], logprobs[:n], 0.0)
    assert torch.equal(trajectory.logprobs, expected_logprobs)
    tool_tokens = trajectory.roles == ROLE_IDS["tool"]
    assert tool_tokens.any() and not trajectory.is_sampled[tool_tokens].any()


@pytest.mark.parametrize("task_name", ["arithmetic", "calculator_tool"])
def test_expert_rollout_matches_the_rendered_demonstration(renderer: Renderer, task_name) -> None:
    task = get_task(task_name)
    for prompt in task.prompts(3, seed=random.randrange(1000)):
        trajectory, conversation, _ = expert_rollout(task, prompt, renderer, max_turns=4)
        assert conversation == task.demonstration(prompt)
        full = renderer.render(conversation)
        n = len(trajectory)
        assert torch.equal(trajectory.token_ids, full.token_ids[:n])
        assert torch.equal(trajectory.is_sampled, full.is_sampled[:n])


def test_calculator_trajectory_is_mostly_untrained(renderer: Renderer) -> None:
    task = get_task("calculator_tool")
    prompt = task.prompts(1, seed=0)[0]
    trajectory, _, _ = expert_rollout(task, prompt, renderer, max_turns=4)
    prompt_length = len(renderer.render(prompt.messages, add_generation_prompt=True))
    response = trajectory[prompt_length:]
    trained = token_mask(response, "sampled")
    tool = response.roles == ROLE_IDS["tool"]
    assert tool.sum() > trained.sum() > 0
    assert not trained[tool].any()
    stop_ids = set(renderer.stop_token_ids)
    trained_stops = [t for t in response.token_ids[trained].tolist() if t in stop_ids]
    assert len(trained_stops) == 2  # one per assistant turn


def test_add_sampled_needs_one_logprob_per_token(renderer: Renderer) -> None:
    builder = TrajectoryBuilder(renderer.render([Message("user", "q")], True))
    with pytest.raises(ValueError, match="3 token ids but 2 logprobs"):
        builder.add_sampled([5, 6, 7], [0.0, 0.0])
    with pytest.raises(ValueError, match="at least its stop token"):
        builder.add_sampled([], [])


def test_prompt_tokens_are_never_sampled(renderer: Renderer) -> None:
    few_shot = [Message("user", "1+1="), Message("assistant", "2"), Message("user", "2+2=")]
    builder = TrajectoryBuilder(renderer.render(few_shot, add_generation_prompt=True))
    assert not builder.build().is_sampled.any()


def test_expert_rollout_stops_at_max_turns_without_inserting(renderer: Renderer) -> None:
    task = get_task("calculator_tool")
    prompt = task.prompts(1, seed=random.randrange(1000))[0]
    trajectory, conversation, _ = expert_rollout(task, prompt, renderer, max_turns=1)
    assert [m.role for m in conversation] == ["user", "assistant"]
    assert conversation[-1].tool_calls
    assert trajectory.is_sampled[-1]  # ends on the sampled stop token, no tool output after it
    assert not (trajectory.roles == ROLE_IDS["tool"]).any()

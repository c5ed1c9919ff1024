"""RL trajectories: the prompt, then the model's sampled turns and the tokens the environment
inserts between them (tool results, user replies, the next generation prompt).

Only tokens the rollout engine produced are sampled; everything inserted is not, so a
multi-turn agentic trajectory whose tools answer at length is mostly untrained tokens.

    builder = TrajectoryBuilder(renderer.render(prompt, add_generation_prompt=True))
    context = builder.token_ids()
    builder.add_sampled(output.token_ids, output.logprobs)     # ends with the stop token
    builder.add_inserted(
        renderer.next_turn(context, output.token_ids, history, [tool_message])
    )
    builder.add_sampled(...)
    trajectory = builder.build()

Token-in, token-out: each turn's context is the tokens already in the trajectory (what the
engine saw and sampled) plus the new messages' tokens (`Renderer.next_turn`), never a new
rendering of the conversation.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from mtprun.data.environment import (
    episode_tools,
    inserted_messages,
    make_environment,
    reset_all,
    step_all,
)
from mtprun.data.messages import Conversation, Prompt
from mtprun.data.render import ROLE_IDS, RenderedSequence, Renderer
from mtprun.data.tasks.base import Task


class TrajectoryBuilder:
    """Concatenates a prompt, sampled segments and inserted segments into one sequence whose
    `logprobs` hold, per token, the logprob the engine sampled it with (0 elsewhere)."""

    def __init__(self, prompt: RenderedSequence) -> None:
        # Even assistant turns inside the prompt (few-shot examples) were not sampled here.
        self._parts = [_with_zero_logprobs(prompt)]
        self.num_turns = 0
        self.num_tokens = len(prompt)
        self._routed: torch.Tensor | None = None  # the latest turn's routing, from token 0

    def add_sampled(
        self,
        token_ids: Sequence[int],
        logprobs: Sequence[float],
        routed_experts: Any = None,
        trained: Sequence[bool] | None = None,
    ) -> None:
        """A model turn as the engine returned it, stop token included, with the logprob of
        each sampled token, and (router replay) the engine's routing of the turn's context
        and tokens from position 0: [R, layers, k] expert ids, R at most the trajectory's
        length with the turn (the engine routes every token but the last it sampled). The
        latest turn's routing covers every earlier token, as the engine saw it then.
        `trained`: per token, False where the loss must not train it although it was sampled
        (partial rollouts: sampled by too old a policy); None: every token."""
        if len(token_ids) != len(logprobs):
            raise ValueError(
                f"add_sampled: {len(token_ids)} token ids but {len(logprobs)} logprobs; the "
                "engine must return one logprob per sampled token (SamplingParams(logprobs=0))"
            )
        if not token_ids:
            raise ValueError("add_sampled: a sampled turn has at least its stop token")
        if trained is not None and len(trained) != len(token_ids):
            raise ValueError(
                f"add_sampled: {len(token_ids)} token ids but {len(trained)} trained flags"
            )
        n = len(token_ids)
        self._parts.append(
            RenderedSequence(
                token_ids=torch.as_tensor(token_ids, dtype=torch.int64),
                roles=torch.full((n,), ROLE_IDS["assistant"], dtype=torch.int8),
                is_sampled=(
                    torch.ones(n, dtype=torch.bool)
                    if trained is None
                    else torch.as_tensor(list(trained), dtype=torch.bool)
                ),
                logprobs=torch.as_tensor(logprobs, dtype=torch.float32),
            )
        )
        self.num_turns += 1
        self.num_tokens += n
        if routed_experts is not None:
            routed = torch.as_tensor(routed_experts).to(torch.int16)
            if routed.dim() != 3 or not 0 < len(routed) <= self.num_tokens:
                raise ValueError(
                    f"add_sampled: a routing of shape {tuple(routed.shape)} for a trajectory of "
                    f"{self.num_tokens} tokens; the engine returns [tokens, layers, top k] "
                    "from the first token of the context"
                )
            self._routed = routed

    def add_inserted(self, segment: RenderedSequence) -> None:
        """Tokens the environment inserts (see `Renderer.next_turn`); never sampled."""
        self._parts.append(_with_zero_logprobs(segment))
        self.num_tokens += len(segment)

    def token_ids(self) -> list[int]:
        """The token ids so far: the context of the next turn."""
        return torch.cat([p.token_ids for p in self._parts]).tolist()

    def build(self) -> RenderedSequence:
        parts = self._parts
        routed = None
        if self._routed is not None:
            # Tokens past the latest turn's routing (its last sampled token, tokens inserted
            # after it) have none: -1, and the trainer routes them itself.
            routed = torch.full((self.num_tokens, *self._routed.shape[1:]), -1, dtype=torch.int16)
            routed[: len(self._routed)] = self._routed
        return RenderedSequence(
            token_ids=torch.cat([p.token_ids for p in parts]),
            roles=torch.cat([p.roles for p in parts]),
            is_sampled=torch.cat([p.is_sampled for p in parts]),
            logprobs=torch.cat([p.logprobs for p in parts]),
            routed_experts=routed,
        )


def _with_zero_logprobs(segment: RenderedSequence) -> RenderedSequence:
    # Inserted tokens are conditioning, not actions: no sampled flag, no logprob.
    return RenderedSequence(
        token_ids=segment.token_ids,
        roles=segment.roles,
        is_sampled=torch.zeros_like(segment.is_sampled),
        logprobs=torch.zeros(len(segment), dtype=torch.float32),
    )


def expert_rollout(
    task: Task,
    prompt: Prompt,
    renderer: Renderer,
    max_turns: int,
    environment: type | None = None,
) -> tuple[RenderedSequence, Conversation, float | None]:
    """The runner's rollout loop with the task's scripted expert in place of the engine.

    Each expert turn contributes the tokens a model would emit for it (reasoning, content,
    tool-call markup, stop token), with logprob 0 (the expert is deterministic); the
    environment's messages (`environment`, default the task's own) are appended with
    `Renderer.next_turn`, as the runner appends them. The prompt's tools (else the
    environment's) are printed. Shows what RL trains on before any model exists. Returns
    the trajectory, the conversation and the environment's reward (None: it gave none).
    """
    env = make_environment(environment or task.environment)
    (conversation,) = reset_all([env], [prompt])
    tools = episode_tools(env, prompt, prints_tools=renderer.chat_format is None)
    builder = TrajectoryBuilder(
        renderer.render(conversation, add_generation_prompt=True, tools=tools)
    )
    reward = None
    for turn in range(1, max_turns + 1):
        conversation = (*conversation, task.expert_reply(conversation, prompt))
        (result,) = step_all([env], [conversation])
        reward = reward if result.reward is None else float(result.reward)
        inserted = () if result.done else inserted_messages(result)
        # The turn's stop token may be the next message's opening tag (GLM), so render with
        # what follows; the model emits the rendering's last run of sampled tokens.
        emitted = _last_sampled_run(renderer.render((*conversation, *inserted), tools=tools))
        context = builder.token_ids()
        builder.add_sampled(emitted, [0.0] * len(emitted))
        if result.done or turn == max_turns:
            break  # as in the runner: nothing is inserted when no turn is left
        builder.add_inserted(renderer.next_turn(context, emitted, conversation, inserted, tools))
        conversation = (*conversation, *inserted)
    return builder.build(), conversation, reward


def _last_sampled_run(rendered: RenderedSequence) -> list[int]:
    """The token ids of the rendering's last run of consecutive sampled tokens."""
    sampled = rendered.is_sampled.nonzero().flatten().tolist()
    end = sampled[-1] + 1
    start = end - 1
    while start > 0 and rendered.is_sampled[start - 1]:
        start -= 1
    return rendered.token_ids[start:end].tolist()

"""RL episodes: prompts -> sampled turns (tool answers in between) -> trajectories + rewards.

Episode k = prompt k // n, sample k % n. Turn 1 asks the engines for n samples per prompt;
every later turn continues each unfinished episode with one sample, after the task's tool
answered its previous turn. The trajectory holds what the engines sampled (with the
log-probs they sampled it with: the old log-probs of the update) and the inserted tool and
template tokens (never sampled, hence untrained under the `sampled` mask).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoTokenizer

from mtprun.data.batch import PackedBatch
from mtprun.data.messages import Conversation
from mtprun.data.packing import pack
from mtprun.data.render import RenderedSequence, Renderer
from mtprun.data.tasks import Prompt, get_reward, get_task
from mtprun.data.trajectory import TrajectoryBuilder
from mtprun.runner.rollout.advantages import group_advantages
from mtprun.runner.rollout.pool import RolloutPool
from mtprun.spec import Recipe


@dataclass
class Episodes:
    prompts: list[Prompt]
    conversations: list[Conversation]  # [prompts * n]
    trajectories: list[RenderedSequence]  # [prompts * n]
    rewards: torch.Tensor  # [prompts, n]
    sampled_tokens: list[int]  # tokens the engines produced, per episode
    truncated: list[bool]  # an episode hit max_tokens or max_turns before it ended
    tool_turns: list[int]  # tool answers inserted into each episode
    versions: list[int]  # the policy version that sampled each episode (its oldest turn's)

    def metrics(self, rollout_seconds: float) -> dict[str, float]:
        lengths = torch.tensor(self.sampled_tokens, dtype=torch.float32)
        return {
            "reward/mean": float(self.rewards.mean()),
            "reward/std": float(self.rewards.std(unbiased=False)),
            "response/length": float(lengths.mean()),
            "response/length_max": float(lengths.max()),
            "response/truncated_frac": sum(self.truncated) / len(self.truncated),
            "rollout/tool_turns": sum(self.tool_turns) / len(self.tool_turns),
            "rollout/tokens_per_s": float(lengths.sum()) / rollout_seconds,
        }

    def sample_text(self, limit: int) -> str:
        """A few episodes as readable text (an MLflow artifact per step)."""
        n = self.rewards.shape[1]
        blocks = []
        for k, conversation in enumerate(self.conversations[:limit]):
            turns = "\n".join(f"  {m.role}: {_message_text(m)}" for m in conversation)
            reward = float(self.rewards[k // n, k % n])
            answer = self.prompts[k // n].answer
            blocks.append(f"episode {k} reward {reward:g} (answer {answer!r})\n{turns}")
        return "\n\n".join(blocks) + "\n"


@dataclass
class _Episode:
    builder: TrajectoryBuilder
    conversation: Conversation
    sampled_tokens: int = 0
    truncated: bool = False  # hit max_tokens, max_turns or the model's length
    tool_turns: int = 0
    version: int | None = None  # the oldest policy version among its sampled turns

    def add_turn(self, sample: Any, renderer: Renderer) -> None:
        """A turn the engine sampled (token ids with their log-probs)."""
        self.builder.add_sampled(sample.token_ids, sample.logprobs)
        self.sampled_tokens += len(sample.token_ids)
        message = renderer.parse_assistant(renderer.tokenizer.decode(sample.token_ids))
        self.conversation = (*self.conversation, message)
        self.truncated = sample.finish_reason == "length"
        self.version = sample.version if self.version is None else min(self.version, sample.version)


class EpisodeCollector:
    def __init__(self, recipe: Recipe, model_dir: Path, pool: RolloutPool) -> None:
        if recipe.task is None:
            raise ValueError("an RL stage needs a `task:` section")
        self.task_section = recipe.task
        self.max_tokens = recipe.rollout.max_tokens
        self.seed = recipe.seed
        self.task = get_task(recipe.task.name)
        self.reward = get_reward(recipe.task.reward)
        self.renderer = Renderer(AutoTokenizer.from_pretrained(model_dir))
        self.max_model_len = AutoConfig.from_pretrained(model_dir).max_position_embeddings
        self.pool = pool

    def collect(self, step: int) -> Episodes:
        section = self.task_section
        n = section.samples_per_prompt
        prompts = self.task.prompts(section.prompts_per_step, seed=_step_seed(self.seed, step))
        rendered = [self.renderer.render(p.messages, add_generation_prompt=True) for p in prompts]
        episodes = [
            _Episode(TrajectoryBuilder(r), p.messages)
            for p, r in zip(prompts, rendered, strict=True)
            for _ in range(n)
        ]
        groups = self._generate([r.token_ids.tolist() for r in rendered], n)
        active, samples = episodes, [s for g in groups for s in g]
        for turn in range(1, section.max_turns + 1):
            for episode, sample in zip(active, samples, strict=True):
                episode.add_turn(sample, self.renderer)
            active = [
                e for e in active if self._tool_answers(e, last_turn=turn == section.max_turns)
            ]
            if not active:
                break
            contexts = [e.builder.build().token_ids.tolist() for e in active]
            samples = [g[0] for g in self._generate(contexts, 1)]

        rewards = [self.reward(e.conversation, prompts[k // n]) for k, e in enumerate(episodes)]
        return Episodes(
            prompts=prompts,
            conversations=[e.conversation for e in episodes],
            trajectories=[e.builder.build() for e in episodes],
            rewards=torch.tensor(rewards, dtype=torch.float32).view(len(prompts), n),
            sampled_tokens=[e.sampled_tokens for e in episodes],
            truncated=[e.truncated for e in episodes],
            tool_turns=[e.tool_turns for e in episodes],
            versions=[e.version for e in episodes],
        )

    def _tool_answers(self, episode: _Episode, last_turn: bool) -> bool:
        """Insert the task's answer to the episode's last turn; False when the episode ends."""
        reply = None if episode.truncated else self.task.tool_response(episode.conversation)
        if reply is None:
            return False
        inserted = self.renderer.continuation(episode.conversation, [reply])
        context = episode.builder.num_tokens + len(inserted)
        if last_turn or context + self.max_tokens > self.max_model_len:
            episode.truncated = True  # the tool answered, but no turn (or room) is left
            return False
        episode.builder.add_inserted(inserted)
        episode.conversation = (*episode.conversation, reply)
        episode.tool_turns += 1
        return True

    def pack(self, episodes: Episodes, mask: Any, micro_batch_tokens: int) -> list[PackedBatch]:
        """Trajectories packed into micro batches, each episode's group-normalised advantage
        on its tokens."""
        return pack(
            episodes.trajectories,
            mask,
            micro_batch_tokens,
            advantages=group_advantages(episodes.rewards).flatten().tolist(),
            pad_id=self.renderer.tokenizer.pad_token_id,
        )

    def _generate(self, contexts: list[list[int]], n: int) -> list[list[Any]]:
        return self.pool.generate(
            contexts, n, max_tokens=self.max_tokens, stop_token_ids=self.renderer.stop_token_ids
        )


def _step_seed(seed: int, step: int) -> int:
    # Distinct, reproducible prompts per step: a resumed step sees the same prompts.
    return random.Random(f"{seed}:{step}").randrange(2**31)


def _message_text(message: Any) -> str:
    calls = " ".join(call.to_json() for call in message.tool_calls)
    text = f"{message.content} {calls}".strip()
    return text if len(text) <= 300 else text[:300] + "..."

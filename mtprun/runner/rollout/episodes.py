"""RL episodes: prompts -> sampled turns (environment answers in between) -> trajectories +
rewards.

Episode k = prompt k // n, sample k % n; each has its own environment object (the recipe's
task.environment, else the task's own; see `mtprun.data.environment`). Turn 1 asks the
engines for n samples per prompt; after every turn the environments answer, and each
unfinished episode continues with one sample after its environment's messages. The
trajectory holds what the engines sampled (with the log-probs they sampled it with: the old
log-probs of the update) and the inserted tool, user and template tokens (never sampled,
hence untrained under the `sampled` mask).

Token-in, token-out: a turn's context is the episode's trajectory so far, the tokens the
engine saw and sampled, extended by the environment's messages (`Renderer.next_turn`: the
model family's `bridge_to_next_turn`); the conversation is never rendered again into it. A
generated turn is read back from its token ids (`Renderer.parse_turn`: reasoning, answer,
tool calls) for the environment and the reward; the episode's tools (its prompt's, else its
environment's) are printed in the prompt and passed to the parser.

An episode's reward is its environment's, when it gave one, else task.reward's score
(computed off the driver by the reward workers, see `rewards.EpisodeScorer`), which gets
the final answer without its reasoning, and the final turn as generated. Evaluation runs
the same loop (`run`) with its own prompts and sampling.

DAPO dynamic sampling (`task.drop_uniform_groups`): a group whose rewards are all equal has
advantage 0 everywhere and teaches the policy gradient nothing; such groups are dropped and
further rounds of fresh prompts (a pure function of seed, step and round) are sampled until
`prompts_per_step` groups remain or `max_sampling_rounds` rounds ran. A step left with no
group keeps its first round (its policy-gradient terms are then 0).

DAPO's over-long handling. Reward shaping (`task.overlong_buffer: {tokens: B, penalty: P}`):
with L = rollout.max_tokens, an episode of n sampled tokens (all its turns') gets

    0                        when n <= L - B
    -P (n - (L - B)) / B     when L - B < n <= L (and -P past L, a multi-turn episode's)
    -P                       when a turn was cut at L

added to its reward before the group advantages (reward/overlong; evaluations are unshaped).
Filtering (`rollout.mask_truncated`): an episode with a turn cut at L leaves the loss, its
tokens off the loss mask; its reward still counts in its group's mean and std, and it counts
in response/truncated_frac and rollout/truncated_frac.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from mtprun.data.batch import PackedBatch
from mtprun.data.environment import (
    EnvStep,
    episode_tools,
    inserted_messages,
    make_environment,
    reset_all,
    step_all,
)
from mtprun.data.messages import Conversation, ToolSpec
from mtprun.data.packing import pack
from mtprun.data.render import RenderedSequence, Renderer, folder_renderer
from mtprun.data.tasks import Prompt, load_environment_class, task_for
from mtprun.data.trajectory import TrajectoryBuilder
from mtprun.runner.rollout.advantages import group_advantages
from mtprun.runner.rollout.engine import Sampling
from mtprun.runner.rollout.partial import VersionSpan, partial_metrics
from mtprun.runner.rollout.pool import RolloutPool
from mtprun.runner.rollout.rewards import EpisodeScorer, RewardOutcome, component_means
from mtprun.runner.rollout.scorers import ScorerPlacement
from mtprun.spec import Recipe
from mtprun.spec.data import OverlongBuffer

log = logging.getLogger("mtprun")


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
    reward_outcomes: list[RewardOutcome]  # what scored each episode (components or error)
    reward_errors: int = 0  # reward errors of the step, dropped groups' included
    sampling_rounds: int = 1  # rounds of prompts sampled for the step (dynamic sampling)
    dropped_groups: int = 0  # groups of equal rewards dropped (dynamic sampling)
    cut: list[bool] | None = None  # a turn was cut at max_tokens (None: none was)
    overlong: list[float] | None = None  # the over-long shaping added to each reward
    spans: list[VersionSpan] | None = None  # partial rollouts: each episode's token versions
    task_metrics: dict[str, float] = field(default_factory=dict)  # the task's (search/...)

    def __post_init__(self) -> None:
        if self.cut is None:
            self.cut = [False] * len(self.truncated)

    @property
    def num_groups(self) -> int:
        return len(self.prompts)

    def groups(self, indices: list[int]) -> Episodes:
        """The episodes of the prompt groups `indices`, in that order."""
        n = self.rewards.shape[1]
        episodes = [g * n + j for g in indices for j in range(n)]
        return replace(
            self,
            prompts=[self.prompts[g] for g in indices],
            conversations=[self.conversations[k] for k in episodes],
            trajectories=[self.trajectories[k] for k in episodes],
            rewards=self.rewards[indices],
            sampled_tokens=[self.sampled_tokens[k] for k in episodes],
            truncated=[self.truncated[k] for k in episodes],
            tool_turns=[self.tool_turns[k] for k in episodes],
            versions=[self.versions[k] for k in episodes],
            reward_outcomes=[self.reward_outcomes[k] for k in episodes],
            cut=[self.cut[k] for k in episodes],
            overlong=None if self.overlong is None else [self.overlong[k] for k in episodes],
            spans=None if self.spans is None else [self.spans[k] for k in episodes],
        )

    def informative_groups(self) -> list[int]:
        """Groups whose rewards are not all equal (the others have advantage 0)."""
        spread = self.rewards.amax(dim=1) > self.rewards.amin(dim=1)
        return spread.nonzero().flatten().tolist()

    def __add__(self, other: Episodes) -> Episodes:
        return replace(
            self,
            prompts=self.prompts + other.prompts,
            conversations=self.conversations + other.conversations,
            trajectories=self.trajectories + other.trajectories,
            rewards=torch.cat([self.rewards, other.rewards]),
            sampled_tokens=self.sampled_tokens + other.sampled_tokens,
            truncated=self.truncated + other.truncated,
            tool_turns=self.tool_turns + other.tool_turns,
            versions=self.versions + other.versions,
            reward_outcomes=self.reward_outcomes + other.reward_outcomes,
            reward_errors=self.reward_errors + other.reward_errors,
            cut=self.cut + other.cut,
            overlong=(
                None
                if self.overlong is None or other.overlong is None
                else self.overlong + other.overlong
            ),
            spans=None if self.spans is None or other.spans is None else self.spans + other.spans,
        )

    def reward_metrics(self) -> dict[str, float]:
        """`reward/<component>` over these episodes, `reward/errors` over the step's,
        `reward/overlong` (the mean over-long shaping) when the task shapes rewards."""
        metrics = {
            **component_means(self.reward_outcomes),
            "reward/errors": float(self.reward_errors),
        }
        if self.overlong is not None:
            metrics["reward/overlong"] = sum(self.overlong) / len(self.overlong)
        return metrics

    def shape_overlong(self, buffer: OverlongBuffer, max_tokens: int) -> Episodes:
        """These episodes with DAPO's over-long shaping added to their rewards."""
        n = self.rewards.shape[1]
        assert self.cut is not None
        shaping = [
            buffer.shaping(length, max_tokens, cut)
            for length, cut in zip(self.sampled_tokens, self.cut, strict=True)
        ]
        added = torch.tensor(shaping, dtype=torch.float32).view(-1, n)
        return replace(self, rewards=self.rewards + added, overlong=shaping)

    def loss_trajectories(self, mask_truncated: bool) -> list[RenderedSequence]:
        """The trajectories the loss trains: with `mask_truncated`, those of episodes cut at
        max_tokens have no sampled token left (the loss masks of the recipe's `mask:` keep
        only sampled tokens)."""
        if not mask_truncated:
            return self.trajectories
        assert self.cut is not None
        return [
            replace(t, is_sampled=torch.zeros_like(t.is_sampled)) if cut else t
            for t, cut in zip(self.trajectories, self.cut, strict=True)
        ]

    def metrics(self, rollout_seconds: float) -> dict[str, float]:
        lengths = torch.tensor(self.sampled_tokens, dtype=torch.float32)
        return {
            "reward/mean": float(self.rewards.mean()),
            "reward/std": float(self.rewards.std(unbiased=False)),
            "response/length": float(lengths.mean()),
            "response/length_max": float(lengths.max()),
            "response/truncated_frac": sum(self.truncated) / len(self.truncated),
            "rollout/truncated_frac": sum(self.cut or ()) / len(self.truncated),
            "rollout/tool_turns": sum(self.tool_turns) / len(self.tool_turns),
            "rollout/tokens_per_s": float(lengths.sum()) / rollout_seconds,
            "rollout/sampling_rounds": float(self.sampling_rounds),
            "rollout/dropped_groups": float(self.dropped_groups),
            **self.reward_metrics(),
            **self.task_metrics,
            **partial_metrics(self.spans or []),
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
    env: Any  # this episode's environment object
    builder: TrajectoryBuilder
    conversation: Conversation
    tools: tuple[ToolSpec, ...] = ()  # the tool specs its prompt prints
    sampled_tokens: int = 0
    truncated: bool = False  # hit max_tokens, max_turns or the model's length
    cut: bool = False  # its last turn was cut at max_tokens
    tool_turns: int = 0
    env_reward: float | None = None  # the last reward the environment gave
    env_components: dict[str, float] | None = None  # its named parts (reward/<name>)
    version: int | None = None  # the oldest policy version among its sampled turns
    span: VersionSpan | None = None  # every sampled token's policy version (partial rollouts)
    context_ids: list[int] | None = None  # the context of its last sampled turn
    completion_ids: list[int] | None = None  # its last sampled turn
    last_text: str | None = None  # its last turn's text as generated (for the reward)

    def add_turn(self, sample: Any, renderer: Renderer, oldest_trained: int | None = None) -> None:
        """A turn the engine sampled (token ids with their log-probs); its tokens sampled by a
        policy older than `oldest_trained` stay out of the loss."""
        self.context_ids = self.builder.token_ids()
        self.completion_ids = list(sample.token_ids)
        versions = sample.versions()
        trained = None if oldest_trained is None else [v >= oldest_trained for v in versions]
        self.builder.add_sampled(
            sample.token_ids, sample.logprobs, getattr(sample, "routed_experts", None), trained
        )
        if versions:
            span = VersionSpan.of(versions, oldest_trained)
            self.span = span if self.span is None else self.span | span
        self.sampled_tokens += len(sample.token_ids)
        message = renderer.parse_turn(sample.token_ids, self.context_ids, self.tools)
        self.last_text = renderer.turn_text(sample.token_ids)
        self.conversation = (*self.conversation, message)
        self.truncated = self.cut = sample.finish_reason == "length"
        self.version = sample.version if self.version is None else min(self.version, sample.version)


class EpisodeCollector:
    def __init__(
        self,
        recipe: Recipe,
        model_dir: Path,
        pool: RolloutPool,
        scorer: EpisodeScorer | None = None,
    ) -> None:
        """`scorer`: the task's, made beforehand (wait False) so that its served reward
        models load while the engines do; by default made here."""
        if recipe.task is None:
            raise ValueError("an RL stage needs a `task:` section")
        self.task_section = recipe.task
        self.max_tokens = recipe.rollout.max_tokens
        self.mask_truncated = recipe.rollout.mask_truncated
        self.partial = recipe.rollout.partial
        self.max_offpolicy = recipe.rollout.max_offpolicy_steps if self.partial else None
        self.seed = recipe.seed
        self.task = task_for(recipe.task, recipe.seed, Path(recipe.run_dir) / "datasets")
        self.environment = (
            load_environment_class(recipe.task.environment)
            if recipe.task.environment
            else self.task.environment
        )
        if scorer is None:
            scorer = EpisodeScorer.for_task(recipe.task, ScorerPlacement.of(recipe), wait=False)
        scorer.wait_started()
        self.scorer = scorer
        self.renderer = folder_renderer(model_dir, recipe.task.renderer)
        self._warned_unprinted_tools = False
        # Imported here: the auto classes cost ~0.9 CPU-seconds, which a process that imports
        # this module and collects no episodes (an SFT run's driver) does without.
        from transformers import AutoConfig

        self.max_model_len = AutoConfig.from_pretrained(model_dir).max_position_embeddings
        self.pool = pool

    def collect(self, step: int) -> Episodes:
        """The step's episodes: `prompts_per_step` groups (with dynamic sampling, those whose
        rewards differ, from up to `max_sampling_rounds` rounds)."""
        section = self.task_section
        first = self._collect_round(step, 0, section.prompts_per_step)
        if not section.drop_uniform_groups:
            return first
        kept = first.groups(first.informative_groups())
        rounds, sampled, errors = 1, first.num_groups, first.reward_errors
        while kept.num_groups < section.prompts_per_step and rounds < section.max_sampling_rounds:
            missing = section.prompts_per_step - kept.num_groups
            more = self._collect_round(step, rounds, missing)
            kept = kept + more.groups(more.informative_groups())
            rounds, sampled, errors = rounds + 1, sampled + missing, errors + more.reward_errors
        if kept.num_groups == 0:
            kept = first
        return replace(
            kept,
            reward_errors=errors,
            sampling_rounds=rounds,
            dropped_groups=sampled - kept.num_groups,
            task_metrics=self._task_metrics(),
        )

    def _collect_round(self, step: int, sampling_round: int, num_prompts: int) -> Episodes:
        section = self.task_section
        prompts = self.task.step_prompts(num_prompts, self.seed, step, sampling_round)
        # Step s trains the policy of version s - 1: tokens older than the bound leave the loss.
        oldest = None if self.max_offpolicy is None else step - 1 - self.max_offpolicy
        episodes = self.run(prompts, section.samples_per_prompt, oldest_trained=oldest)
        if section.overlong_buffer is not None:
            episodes = episodes.shape_overlong(section.overlong_buffer, self.max_tokens)
        if not section.drop_uniform_groups:
            episodes.task_metrics = self._task_metrics()
        return episodes

    def _task_metrics(self) -> dict[str, float]:
        """The task's own counters since the last step (the search task's search/...)."""
        step_metrics = getattr(self.task, "step_metrics", None)
        return step_metrics() if callable(step_metrics) else {}

    def run(
        self,
        prompts: list[Prompt],
        n: int,
        sampling: Sampling | None = None,
        oldest_trained: int | None = None,
    ) -> Episodes:
        """n episodes of each prompt, sampled with the rollout section's settings unless
        `sampling` overrides them (evaluation), and scored; with partial rollouts, tokens
        sampled by a policy older than `oldest_trained` stay out of the loss."""
        section = self.task_section
        sampling = sampling or Sampling()
        max_tokens = sampling.max_tokens or self.max_tokens
        episode_prompts = [p for p in prompts for _ in range(n)]
        episodes = self._start(episode_prompts)
        samples = self._first_samples(episodes, n, sampling)
        active = episodes
        max_turns = section.episode_turns
        for turn in range(1, max_turns + 1):
            for episode, sample in zip(active, samples, strict=True):
                episode.add_turn(sample, self.renderer, oldest_trained)
            results = step_all([e.env for e in active], [e.conversation for e in active])
            last_turn = turn == max_turns
            active = [
                e
                for e, r in zip(active, results, strict=True)
                if self._answer(e, r, last_turn, max_tokens)
            ]
            if not active:
                break
            contexts = [e.builder.build().token_ids.tolist() for e in active]
            samples = [g[0] for g in self._generate(contexts, 1, sampling)]

        scores = self.scorer.score(
            episode_prompts,
            [e.conversation for e in episodes],
            given=[e.env_reward for e in episodes],
            given_components=[e.env_components for e in episodes],
            raw_completions=[e.last_text for e in episodes],
        )
        return Episodes(
            prompts=prompts,
            conversations=[e.conversation for e in episodes],
            trajectories=[e.builder.build() for e in episodes],
            rewards=torch.tensor(scores.totals, dtype=torch.float32).view(len(prompts), n),
            sampled_tokens=[e.sampled_tokens for e in episodes],
            truncated=[e.truncated for e in episodes],
            cut=[e.cut for e in episodes],
            tool_turns=[e.tool_turns for e in episodes],
            versions=[e.version for e in episodes],
            reward_outcomes=scores.outcomes,
            reward_errors=scores.errors,
            spans=[e.span or VersionSpan(0, 0) for e in episodes] if self.partial else None,
        )

    def _start(self, prompts: list[Prompt]) -> list[_Episode]:
        """One episode per prompt (a prompt repeated per sample), its environment reset."""
        envs = [make_environment(self.environment) for _ in prompts]
        starts = reset_all(envs, prompts)
        episodes = []
        for env, prompt, start in zip(envs, prompts, starts, strict=True):
            tools = episode_tools(env, prompt, prints_tools=self.renderer.chat_format is None)
            if not tools and getattr(env, "tools", None):
                self._warn_unprinted_tools(len(env.tools))
            rendered = self.renderer.render(start, add_generation_prompt=True, tools=tools)
            episodes.append(_Episode(env, TrajectoryBuilder(rendered), start, tools))
        return episodes

    def _warn_unprinted_tools(self, count: int) -> None:
        if not self._warned_unprinted_tools:
            self._warned_unprinted_tools = True
            log.warning(
                "chat template %r prints no tool specs: the %d tool(s) of task.environment "
                "are not shown to the model (its calls to them are parsed and answered)",
                self.renderer.chat_format.name,
                count,
            )

    def _first_samples(self, episodes: list[_Episode], n: int, sampling: Sampling) -> list[Any]:
        """The first turn of every episode: n samples per prompt when the environments start
        each group of n alike (the usual case), else one sample per episode."""
        contexts = [e.builder.build().token_ids.tolist() for e in episodes]
        groups = [contexts[k : k + n] for k in range(0, len(contexts), n)]
        if all(all(c == g[0] for c in g) for g in groups):
            return [s for g in self._generate([g[0] for g in groups], n, sampling) for s in g]
        return [g[0] for g in self._generate(contexts, 1, sampling)]

    def _answer(self, episode: _Episode, result: EnvStep, last_turn: bool, max_tokens: int) -> bool:
        """Apply the environment's answer to the episode's last turn; False when it ends
        (`max_tokens`: the room the next turn needs)."""
        if result.reward is not None:
            episode.env_reward = float(result.reward)
            episode.env_components = dict(result.components or {}) or None
        if result.done or episode.truncated:
            return False
        messages = inserted_messages(result)
        inserted = self.renderer.next_turn(
            episode.context_ids or [],
            episode.completion_ids or [],
            episode.conversation,
            messages,
            episode.tools,
        )
        context = episode.builder.num_tokens + len(inserted)
        if last_turn or context + max_tokens > self.max_model_len:
            episode.truncated = True  # the environment answered, but no turn (or room) is left
            return False
        episode.builder.add_inserted(inserted)
        episode.conversation = (*episode.conversation, *messages)
        episode.tool_turns += 1
        return True

    def pack(self, episodes: Episodes, mask: Any, micro_batch_tokens: int) -> list[PackedBatch]:
        """Trajectories packed into micro batches, each episode's group-normalised advantage
        on its tokens."""
        return pack(
            episodes.loss_trajectories(self.mask_truncated),
            mask,
            micro_batch_tokens,
            advantages=group_advantages(episodes.rewards).flatten().tolist(),
            pad_id=self.renderer.tokenizer.pad_token_id,
        )

    def _generate(self, contexts: list[list[int]], n: int, sampling: Sampling) -> list[list[Any]]:
        stops = tuple(self.renderer.stop_token_ids)
        max_tokens = sampling.max_tokens or self.max_tokens
        return self.pool.generate(
            contexts, n, replace(sampling, max_tokens=max_tokens, stop_token_ids=stops)
        )

    def close(self) -> None:
        """Stop the reward workers."""
        self.scorer.close()


def _message_text(message: Any) -> str:
    calls = " ".join(call.to_json() for call in message.tool_calls)
    thought = f"[reasoning: {message.reasoning_content}]" if message.reasoning_content else ""
    text = f"{thought} {message.content} {calls}".strip()
    return text if len(text) <= 300 else text[:300] + "..."

"""One optimizer step of each stage kind, with its metrics (MLflow keys)."""

from __future__ import annotations

import time
from dataclasses import dataclass

from mtprun.data.batch import PackedBatch
from mtprun.runner.rollout.episodes import EpisodeCollector
from mtprun.runner.rollout.pool import RolloutPool
from mtprun.runner.run.sft_source import SftSource
from mtprun.runner.run.stages import Stage
from mtprun.runner.trainer.group import TrainerGroup

SAMPLE_EPISODES = 8  # episodes per RL step written to MLflow as text


@dataclass
class StepResult:
    metrics: dict[str, float]
    samples: str = ""  # readable episodes (RL), an MLflow artifact


def sft_step(trainer: TrainerGroup, *, sft: SftSource, stage: Stage, step: int) -> StepResult:
    start = time.perf_counter()
    batches = sft.batches(step - stage.offset)
    metrics = _prefixed("train", trainer.train_step(batches))
    seconds = time.perf_counter() - start
    metrics.update(
        {
            "time/train_s": seconds,
            "time/step_s": seconds,
            "train/tokens_per_s": _tokens(batches) / seconds,
            "train/trained_token_frac": _trained_fraction(batches),
        }
    )
    return StepResult(metrics)


def grpo_step(
    trainer: TrainerGroup,
    *,
    pool: RolloutPool,
    collector: EpisodeCollector,
    stage: Stage,
    step: int,
) -> StepResult:
    """Rollouts -> advantages -> (reference log-probs) -> one trainer step -> weight sync."""
    recipe = stage.recipe
    start = time.perf_counter()
    episodes = collector.collect(step)
    rollout_s = time.perf_counter() - start
    batches = collector.pack(episodes, recipe.mask, recipe.trainer.micro_batch_tokens)
    metrics = episodes.metrics(rollout_s)
    if recipe.rollout.speculative is not None:
        metrics.update(pool.spec_decode_step())

    tick = time.perf_counter()
    if recipe.rollout.recompute_logprobs:
        recompute_old_logprobs(trainer, batches)
    if stage.needs_reference:
        references = trainer.logprobs(batches, reference=True)
        for batch, ref in zip(batches, references, strict=True):
            batch.ref_logprobs = ref
    metrics.update(_prefixed("train", trainer.train_step(batches)))
    train_s = time.perf_counter() - tick

    tick = time.perf_counter()
    engine_sync_s = pool.update_weights(trainer.weights_ref())
    sync_s = time.perf_counter() - tick
    metrics.update(
        {
            "time/rollout_s": rollout_s,
            "time/train_s": train_s,
            "time/sync_s": sync_s,
            "time/engine_sync_s": engine_sync_s,
            "time/step_s": time.perf_counter() - start,
            "train/tokens_per_s": _tokens(batches) / train_s,
            "train/trained_token_frac": _trained_fraction(batches),
            "rollout/engine_restarts": float(pool.restarts),
        }
    )
    return StepResult(metrics, episodes.sample_text(limit=SAMPLE_EPISODES))


def recompute_old_logprobs(trainer: TrainerGroup, batches: list[PackedBatch]) -> None:
    """The trainer's own log-probs of the sampled tokens, under the policy about to be updated,
    become the old log-probs; the engines' become the sampler log-probs (truncated IS, the
    logprob_mismatch metric)."""
    for batch, old in zip(batches, trainer.logprobs(batches), strict=True):
        batch.sampler_logprobs = batch.old_logprobs
        batch.old_logprobs = old


def _prefixed(prefix: str, metrics: dict[str, float]) -> dict[str, float]:
    return {f"{prefix}/{k}": float(v) for k, v in metrics.items()}


def _tokens(batches: list[PackedBatch]) -> int:
    return sum(b.num_tokens for b in batches)


def _trained_fraction(batches: list[PackedBatch]) -> float:
    return sum(int(b.loss_mask.sum()) for b in batches) / max(_tokens(batches), 1)

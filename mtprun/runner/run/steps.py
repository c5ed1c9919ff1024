"""One optimizer step of each stage kind, with its metrics (MLflow keys)."""

from __future__ import annotations

import time
from dataclasses import dataclass

from mtprun.data.balance import imbalance, linear_length, rebalance, sequence_cost
from mtprun.data.batch import PackedBatch
from mtprun.runner.rollout.episodes import EpisodeCollector, Episodes
from mtprun.runner.rollout.pool import RolloutPool
from mtprun.runner.run.colocation import Colocation
from mtprun.runner.run.evaluation import Evaluator
from mtprun.runner.run.rollouts_ahead import RolloutsAhead
from mtprun.runner.run.sft_source import SftSource
from mtprun.runner.run.stages import Stage
from mtprun.runner.run.weight_sync import WeightSync
from mtprun.runner.trainer.group import TrainerGroup
from mtprun.spec import Recipe

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


@dataclass
class Rollout:
    """One step's episodes and what the engines counted while generating them."""

    episodes: Episodes
    engine_metrics: dict[str, float]


def generate_rollout(
    step: int, *, pool: RolloutPool, collector: EpisodeCollector, stage: Stage
) -> Rollout:
    """Step `step`'s episodes (runs in the rollouts-ahead thread: engines only)."""
    episodes = collector.collect(step)
    engine_metrics = pool.generation_step()
    if stage.recipe.rollout.speculative is not None:
        engine_metrics.update(pool.spec_decode_step())
    return Rollout(episodes, engine_metrics)


def grpo_step(
    trainer: TrainerGroup,
    *,
    rollouts: RolloutsAhead[Rollout],
    collector: EpisodeCollector,
    sync: WeightSync,
    stage: Stage,
    step: int,
    gpus: float = 0.0,
    colocation: Colocation | None = None,
    evaluator: Evaluator | None = None,
) -> StepResult:
    """Episodes (generated ahead) -> advantages -> (reference log-probs) -> one trainer step
    -> weight sync once the engines are idle -> on the steps `eval:` asks for, an evaluation
    of the synced policy (the engines still idle: no rollout of a coming step runs beside)."""
    recipe = stage.recipe
    start = time.perf_counter()
    ready = rollouts.take(step)
    episodes = ready.value.episodes
    metrics = episodes.metrics(ready.generate_s)
    metrics.update(ready.value.engine_metrics)
    metrics.update(staleness_metrics(episodes.versions, trainer.version, rollouts.k))
    batches = collector.pack(episodes, recipe.mask, recipe.trainer.micro_batch_tokens)
    batches, replica_of, balance_metrics = balance_step(batches, recipe, trainer.dp)
    metrics.update(balance_metrics)

    if colocation is not None:
        metrics.update(colocation.to_trainer())
    tick = time.perf_counter()
    if recipe.rollout.recompute_logprobs:
        recompute_old_logprobs(trainer, batches, replica_of)
    if stage.needs_reference:
        references = trainer.logprobs(batches, reference=True, replica_of=replica_of)
        for batch, ref in zip(batches, references, strict=True):
            batch.ref_logprobs = ref
    logprob_s = time.perf_counter() - tick
    metrics.update(_prefixed("train", trainer.train_step(batches, replica_of)))
    train_s = time.perf_counter() - tick - logprob_s

    sync_wait_s = rollouts.before_sync(trainer.version)
    if colocation is not None:  # first: the engines wake into the memory it frees
        metrics.update(colocation.to_engines())
    metrics.update(sync.push())
    if evaluator is not None and evaluator.due(step, stage.last_step):
        metrics.update(evaluator.evaluate())
        sync.pool.generation_step()  # the evaluation's generation is not the next step's
    rollouts.synced(trainer.version)
    metrics.update(
        {
            "time/rollout_s": ready.generate_s,
            "time/rollout_wait_s": ready.wait_s,
            "time/logprob_s": logprob_s,
            "time/train_s": train_s,
            "time/sync_wait_s": sync_wait_s,
            "time/step_s": time.perf_counter() - start,
            "train/tokens_per_s": _tokens(batches) / train_s,
            "train/trained_token_frac": _trained_fraction(batches),
            "rollout/engine_restarts": float(sync.pool.restarts),
        }
    )
    metrics.update(step_breakdown(metrics, _tokens(batches), gpus))
    return StepResult(metrics, episodes.sample_text(limit=SAMPLE_EPISODES))


# The parts of an RL step's wall time that are accounted for; the rest is time/idle_s.
_STEP_PARTS = (
    "time/rollout_wait_s",
    "time/logprob_s",
    "time/train_s",
    "time/sync_wait_s",
    "time/sync_s",
    "time/engine_sleep_s",
    "time/onload_s",
    "time/offload_s",
    "time/eval_s",
)


def step_breakdown(metrics: dict[str, float], tokens: int, gpus: float) -> dict[str, float]:
    """`time/idle_s`: the step's seconds that none of its timed parts account for (host work
    between them: packing, advantages, Ray calls); `throughput/tokens_per_s_per_gpu`: the
    step's prompt and response tokens over its wall time and the run's GPUs (what NeMo-RL
    reports; absent on CPUs)."""
    step_s = metrics["time/step_s"]
    parts = sum(metrics.get(name, 0.0) for name in _STEP_PARTS)
    out = {"time/idle_s": max(step_s - parts, 0.0), "throughput/tokens_per_s": tokens / step_s}
    if gpus > 0:
        out["throughput/tokens_per_s_per_gpu"] = tokens / step_s / gpus
    return out


def staleness_metrics(versions: list[int], trainer_version: int, k: int) -> dict[str, float]:
    """`rollout/staleness` (mean) and `rollout/staleness_max`: optimizer steps between the
    policy that sampled each episode and the one it trains; refuses an episode older than k
    (the schedule never makes one: this guards the guarantee)."""
    staleness = [trainer_version - v for v in versions]
    oldest = max(staleness)
    if oldest > k:
        raise RuntimeError(
            f"an episode sampled by policy version {trainer_version - oldest} would train the "
            f"policy of version {trainer_version}: {oldest} steps stale, more than "
            f"rollout.max_staleness {k}"
        )
    return {
        "rollout/staleness": sum(staleness) / len(staleness),
        "rollout/staleness_max": float(oldest),
    }


def balance_step(
    batches: list[PackedBatch], recipe: Recipe, dp: int
) -> tuple[list[PackedBatch], list[int] | None, dict[str, float]]:
    """The step's micro batches, the replica of each (None: dealt round-robin) and
    `train/dp_cost_imbalance` (the costliest replica's cost over the mean, cost L (a + L) per
    sequence: `mtprun.data.balance`). With trainer.balance and dp > 1 the sequences are
    repacked into dp groups of near-equal cost; otherwise they stay as packed."""
    if dp == 1:
        return batches, None, {}
    a = _linear_length(recipe)
    if not recipe.trainer.balance:
        costs = [0.0] * dp
        for i, batch in enumerate(batches):
            lengths = (batch.cu_seqlens[1:] - batch.cu_seqlens[:-1]).tolist()
            costs[i % dp] += sum(sequence_cost(n, a) for n in lengths)
        return batches, None, {"train/dp_cost_imbalance": imbalance(costs)}
    balanced, layout = rebalance(batches, dp, recipe.trainer.micro_batch_tokens, a)
    return balanced, layout.replica_of, {"train/dp_cost_imbalance": imbalance(layout.costs)}


_LINEAR_LENGTHS: dict[str, float] = {}


def _linear_length(recipe: Recipe) -> float:
    """`a` of the balancing cost for the recipe's model (read once per model section)."""
    key = recipe.model.model_dump_json()
    if key not in _LINEAR_LENGTHS:
        from mtprun.preflight.model_shape import recipe_shape

        shape = recipe_shape(recipe)
        _LINEAR_LENGTHS[key] = linear_length(None if isinstance(shape, str) else shape)
    return _LINEAR_LENGTHS[key]


def recompute_old_logprobs(
    trainer: TrainerGroup, batches: list[PackedBatch], replica_of: list[int] | None = None
) -> None:
    """The trainer's own log-probs of the sampled tokens, under the policy about to be updated,
    become the old log-probs; the engines' become the sampler log-probs (truncated IS, the
    logprob_mismatch metric). Each replica computes those of the batches it trains
    (`replica_of`)."""
    for batch, old in zip(batches, trainer.logprobs(batches, replica_of=replica_of), strict=True):
        batch.sampler_logprobs = batch.old_logprobs
        batch.old_logprobs = old


def _prefixed(prefix: str, metrics: dict[str, float]) -> dict[str, float]:
    return {f"{prefix}/{k}": float(v) for k, v in metrics.items()}


def _tokens(batches: list[PackedBatch]) -> int:
    return sum(b.num_tokens for b in batches)


def _trained_fraction(batches: list[PackedBatch]) -> float:
    return sum(int(b.loss_mask.sum()) for b in batches) / max(_tokens(batches), 1)

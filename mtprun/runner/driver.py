"""The run loop behind `mtprun run` and `mtprun resume`.

Per RL step: prompts -> rollout engines (n samples each, tool turns in between) -> rewards ->
group-normalised advantages -> trajectories packed under the mask policy (old log-probs from
the sampling engine) -> reference log-probs when the KL is on -> one trainer step -> weight
sync into the engines -> metrics to MLflow. SFT steps only train.

The global step (MLflow's step) counts optimizer steps over all stages. A step is committed
when its metrics are logged; a checkpoint records the last committed step, so a resume runs
step+1 next: nothing lost, nothing logged twice.
"""

from __future__ import annotations

import logging
import os
import time
import traceback
from pathlib import Path
from typing import Any

import ray
from rich.console import Console

from mtprun.data.tokenizer import build_tokenizer
from mtprun.models.tiny import build_tiny_model
from mtprun.runner import checkpoint
from mtprun.runner.actors import RolloutWorker, TrainerWorker
from mtprun.runner.episodes import EpisodeCollector
from mtprun.runner.export import export_checkpoint
from mtprun.runner.progress import RunProgress, summary_line
from mtprun.runner.rollout_pool import RolloutPool
from mtprun.runner.run_dir import RunDir
from mtprun.runner.sft_source import SftSource
from mtprun.runner.stages import Stage, plan_stages
from mtprun.runner.stop import StopRequest
from mtprun.runner.tracking import Tracker
from mtprun.runner.trainer_group import TrainerGroup
from mtprun.spec import Recipe

log = logging.getLogger("mtprun")

EXIT_OK, EXIT_FAILED, EXIT_STOPPED = 0, 1, 130
_SUMMARY = {
    "reward/mean": "reward",
    "train/loss": "loss",
    "response/length": "length",
    "time/step_s": "s/step",
}
_ROLLOUT_MAX_RESTARTS = 3


class Driver:
    """One attempt of a run: connects Ray, runs the remaining steps, always cleans up."""

    def __init__(self, recipe: Recipe, run_dir: RunDir, tracker: Tracker, console: Console) -> None:
        self.recipe = recipe
        self.run_dir = run_dir
        self.tracker = tracker
        self.console = console
        self.stages = plan_stages(recipe)
        self.stop = StopRequest()
        self.step = 0  # last committed global step
        self.saved_step = 0  # last checkpointed global step
        self.trainer: TrainerGroup | None = None
        self.pool: RolloutPool | None = None

    # ---- the attempt ---------------------------------------------------------------------

    def execute(self, ray_address: str | None) -> int:
        """Run from the newest checkpoint (or the start) to the end; returns the exit code."""
        self.stop.install()
        try:
            self._ensure_model()
            self._connect_ray(ray_address)
            self._resume_position()
            with RunProgress(self.console) as progress:
                for stage in self.stages:
                    if self.step < stage.last_step and not self.stop.requested:
                        self._run_stage(stage, progress)
        except BaseException as err:  # every way out marks the MLflow run and cleans up
            return self._fail(err)
        finally:
            self.stop.shield()
            self._shutdown()
            self.stop.uninstall()
        if self.stop.requested:
            self.tracker.finish(
                "KILLED", f"stopped by {self.stop.requested} after step {self.step}"
            )
            log.warning(
                "stopped after step %d; continue with: mtprun resume %s",
                self.step,
                self.run_dir.root,
            )
            return EXIT_STOPPED
        final = export_checkpoint(
            self.run_dir.checkpoints, self.step, self.run_dir.exports / "final"
        )
        self.tracker.set_tags({"mtprun.export": str(final)})
        self.tracker.finish("FINISHED")
        log.info("finished %d steps; policy exported to %s", self.step, final)
        return EXIT_OK

    def _fail(self, err: BaseException) -> int:
        status = "KILLED" if isinstance(err, KeyboardInterrupt) else "FAILED"
        text = (
            "interrupted"
            if status == "KILLED"
            else "".join(traceback.format_exception_only(type(err), err)).strip()
        )
        log.error("run %s at step %d: %s", status.lower(), self.step, text)
        log.debug("%s", "".join(traceback.format_exception(err)))
        try:
            self.tracker.finish(status, text)
        except Exception as tracking_err:  # the error itself matters more
            log.error("could not mark the MLflow run %s: %s", status, tracking_err)
        return EXIT_STOPPED if status == "KILLED" else EXIT_FAILED

    def _ensure_model(self) -> None:
        """The run's initial HF folder: the recipe's model.path, or a tiny model built here."""
        target = self.run_dir.model_dir
        if (target / "config.json").exists():
            return
        model = self.recipe.model
        if model.path is not None:
            target.symlink_to(Path(model.path).resolve(), target_is_directory=True)
            return
        task, data = self.recipe.task, self.recipe.data
        template = task.template if task is not None else data.template
        log.info("building a tiny %s model in %s", model.tiny.architecture, target)
        build_tiny_model(model.tiny, build_tokenizer(template), target, self.recipe.seed)

    def _connect_ray(self, address: str | None) -> None:
        address = address or self.recipe.resources.ray_address
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        if address:
            log.info("joining the Ray cluster at %s", address)
            ray.init(address=address, log_to_driver=False)
        else:
            res = self.recipe.resources
            temp_dir = self.run_dir.ray_temp_dir()
            log.info("starting a local Ray instance (temp folder %s)", temp_dir)
            ray.init(
                num_cpus=res.num_cpus,
                num_gpus=res.num_gpus,
                include_dashboard=False,
                log_to_driver=False,
                _temp_dir=str(temp_dir),
            )

    def _shutdown(self) -> None:
        self._stop_engines()
        if ray.is_initialized():
            ray.shutdown()

    def _resume_position(self) -> None:
        step = checkpoint.latest(self.run_dir.checkpoints)
        if step is not None:
            self.step = self.saved_step = step
            log.info(
                "resuming after step %d (checkpoint %s)",
                step,
                checkpoint.step_dir(self.run_dir.checkpoints, step),
            )
        last_logged = self.tracker.last_logged_step("train/loss")
        if last_logged > self.step:
            # Only a hard kill gets here (a graceful stop checkpoints its last step): the steps
            # after the checkpoint run again and keep the metrics MLflow already has.
            log.warning(
                "steps %d..%d ran after the newest checkpoint and are run again; "
                "MLflow keeps their first metrics",
                self.step + 1,
                last_logged,
            )
        self._logged_until = last_logged

    # ---- one stage -----------------------------------------------------------------------

    def _run_stage(self, stage: Stage, progress: RunProgress) -> None:
        start_dir = self._stage_start_dir(stage)
        resume_from = (
            checkpoint.step_dir(self.run_dir.checkpoints, self.step)
            if stage.contains(self.step)
            else None
        )
        log.info(
            "stage %s: steps %d..%d from %s",
            stage.name,
            self.step + 1,
            stage.last_step,
            resume_from or start_dir,
        )
        self.trainer = self.trainer or self._start_trainer()
        grpo = stage.plan.term("grpo")
        with_reference = grpo is not None and grpo.kl_coef > 0
        self.trainer.build(stage.recipe, str(start_dir), stage.plan.to_json(), with_reference)
        if resume_from is not None:
            trained = self.trainer.load(str(resume_from))
            if trained != self.step - stage.offset:
                raise RuntimeError(
                    f"checkpoint {resume_from} holds a trainer at stage step {trained}, but its "
                    f"driver.json says global step {self.step} (stage {stage.name} starts after "
                    f"{stage.offset}); the checkpoint is inconsistent: resume from an earlier one"
                )
        collector = None
        if stage.kind == "grpo":
            policy_dir = resume_from / "hf" if resume_from else start_dir
            self._start_rollouts(stage, policy_dir)
            collector = EpisodeCollector(stage.recipe, start_dir, self.pool)
        sft = SftSource(stage.recipe, start_dir) if stage.kind == "sft" else None
        bar = progress.stage(stage.name, stage.steps, self.step - stage.offset)
        every = self.recipe.trainer.checkpoint_every
        while self.step < stage.last_step and not self.stop.requested:
            step = self.step + 1
            metrics, samples = (
                self._grpo_step(stage, collector, step)
                if collector
                else self._sft_step(stage, sft, step)
            )
            self._commit(step, metrics, samples)
            progress.step_done(bar, summary_line(step, metrics, _SUMMARY))
            if every and step % every == 0:
                self._save()
        self._save()  # stage end, or a graceful stop: the next attempt continues right here
        if self.pool is not None:
            self.pool.shutdown()
            self.pool = None

    def _stage_start_dir(self, stage: Stage) -> Path:
        """The HF folder the stage starts from: the model, or the previous stage's result."""
        if stage.offset == 0:
            return self.run_dir.model_dir
        return checkpoint.step_dir(self.run_dir.checkpoints, stage.offset) / "hf"

    def _start_trainer(self) -> TrainerGroup:
        """The trainer ranks, started once per attempt and reused by every stage."""
        res, par = self.recipe.resources, self.recipe.parallel
        world = par.tp * par.pp * par.cp * par.dp
        remote = ray.remote(TrainerWorker).options(
            num_cpus=res.cpus_per_actor, num_gpus=res.gpus_per_actor, max_restarts=0
        )
        threads = self._torch_threads(world)
        actors = [remote.remote(rank, world, threads) for rank in range(world)]
        group = TrainerGroup(actors, par, self.recipe.seed)
        log.info("trainer ready: %d rank(s), pids %s", world, group.pids)
        return group

    def _start_rollouts(self, stage: Stage, policy_dir: Path) -> None:
        res = self.recipe.resources
        count = self.recipe.rollout.num_engines
        remote = ray.remote(RolloutWorker).options(
            num_cpus=res.cpus_per_actor,
            num_gpus=res.gpus_per_actor,
            max_restarts=_ROLLOUT_MAX_RESTARTS,
        )
        threads = self._torch_threads(count)
        actors = [
            remote.remote(
                str(policy_dir),
                self.recipe.rollout,
                self.recipe.seed + i,
                str(self.run_dir.vllm_dir / f"engine{i}"),
                threads,
            )
            for i in range(count)
        ]
        self.pool = RolloutPool(actors, max_retries=_ROLLOUT_MAX_RESTARTS)
        log.info("rollout engines ready: pids %s", self.pool.pids)

    def _torch_threads(self, actors_at_once: int) -> int | None:
        """On CPU the trainer and the engines take turns, so each may use the node's cores."""
        if self.recipe.resources.gpus_per_actor > 0:
            return None
        cpus = min(os.cpu_count() or 1, int(ray.cluster_resources().get("CPU", 1)))
        return max(1, cpus // max(1, actors_at_once))

    def _stop_engines(self) -> None:
        for engines in (self.pool, self.trainer):
            if engines is not None:
                engines.shutdown()
        self.pool = self.trainer = None

    # ---- steps ---------------------------------------------------------------------------

    def _sft_step(self, stage: Stage, sft: SftSource, step: int) -> tuple[dict, str]:
        start = time.perf_counter()
        batches = sft.batches(step - stage.offset)
        metrics = _prefixed("train", self.trainer.train_step(batches))
        seconds = time.perf_counter() - start
        tokens = sum(b.num_tokens for b in batches)
        metrics.update(
            {
                "time/train_s": seconds,
                "time/step_s": seconds,
                "train/tokens_per_s": tokens / seconds,
                "train/trained_token_frac": _trained_fraction(batches),
            }
        )
        return metrics, ""

    def _grpo_step(self, stage: Stage, collector: EpisodeCollector, step: int) -> tuple[dict, str]:
        start = time.perf_counter()
        episodes = collector.collect(step)
        rollout_s = time.perf_counter() - start
        batches = collector.pack(
            episodes, stage.recipe.mask, stage.recipe.trainer.micro_batch_tokens
        )
        metrics = episodes.metrics(rollout_s)
        if self.recipe.rollout.speculative is not None:
            metrics.update(self.pool.spec_decode_step())
        tick = time.perf_counter()
        if stage.plan.term("grpo").kl_coef > 0:
            for batch, ref in zip(
                batches, self.trainer.logprobs(batches, reference=True), strict=True
            ):
                batch.ref_logprobs = ref
        metrics.update(_prefixed("train", self.trainer.train_step(batches)))
        train_s = time.perf_counter() - tick
        tick = time.perf_counter()
        engine_sync_s = self.pool.update_weights(self.trainer.weights_ref())
        sync_s = time.perf_counter() - tick
        tokens = sum(b.num_tokens for b in batches)
        metrics.update(
            {
                "time/rollout_s": rollout_s,
                "time/train_s": train_s,
                "time/sync_s": sync_s,
                "time/engine_sync_s": engine_sync_s,
                "time/step_s": time.perf_counter() - start,
                "train/tokens_per_s": tokens / train_s,
                "train/trained_token_frac": _trained_fraction(batches),
                "rollout/engine_restarts": float(self.pool.restarts),
            }
        )
        return metrics, episodes.sample_text(limit=8)

    def _commit(self, step: int, metrics: dict[str, float], samples: str) -> None:
        if step > self._logged_until:
            self.tracker.log_metrics(step, metrics)
            if samples:
                self.tracker.log_text(samples, f"samples/step_{step:06d}.txt")
        log.debug("step %d: %s", step, metrics)
        self.step = step

    def _save(self) -> None:
        if self.saved_step == self.step or self.trainer is None:
            return
        partial = checkpoint.begin(self.run_dir.checkpoints, self.step)
        self.trainer.save(str(partial))
        final = checkpoint.publish(partial, {"step": self.step})
        self.saved_step = self.step
        self.tracker.set_tags({"mtprun.checkpoint": str(final)})
        log.info("checkpoint: %s", final)


def _prefixed(prefix: str, metrics: dict[str, float]) -> dict[str, float]:
    return {f"{prefix}/{k}": float(v) for k, v in metrics.items()}


def _trained_fraction(batches: list[Any]) -> float:
    total = sum(b.num_tokens for b in batches)
    return sum(int(b.loss_mask.sum()) for b in batches) / max(total, 1)

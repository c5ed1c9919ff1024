"""The run loop behind `mtprun run` and `mtprun resume`.

Per RL step: prompts -> rollout engines (n samples each, tool turns in between) -> rewards ->
group-normalised advantages -> trajectories packed under the mask policy (old log-probs from
the sampling engine) -> reference log-probs when the KL is on -> one trainer step -> weight
sync into the engines -> metrics to MLflow. SFT steps only train. The rollouts run in a
background thread, up to `rollout.max_staleness` steps ahead of the trainer
(run/rollouts_ahead.py; 0: each step's rollouts wait for the previous step's weights).

The global step (MLflow's step) counts optimizer steps over all stages. A step is committed
when its metrics are logged; a checkpoint records the last committed step, so a resume runs
step+1 next: nothing lost, nothing logged twice. Rollouts generated ahead for steps not yet
committed are dropped when the loop stops (Ctrl-C, a trainer restart): the next loop
generates them again from the weights it starts with.
"""

from __future__ import annotations

import logging
import time
import traceback
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import RayTaskError
from rich.console import Console
from rich.progress import TaskID

from mtprun.runner.placement import Placement
from mtprun.runner.rollout.engine import routed_experts_problem
from mtprun.runner.rollout.episodes import EpisodeCollector
from mtprun.runner.rollout.pool import RolloutPool
from mtprun.runner.rollout.rewards import EpisodeScorer
from mtprun.runner.rollout.scorers import ScorerPlacement
from mtprun.runner.run import checkpoint
from mtprun.runner.run.colocation import Colocation
from mtprun.runner.run.evaluation import Evaluator
from mtprun.runner.run.export import export_checkpoint
from mtprun.runner.run.progress import RunProgress, summary_line
from mtprun.runner.run.ray_session import connect_ray
from mtprun.runner.run.rollouts_ahead import RolloutsAhead
from mtprun.runner.run.sft_source import SftSource
from mtprun.runner.run.stages import Stage, plan_stages
from mtprun.runner.run.steps import StepResult, generate_rollout, grpo_step, sft_step
from mtprun.runner.run.stop import StopRequest
from mtprun.runner.run.tiny_folder import tiny_model_folder
from mtprun.runner.run.weight_sync import WeightSync
from mtprun.runner.run_dir import RunDir
from mtprun.runner.tracking.tracker import Tracker
from mtprun.runner.trainer.group import TrainerDied, TrainerGroup
from mtprun.spec import Recipe
from mtprun.spec.actors import ActorDemand
from mtprun.spec.resources import weight_transfer_method

log = logging.getLogger("mtprun")

EXIT_OK, EXIT_FAILED, EXIT_STOPPED = 0, 1, 130
_SUMMARY = {
    "reward/mean": "reward",
    "train/loss": "loss",
    "response/length": "length",
    "time/step_s": "s/step",
    "tracking/backlog": "tracking/backlog",
}


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
        self.pool_start_dir: Path | None = None  # the folder the pool's engines started from
        self.collector: EpisodeCollector | None = None  # the GRPO stage's episodes and rewards
        self.scorer: EpisodeScorer | None = None  # the collector's, started before the engines
        self.sync: WeightSync | None = None  # the trainer's weights into the pool's engines
        self.placement: Placement | None = None  # where the actors run (once Ray is up)
        self.colocation: Colocation | None = None  # colocated GRPO: the GPUs' handovers
        self._logged_until = 0  # the newest step MLflow has metrics for (set on resume)
        self.trainer_restarts = 0  # trainer groups started again in this attempt

    # ---- the attempt ---------------------------------------------------------------------

    def execute(self, ray_address: str | None) -> int:
        """Run from the newest checkpoint (or the start) to the end; returns the exit code."""
        self.stop.install()
        try:
            self._ensure_model()
            self._check_teachers()
            self._connect_ray(ray_address)
            self.stop.install()  # again: Ray's driver replaced the SIGTERM handler
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
            self._finish("KILLED", f"stopped by {self.stop.requested} after step {self.step}")
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
        self._finish("FINISHED")
        log.info("finished %d steps; policy exported to %s", self.step, final)
        log.info("see the run in MLflow: mtprun ui %s", self.run_dir.root)
        return EXIT_OK

    def _fail(self, err: BaseException) -> int:
        status = "KILLED" if isinstance(err, KeyboardInterrupt) else "FAILED"
        text = "interrupted" if status == "KILLED" else _error_text(err)
        log.error("run %s at step %d: %s", status.lower(), self.step, text)
        log.debug("%s", "".join(traceback.format_exception(err)))
        try:
            self._finish(status, text)
        except Exception as tracking_err:  # the error itself matters more
            log.error("could not mark the MLflow run %s: %s", status, tracking_err)
        return EXIT_STOPPED if status == "KILLED" else EXIT_FAILED

    def _finish(self, status: str, error: str | None = None) -> None:
        """The run's final status and error into the spool, then at most
        tracking.flush_timeout_s of uploading: a dead server never holds the exit."""
        self.tracker.finish(status, error, timeout=self.recipe.tracking.flush_timeout_s)

    def _ensure_model(self) -> None:
        """The run's initial HF folder: the recipe's model.path, or a tiny model (built, or
        copied from the cache: `tiny_folder`)."""
        target = self.run_dir.model_dir
        if (target / "config.json").exists():
            return
        model = self.recipe.model
        if model.path is not None:
            target.symlink_to(Path(model.path).resolve(), target_is_directory=True)
            return
        task, data = self.recipe.task, self.recipe.data
        template = task.template if task is not None else data.template
        tiny_model_folder(model.tiny, template, self.recipe.seed, target)

    def _check_teachers(self) -> None:
        """Fail before Ray starts when a distill teacher is not an HF folder (the trainers
        would each fail to load it)."""
        for i, term in enumerate(self.recipe.losses):
            if term.kind == "distill" and not (Path(term.teacher) / "config.json").is_file():
                raise FileNotFoundError(
                    f"losses.{i}.teacher: {term.teacher} is not an HF model folder (no "
                    "config.json); point it at one, such as a run's export "
                    "(`mtprun export RUN_DIR` writes RUN_DIR/export/step_N)"
                )

    def _connect_ray(self, address: str | None) -> None:
        connect_ray(self.recipe, self.run_dir, address, ActorDemand.of(self.recipe))
        self.placement = Placement(self.recipe)

    def _shutdown(self) -> None:
        self._stop_engines(trainer=True)
        if self.placement is not None and ray.is_initialized():
            self.placement.remove()
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
        last_logged = self.tracker.last_logged_step()
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
        rl_stage = stage if stage.kind == "grpo" else self._next_rl_stage(stage)
        if rl_stage is not None and self.recipe.trainer.router_replay:
            # Before the trainer loads: an engine that cannot return routings is known now.
            problem = routed_experts_problem(self.recipe.rollout)
            if problem is not None:
                raise ValueError(f"trainer.router_replay: {problem}")
        if rl_stage is not None and self.pool is None and self._engines_load_beside_trainer():
            # vLLM's start-up (imports, load, compile) runs while the trainer loads and, for
            # the RL stage after a warm start, while the warm start trains: from this stage's
            # start folder, the RL stage's own weights pushed into them when it begins.
            self._launch_rollouts(rl_stage, start_dir, version=stage.offset)
        self._prepare_trainer(stage, start_dir, resume_from)
        if stage.kind == "grpo":
            step_fn, generate = self._start_rollouts(stage, start_dir, resume_from)
        else:
            step_fn = partial(sft_step, sft=SftSource(stage.recipe, start_dir), stage=stage)
            generate = None
        bar = progress.stage(stage.name, stage.steps, self.step - stage.offset)
        died: TrainerDied | None = None
        while True:  # once, plus once per trainer restart
            try:
                if died is not None:
                    self._restart_trainer(stage, start_dir, died)
                    progress.update(bar, completed=self.step - stage.offset)
                    died = None
                self._run_steps(stage, step_fn, progress, bar, generate)
                self._save()  # stage end, or a graceful stop: the next attempt goes on here
                break
            except TrainerDied as err:
                died = err
        if stage.kind == "grpo":  # a warm start leaves the next stage's engines loading
            self._stop_engines()

    def _next_rl_stage(self, stage: Stage) -> Stage | None:
        """The RL stage right after `stage`, if there is one whose engines may load during
        `stage`: not under LoRA, whose syncs move the adapters alone (the engines serve the
        RL stage's start folder as their base)."""
        following = self.stages[self.stages.index(stage) + 1 :]
        if not following or following[0].kind != "grpo" or self.recipe.model.lora is not None:
            return None
        return following[0]

    def _engines_load_beside_trainer(self) -> bool:
        """Whether the engines may start while the trainer loads: not where they can share
        its GPU (colocated, or a fractional resources.gpus_per_actor), as vLLM sizes an
        engine's memory by what the GPU has free as it starts."""
        assert self.placement is not None
        return not (self.placement.colocate or self.placement.fractional_gpus)

    def _launch_rollouts(self, stage: Stage, start_dir: Path, version: int) -> None:
        """An RL stage's reward scorer and rollout engines started, loading while the driver
        goes on (`self.pool.ready()` waits for the engines). Engines start from `start_dir`
        (policy `version`), a stage's start folder, which pruning never deletes: Ray restarts
        a dead engine with the same arguments."""
        assert self.placement is not None
        self.scorer = self._start_scorer(stage)
        self.pool = RolloutPool.launch(
            self.recipe, start_dir, self.run_dir.vllm_dir, self.placement, version=version
        )
        self.pool_start_dir = start_dir

    def _start_rollouts(
        self, stage: Stage, start_dir: Path, resume_from: Path | None
    ) -> tuple[Callable[..., StepResult], Callable[[int], Any]]:
        """An RL stage's rollout side up (engines launched if they were not), its weight sync
        and episode collector made, the trainer already loaded; its step function and its
        rollout generator. A resumed stage pushes the checkpoint's weights into the engines."""
        assert self.placement is not None
        colocation = None
        if self.pool is None:  # they share the trainer's GPU: started now it has loaded
            if self.placement.colocate:
                # The engines size their KV cache by the memory the trainer leaves them.
                self.trainer.offload()
            self._launch_rollouts(stage, start_dir, version=stage.offset)
        self.pool.ready()
        log.info("rollout engines ready: pids %s", self.pool.pids)
        self.sync = WeightSync(weight_transfer_method(self.recipe), lambda: self.trainer, self.pool)
        if self.placement.colocate:
            colocation = self.colocation = Colocation(lambda: self.trainer, self.pool, self.sync)
        # With LoRA the engines serve the base alone until a sync brings the trainer's
        # adapters, which model.lora.path makes nonzero from the start. Engines that loaded
        # during the warm start hold its start's weights.
        lora = stage.recipe.model.lora is not None
        if resume_from is not None or lora or self.pool_start_dir != start_dir:
            self.sync.push()
        collector = self.collector = EpisodeCollector(
            stage.recipe, start_dir, self.pool, self.scorer
        )
        evaluator = Evaluator(stage.recipe, collector) if stage.recipe.eval else None
        generate = partial(generate_rollout, pool=self.pool, collector=collector, stage=stage)
        step_fn = partial(
            grpo_step,
            collector=collector,
            sync=self.sync,
            stage=stage,
            gpus=ActorDemand.of(self.recipe).need("GPU"),
            colocation=colocation,
            evaluator=evaluator,
        )
        return step_fn, generate

    def _run_steps(
        self,
        stage: Stage,
        step_fn: Callable[..., StepResult],
        progress: RunProgress,
        bar: TaskID,
        generate: Callable[[int], Any] | None = None,
    ) -> None:
        """The stage's steps from the next one on; an RL stage's rollouts are generated
        ahead by `generate` in a background thread (dropped for the steps not reached)."""
        every = self.recipe.trainer.checkpoint_every
        rollouts = None
        if generate is not None:
            staleness = self.recipe.rollout.max_staleness
            rollouts = RolloutsAhead(generate, staleness, self.step + 1, stage.last_step)
            step_fn = partial(step_fn, rollouts=rollouts)
            if self.pool is not None and self.pool.partial is not None:
                self.pool.partial.between_chunks = rollouts.pause_point
        try:
            while self.step < stage.last_step and not self.stop.requested:
                step = self.step + 1
                result = step_fn(self.trainer, step=step)  # the current trainer: restarts swap it
                result.metrics["train/restarts"] = float(self.trainer_restarts)
                self._commit(step, result)
                summary = summary_line(step, self._progress_metrics(result), _SUMMARY)
                progress.step_done(bar, summary)
                # log.txt keeps every step's line; a console that is no terminal (a cluster
                # job's log, a pipe) draws the bars only at the end, so it gets them too.
                (log.debug if self.console.is_terminal else log.info)(summary)
                if every and step % every == 0:
                    self._save()
        finally:
            if rollouts is not None:
                rollouts.close()

    def _restart_trainer(self, stage: Stage, start_dir: Path, died: TrainerDied) -> None:
        """A new trainer group at the newest checkpoint (or the stage's start), the engines
        synced to it; the steps after that checkpoint run again with the same data and are
        not logged twice. Past trainer.max_restarts the run fails with the cause."""
        self.trainer_restarts += 1
        limit = self.recipe.trainer.max_restarts
        if self.trainer_restarts > limit:
            raise RuntimeError(
                f"{died} during step {self.step + 1}, after {limit} trainer restart(s) in this "
                "attempt (trainer.max_restarts); giving up"
            ) from died
        log.warning(
            "%s during step %d; restarting the trainer from step %d (restart %d of %d)",
            died,
            self.step + 1,
            self.saved_step,
            self.trainer_restarts,
            limit,
        )
        if self.trainer is not None:
            self.trainer.kill()
            self.trainer = None
        self._logged_until = max(self._logged_until, self.step)
        self.step = self.saved_step
        resume_from = (
            checkpoint.step_dir(self.run_dir.checkpoints, self.step)
            if stage.contains(self.step)
            else None
        )
        self._prepare_trainer(stage, start_dir, resume_from)
        if self.sync is not None:  # the engines hold newer weights than the checkpoint
            self.sync.push()

    def _prepare_trainer(self, stage: Stage, start_dir: Path, resume_from: Path | None) -> None:
        """The stage's Trainer in the (once started) trainer actors, at the checkpoint's state
        when the stage is resumed."""
        if self.trainer is None:  # started once, reused by every stage
            assert self.placement is not None
            self.trainer = TrainerGroup.start(self.recipe, self.placement)
            log.info(
                "trainer ready: %d rank(s), pids %s", len(self.trainer.pids), self.trainer.pids
            )
        self.trainer.build(
            stage.recipe, str(start_dir), stage.plan.to_json(), stage.needs_reference
        )
        self.trainer.version = self.step
        if resume_from is not None:
            trained = self.trainer.load(str(resume_from))
            if trained != self.step - stage.offset:
                raise RuntimeError(
                    f"checkpoint {resume_from} holds a trainer at stage step {trained}, but its "
                    f"driver.json says global step {self.step} (stage {stage.name} starts after "
                    f"{stage.offset}); the checkpoint is inconsistent: resume from an earlier one"
                )

    def _start_scorer(self, stage: Stage) -> EpisodeScorer | None:
        """The GRPO stage's reward scorer, its served reward models loading from now on, beside
        the rollout engines that start next (Ray holds both at once: connect_ray checked
        ActorDemand, which counts them). None (the collector makes it after the engines, as
        before) where a fractional resources.gpus_per_actor lets a reward model share an
        engine's GPU: vLLM sizes an engine's memory by what its GPU has free as it loads, which
        another engine loading at the same time would skew."""
        assert self.placement is not None
        if self.placement.fractional_gpus:
            return None
        recipe = stage.recipe
        return EpisodeScorer.for_task(recipe.task, ScorerPlacement.of(recipe), wait=False)

    def _stage_start_dir(self, stage: Stage) -> Path:
        """The HF folder the stage starts from: the model, or the previous stage's result."""
        if stage.offset == 0:
            return self.run_dir.model_dir
        return checkpoint.step_dir(self.run_dir.checkpoints, stage.offset) / "hf"

    def _stop_engines(self, trainer: bool = False) -> None:
        """Stop the rollout engines and reward workers (and the trainer actors)."""
        if self.collector is not None:
            self.collector.close()
        elif self.scorer is not None:  # started before a failure kept the collector from it
            self.scorer.close()
        for engines in (self.pool, self.trainer if trainer else None):
            if engines is not None:
                engines.shutdown()
        self.pool = self.collector = self.scorer = self.sync = self.colocation = None
        if trainer:
            self.trainer = None

    def _commit(self, step: int, result: StepResult) -> None:
        if step > self._logged_until:
            self.tracker.log_metrics(step, result.metrics)
            if result.samples:
                self.tracker.log_text(result.samples, f"samples/step_{step:06d}.txt")
        log.debug("step %d: %s", step, result.metrics)
        self.step = step

    def _progress_metrics(self, result: StepResult) -> dict[str, float]:
        """The step's metrics, and the tracking backlog while the server is unreachable."""
        if self.tracker.outage is None:
            return result.metrics
        return {**result.metrics, "tracking/backlog": float(self.tracker.backlog)}

    def _save(self) -> None:
        if self.saved_step == self.step or self.trainer is None:
            return
        trainer = self.trainer
        start = time.perf_counter()
        parts: dict[str, float] = {}

        def write() -> Path:
            return checkpoint.write(
                self.run_dir.checkpoints,
                self.step,
                lambda folder: parts.update(trainer.save(str(folder))),
                {"step": self.step},
            )

        if self.colocation is None:
            final = write()
        else:  # the optimizer state waits on the host while the engines generate
            written: list[Path] = []
            self.colocation.with_trainer_state(lambda: written.append(write()))
            (final,) = written
        self.saved_step = self.step
        self.tracker.set_tags({"mtprun.checkpoint": str(final)})
        split = ", ".join(f"{name} {s:.0f} s" for name, s in parts.items())
        log.info("checkpoint: %s (%.0f s: %s)", final, time.perf_counter() - start, split)
        keep = self.recipe.trainer.keep_checkpoints
        if keep is not None:
            # Stage ends stay: the next stage and `mtprun export --step` start from them.
            stage_ends = {stage.last_step for stage in self.stages}
            deleted = checkpoint.prune(self.run_dir.checkpoints, keep, stage_ends)
            if deleted:
                log.info("deleted old checkpoints of steps %s", ", ".join(map(str, deleted)))


def _error_text(err: BaseException) -> str:
    """The error's type and message; for an error raised inside an actor, the original one
    (Ray's wrapper repeats the actor's whole traceback, which the debug log keeps)."""
    if isinstance(err, RayTaskError) and isinstance(err.cause, BaseException):
        err = err.cause
    return "".join(traceback.format_exception_only(type(err), err)).strip()

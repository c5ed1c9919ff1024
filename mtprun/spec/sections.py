"""`RecipeSections`: one experiment as a typed tree of sections, each valid on its own.

`mtprun.spec.recipe.Recipe` adds the cross-field rules; the rules read this class, so they
and the Recipe that runs them do not import each other.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from mtprun.losses import RecipeTerm
from mtprun.losses.ce import CETerm
from mtprun.spec.base import Section
from mtprun.spec.data import DataSection, TaskSection, WarmstartSection
from mtprun.spec.eval import EvalSection
from mtprun.spec.mask import MaskPolicy
from mtprun.spec.model import ModelSection
from mtprun.spec.parallel import ParallelSection
from mtprun.spec.resources import ResourcesSection
from mtprun.spec.rollout import RolloutSection
from mtprun.spec.tracking import TrackingSection
from mtprun.spec.trainer import TrainerSection

RUN_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"


class RecipeSections(Section):
    """One experiment's sections: model, data or task, fused loss terms, mask, parallelism,
    rollouts, optimisation, tracking and resources."""

    name: str = Field(
        ...,
        pattern=RUN_NAME_PATTERN,
        description="Run name: letters, digits, '.', '_', '-' (it names the default run folder).",
    )
    seed: int = Field(0, description="Seed of model init, data order and sampling.")
    run_dir: str | None = Field(
        None, description="Folder of checkpoints, logs and tracking; null means runs/<name>."
    )
    model: ModelSection = Field(..., description="The policy model.")
    data: DataSection | None = Field(None, description="SFT data (a recipe has data or task).")
    task: TaskSection | None = Field(None, description="RL task (a recipe has data or task).")
    warmstart: WarmstartSection | None = Field(
        None, description="SFT stage before RL, in the same run (needs task)."
    )
    eval: EvalSection | None = Field(
        None, description="Evaluation on held-out prompts (needs task)."
    )
    losses: list[RecipeTerm] = Field(
        default_factory=lambda: [CETerm()],
        min_length=1,
        description="Loss terms, fused into one head kernel; the loss is their weighted sum. "
        "router_aux / router_z are trunk losses of a mixture-of-experts model's router.",
    )
    mask: MaskPolicy = Field("sampled", description="Which tokens the loss trains.")
    parallel: ParallelSection = Field(
        default_factory=ParallelSection, description="Model-parallel layout of the trainer."
    )
    rollout: RolloutSection = Field(
        default_factory=RolloutSection, description="Generation engine of RL rollouts."
    )
    trainer: TrainerSection = Field(
        default_factory=TrainerSection, description="Optimizer, schedule and step budget."
    )
    tracking: TrackingSection = Field(
        default_factory=TrackingSection, description="Where MLflow records the run."
    )
    resources: ResourcesSection = Field(
        default_factory=ResourcesSection, description="Ray cluster and per-actor resources."
    )

    @model_validator(mode="before")
    @classmethod
    def _fill_run_paths(cls, data: Any) -> Any:
        # Concrete paths in the validated recipe, so what is logged is what ran.
        if not isinstance(data, dict) or not isinstance(data.get("name"), str):
            return data
        data = dict(data)
        if data.get("run_dir") is None:
            data["run_dir"] = f"runs/{data['name']}"
        tracking = data.get("tracking")
        if tracking is None or (isinstance(tracking, dict) and tracking.get("uri") is None):
            tracking = dict(tracking or {})
            tracking["uri"] = f"sqlite:///{data['run_dir']}/mlflow.db"
            data["tracking"] = tracking
        return data

    @property
    def is_rl(self) -> bool:
        return self.task is not None

"""A run as a sequence of stages sharing one global step counter (the MLflow step).

    warmstart (SFT, optional) -> grpo     for a recipe with `task:`
    sft                                   for a recipe with `data:`

Each stage builds its own trainer (its own lr, step budget and HeadPlan) from the HF folder
the previous stage ended with, so a stage boundary is simply a checkpoint's `hf/` folder.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from mtprun.compiler import HeadPlan, compile_recipe
from mtprun.losses.ce import CETerm
from mtprun.spec import Recipe


@dataclass(frozen=True)
class Stage:
    name: str
    kind: Literal["sft", "grpo"]
    recipe: Recipe  # the recipe as this stage's trainer sees it
    plan: HeadPlan
    offset: int  # global step before the stage's first step
    steps: int

    @property
    def last_step(self) -> int:
        return self.offset + self.steps

    def contains(self, step: int) -> bool:
        return self.offset < step <= self.last_step

    @property
    def needs_reference(self) -> bool:
        """GRPO with a KL term: reference log-probs from the stage's frozen starting policy."""
        grpo = self.plan.term("grpo")
        return grpo is not None and grpo.kl_coef > 0


def plan_stages(recipe: Recipe) -> list[Stage]:
    if recipe.task is None:
        if recipe.data is None:
            raise ValueError("the recipe has neither `data:` (SFT) nor `task:` (RL)")
        steps = recipe.trainer.steps
        return [Stage("sft", "sft", recipe, compile_recipe(recipe), 0, steps)]
    stages = []
    if recipe.warmstart is not None:
        ws = recipe.warmstart
        trainer = recipe.trainer.model_copy(update={"lr": ws.lr, "steps": ws.steps})
        ws_recipe = recipe.model_copy(
            update={"data": ws.data, "task": None, "losses": [CETerm()], "trainer": trainer}
        )
        ws_plan = HeadPlan.compile([CETerm()], tp_size=recipe.parallel.tp)
        stages.append(Stage("warmstart", "sft", ws_recipe, ws_plan, 0, ws.steps))
    offset = stages[-1].last_step if stages else 0
    grpo = recipe
    if stages and recipe.model.lora is not None and recipe.model.lora.path is not None:
        # The warmstart's end has model.lora.path's adapters merged in: fresh ones go on it.
        lora = recipe.model.lora.model_copy(update={"path": None})
        grpo = recipe.model_copy(update={"model": recipe.model.model_copy(update={"lora": lora})})
    stages.append(Stage("grpo", "grpo", grpo, compile_recipe(grpo), offset, recipe.trainer.steps))
    return stages

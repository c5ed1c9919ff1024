"""`eval:` held-out prompts scored every N steps, at the end, and by `mtprun eval`."""

from __future__ import annotations

from pydantic import Field, field_validator, model_validator

from mtprun.spec.base import Section
from mtprun.spec.data import PromptSource, path_shorthand


class EvalSection(Section):
    """Evaluation of the policy on held-out prompts with the task's reward."""

    prompts: PromptSource | None = Field(
        None,
        description="Evaluation prompts (a path, {path, columns}, or a reasoning-gym dataset "
        "{reasoning_gym, size, seed, config}); null: the rows task.prompts.heldout holds out, "
        "or for a built-in or reasoning-gym task prompts drawn with another seed.",
    )
    num_prompts: int | None = Field(
        None,
        ge=1,
        description="Prompts per evaluation (null: every held-out row; 32 from a built-in task).",
    )
    every: int = Field(0, ge=0, description="Evaluate every N RL steps (0: only at the end).")
    at_end: bool = Field(True, description="Evaluate the final policy.")
    samples: int = Field(1, ge=1, description="Samples per prompt (n of pass@k).")
    pass_k: list[int] = Field(
        default_factory=lambda: [1],
        min_length=1,
        description="k of each pass@k logged (each <= samples).",
    )
    pass_threshold: float = Field(
        1.0, description="A sample passes when its reward total is at least this."
    )
    temperature: float | None = Field(
        None, ge=0, description="Sampling temperature (null: rollout.temperature)."
    )
    top_p: float | None = Field(
        None, gt=0, le=1, description="Nucleus sampling mass (null: rollout.top_p)."
    )
    max_tokens: int | None = Field(
        None, ge=1, description="New tokens per turn (null: rollout.max_tokens)."
    )

    _prompts_path = field_validator("prompts", mode="before")(path_shorthand)

    @model_validator(mode="after")
    def _k_within_samples(self) -> EvalSection:
        too_big = [k for k in self.pass_k if not 1 <= k <= self.samples]
        if too_big:
            raise ValueError(
                f"pass_k {too_big} outside 1..samples ({self.samples}): pass@k needs k "
                "samples per prompt; raise eval.samples"
            )
        return self

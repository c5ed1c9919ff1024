"""`Recipe`: one experiment, as a typed tree of sections that keeps its cross-field rules."""

from __future__ import annotations

from pydantic import ValidationInfo, model_validator

from mtprun.spec.rules import SPEC_RULES
from mtprun.spec.sections import RecipeSections

SKIP_RULES = "mtprun.skip_rules"
"""Validation-context flag: the loader checks the cross-field rules itself, with locations."""


class Recipe(RecipeSections):
    """One experiment: model, data or task, fused loss terms, mask, parallelism, rollouts,
    optimisation, tracking and resources."""

    @model_validator(mode="after")
    def _cross_field_rules(self, info: ValidationInfo) -> Recipe:
        if info.context and info.context.get(SKIP_RULES):
            return self
        errors = [i for i in SPEC_RULES.check(self) if i.severity == "error"]
        if errors:
            raise ValueError("; ".join(f"{i.dotted_path}: {i.message}" for i in errors))
        return self

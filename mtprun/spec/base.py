"""Shared base of every recipe section."""

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """A recipe section: unknown keys are errors and a loaded recipe never changes."""

    model_config = ConfigDict(extra="forbid", frozen=True)

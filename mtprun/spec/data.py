"""`data:` (SFT), `task:` (RL) and `warmstart:` (an SFT stage before RL)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from mtprun.spec.base import Section

Template = Literal["char", "chatml", "glm"]


class DataSection(Section):
    """Supervised fine-tuning data."""

    source: str = Field(
        ...,
        description="A `.jsonl` file of conversations (relative to the recipe file that sets "
        "it) or the name of a built-in synthetic task such as `arithmetic`.",
    )
    template: Template = Field(
        "char",
        description="Chat template: char (the tiny character-level one), chatml (Qwen style) "
        "or glm (GLM style, the stop token is the next message's opening tag).",
    )
    packing_length: int = Field(
        512, ge=1, description="Tokens per packed row; conversations are packed back to back."
    )
    num_samples: int = Field(
        2048, ge=1, description="Examples drawn from a synthetic source (ignored for files)."
    )


class TaskSection(Section):
    """Reinforcement learning: prompts, a verifiable reward and the sampling shape."""

    name: str = Field(
        ...,
        description="A built-in synthetic task (arithmetic, calculator_tool) or a `.jsonl` "
        "file of prompts (relative to the recipe file that sets it).",
    )
    reward: str = Field(..., description="Registered reward function name.")
    template: Template = Field("char", description="Chat template used to render prompts.")
    samples_per_prompt: int = Field(8, ge=1, description="Rollouts per prompt (the GRPO group).")
    prompts_per_step: int = Field(8, ge=1, description="Prompts per optimizer step.")
    max_turns: int = Field(
        1,
        ge=1,
        description="Assistant turns per rollout; above 1 the environment answers "
        "between turns (multi-turn tool use).",
    )
    environment: str | None = Field(
        None,
        description="The environment of multi-turn episodes: a class named `package.module:Class` "
        "or `path/to/file.py:Class` (relative to the recipe file that sets it), with "
        "reset(prompt) -> messages and step(messages) -> EnvStep (mtprun.data.environment). "
        "null: the task's own (calculator_tool runs its calculator; other tasks end after one "
        "turn).",
    )
    drop_uniform_groups: bool = Field(
        False,
        description="DAPO dynamic sampling: drop groups whose rewards are all equal (their "
        "advantages are 0) and sample more prompts until prompts_per_step groups remain, in "
        "at most max_sampling_rounds rounds.",
    )
    max_sampling_rounds: int = Field(
        4,
        ge=1,
        description="With drop_uniform_groups, the most rounds of sampling per step; a step "
        "still short of groups trains on those it kept (or, when none, on its first round).",
    )


class WarmstartSection(Section):
    """An SFT stage run first, in the same run, before RL starts."""

    data: DataSection = Field(..., description="SFT data of the warm-start stage.")
    steps: int = Field(..., ge=1, description="Optimizer steps of the warm-start stage.")
    lr: float = Field(..., gt=0, description="Learning rate of the warm-start stage.")

"""A reward model the run serves on a vLLM engine: `{type: served, model: <HF folder>, kind:
classifier | judge}` (untagged: a mapping with `kind`).

Fulfils mtprun.spec.sources.RewardSource: preflight reads its folder (config.json's
architecture and labels, a chat template) and a judge's template and parse function; it runs
on a Ray actor beside the rollout engines (one per model folder and kind: the rewards of
task.rewards that serve the same folder with the same kind share it, mtprun.runner.rollout.
scorers) and scores a step's episodes in one batched call.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, field_validator, model_validator

from mtprun.sources.scoring import OnActor
from mtprun.spec.base import Section
from mtprun.spec.reward_fields import (
    DEFAULT_PARSE,
    PARSE_DESCRIPTION,
    Weighted,
    check_parse,
    is_parse_function,
)

if TYPE_CHECKING:
    from mtprun.spec.sources import Problems

NAME = "served"
ServedKind = Literal["classifier", "judge"]
CLASSIFIER_SUFFIX = "ForSequenceClassification"


class ServedReward(Section):
    """A reward model the run serves on a vLLM engine (a Ray actor beside the rollout engines,
    shared by the rewards that serve the same folder with the same kind): a sequence
    classifier scoring each episode, or a generative judge."""

    type: Literal["served"] = Field(
        "served", description="A reward model the run serves (inferred from `kind`)."
    )
    model: str = Field(
        ...,
        description="An HF model folder (relative to the recipe file that sets it). classifier: "
        "a `*ForSequenceClassification` checkpoint; judge: a causal LM with a chat template.",
    )
    kind: ServedKind = Field(
        ...,
        description="classifier: the episode's conversation, rendered with the model's own "
        "chat template, scored by its classification head (one label: that logit; several: "
        "the logit of `score_label`). judge: the model writes a reply to `prompt`, and "
        "`parse` reads the score out of it.",
    )
    score_label: int | None = Field(
        None,
        ge=0,
        description="classifier with several labels (num_labels > 1): the label whose raw "
        "logit is the score; null: the model must have one label.",
    )
    prompt: str | None = Field(
        None,
        description="judge: a text file (relative to the recipe file that sets it), the "
        "judge's user message, with the fields of an endpoint judge's template: {question}, "
        "{completion}, {answer}, {reasoning}, {prompt[<column>]}.",
    )
    parse: str = Field(DEFAULT_PARSE, description="judge: " + PARSE_DESCRIPTION)
    temperature: float = Field(0.0, ge=0, description="judge: sampling temperature.")
    max_tokens: int = Field(256, ge=1, description="judge: tokens the judge may write.")

    _parse = field_validator("parse")(check_parse)

    @model_validator(mode="after")
    def _fields_of_its_kind(self) -> ServedReward:
        if self.kind == "judge":
            if self.prompt is None:
                raise ValueError("a judge (kind: judge) needs `prompt: <template file>`")
            if self.score_label is not None:
                raise ValueError("score_label is a classifier's field (kind: classifier)")
        else:
            judge_only = {"prompt", "parse", "temperature", "max_tokens"} & self.model_fields_set
            if judge_only:
                raise ValueError(
                    f"{', '.join(sorted(judge_only))}: a judge's field(s); a classifier "
                    "(kind: classifier) scores with its classification head"
                )
        return self


class ServedRewardTerm(ServedReward, Weighted):
    """A served reward model of task.rewards, weighted."""

    @property
    def label(self) -> str:
        return self.name or label(self)

    @property
    def spec(self) -> ServedReward:
        return ServedReward(
            **self.model_dump(exclude={"weight", "name"}, exclude_unset=True),
        )

    @property
    def spec_path(self) -> tuple[str, ...]:
        return ()


CONFIG = ServedReward
TERM = ServedRewardTerm


def infer(value: Any) -> bool:
    return isinstance(value, dict) and "kind" in value


def label(spec: ServedReward) -> str:
    return "reward_model" if spec.kind == "classifier" else "judge"


def describe(spec: ServedReward) -> str:
    return f"{'reward model' if spec.kind == 'classifier' else 'judge'} {spec.model}"


def actors(spec: ServedReward) -> int:
    return 1


def scoring(spec: ServedReward) -> OnActor:
    return OnActor(spec, describe(spec))


def read_config(spec: ServedReward) -> tuple[dict[str, Any] | None, str | None]:
    """The folder's config.json, or why there is none."""
    folder = Path(spec.model)
    if not folder.is_dir():
        return None, f"reward model folder not found: {folder}"
    path = folder / "config.json"
    try:
        return json.loads(path.read_text(encoding="utf-8")), None
    except OSError:
        return None, f"{path}: no config.json; is {folder} an HF model folder?"
    except ValueError as err:
        return None, f"{path} is not JSON: {err}"


def labels(config: dict[str, Any]) -> int:
    """The classifier's label count, as transformers reads it."""
    return int(config.get("num_labels") or len(config.get("id2label") or {}) or 2)


def check(spec: ServedReward) -> Problems:
    """Its folder, its config's architecture and labels, a judge's template and parse."""
    from mtprun.data.rewards.endpoint import parse_problem, template_problem

    config, problem = read_config(spec)
    if problem is not None:
        yield ("model",), problem
    elif config is not None:
        yield from _config_problems(spec, config)
        if not _has_chat_template(Path(spec.model)):
            yield ("model",), f"{spec.model} has no chat template to render the conversation with"
    if spec.kind == "judge":
        assert spec.prompt is not None  # the spec requires it
        problem = template_problem(spec.prompt)
        if problem is not None:
            yield ("prompt",), problem
        if is_parse_function(spec.parse) and (problem := parse_problem(spec.parse)):
            yield ("parse",), problem


def _config_problems(spec: ServedReward, config: dict[str, Any]) -> Problems:
    archs = config.get("architectures") or []
    classifier = any(a.endswith(CLASSIFIER_SUFFIX) for a in archs)
    path = Path(spec.model) / "config.json"
    if spec.kind == "classifier" and not classifier:
        yield (
            ("model",),
            (
                f"{path}: architectures {archs} is not a *{CLASSIFIER_SUFFIX} checkpoint: a "
                "classifier reward model scores with a sequence-classification head (for a "
                "causal LM that writes its verdict, use kind: judge)"
            ),
        )
    elif spec.kind == "judge" and classifier:
        yield (
            ("kind",),
            (
                f"{path}: architectures {archs} is a sequence classifier, which writes no "
                "text: use kind: classifier"
            ),
        )
    elif spec.kind == "classifier":
        count = labels(config)
        if spec.score_label is None and count != 1:
            yield (
                ("model",),
                (
                    f"{path}: the classifier has {count} labels; set score_label to the "
                    "label whose logit is the reward"
                ),
            )
        elif spec.score_label is not None and spec.score_label >= count:
            yield (
                ("score_label",),
                (
                    f"score_label {spec.score_label} but {path} has {count} labels "
                    f"(0 to {count - 1})"
                ),
            )


def _has_chat_template(folder: Path) -> bool:
    if (folder / "chat_template.jinja").is_file() or (folder / "chat_template.json").is_file():
        return True
    try:
        config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return bool(config.get("chat_template"))

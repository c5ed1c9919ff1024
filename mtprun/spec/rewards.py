"""What scores a task's episodes: `task.reward` (one reward) or `task.rewards` (several, by
weight).

A reward is a built-in's name or a Python function (`package.module:function`,
`path/to/file.py:function`), an LLM judge behind an OpenAI-compatible endpoint
(`{url, model, prompt, parse}`), or a model the run serves itself on a vLLM engine of its own
(`{model: <HF folder>, kind: classifier | judge}`). Each entry of `task.rewards` is one of
those with a `weight` and a `name` (its metric: `reward/<name>`).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, field_validator, model_validator

from mtprun.spec.base import Section

RESERVED_REWARD_NAMES = ("mean", "std", "errors", "total")
"""`reward/<name>` metrics mtprun logs itself (and the combined reward's `total`)."""
METRIC_NAME = re.compile(r"[A-Za-z0-9_.-]+")
DEFAULT_PARSE = r"(-?\d+(?:\.\d+)?)"
PARSE_FUNCTION = re.compile(
    r"[^\s:]+\.py:[A-Za-z_]\w*|[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+:[A-Za-z_]\w*"
)
"""A `parse` value naming a function (`package.module:function`, `path/to/file.py:function`)
rather than a regular expression."""
PARSE_DESCRIPTION = (
    "How the judge's reply becomes the score: a regular expression whose first match gives it "
    "(its first group, or the whole match without groups, read as a number), or a function "
    "`package.module:function` / `path/to/file.py:function` taking the reply (str) and "
    "returning a float. A reply without a match, or one the function raises on, counts in "
    "reward/errors."
)


def is_parse_function(parse: str) -> bool:
    """Whether `parse` names a function rather than being a regular expression."""
    return PARSE_FUNCTION.fullmatch(parse) is not None


def _check_parse(value: str) -> str:
    if is_parse_function(value):
        return value
    try:
        re.compile(value)
    except re.error as err:
        raise ValueError(
            f"parse {value!r} is not a regular expression ({err}) nor a function reference "
            "(`package.module:function` or `path/to/file.py:function`)"
        ) from None
    return value


class EndpointReward(Section):
    """An LLM judge behind an OpenAI-compatible endpoint: one chat completion per episode."""

    url: str = Field(
        ...,
        description="Base URL of an OpenAI-compatible API (`http://host:8000/v1`); mtprun POSTs "
        "to <url>/chat/completions.",
    )
    model: str = Field(..., description="The `model` of each request.")
    prompt: str = Field(
        ...,
        description="A text file (relative to the recipe file that sets it): the judge's user "
        "message, a Python format string with fields {question} (the prompt's last user "
        "message), {completion} (the answer, reasoning left out), {answer} (the reference, '' "
        "without one), {reasoning} and {prompt[<column>]} (a column of the prompt's record); "
        "write {{ and }} for literal braces.",
    )
    parse: str = Field(DEFAULT_PARSE, description=PARSE_DESCRIPTION)
    concurrency: int = Field(8, ge=1, description="Requests in flight at once, at most.")
    retries: int = Field(
        2,
        ge=0,
        description="Retries of a request that failed to connect, timed out or got a 429 or "
        "5xx answer (backing off), within task.reward_timeout_s per episode.",
    )
    temperature: float = Field(0.0, ge=0, description="Sampling temperature of the judge.")
    max_tokens: int = Field(512, ge=1, description="Tokens the judge may write.")
    api_key_env: str | None = Field(
        None,
        description="An environment variable holding the API key (sent as a Bearer token); "
        "null: no key.",
    )

    @field_validator("url")
    @classmethod
    def _http(cls, value: str) -> str:
        if not value.startswith(("http://", "https://")):
            raise ValueError(f"url {value!r} is not an http:// or https:// URL")
        return value

    _parse = field_validator("parse")(_check_parse)


ServedKind = Literal["classifier", "judge"]


class ServedReward(Section):
    """A reward model the run serves on a vLLM engine of its own (a Ray actor beside the
    rollout engines): a sequence classifier scoring each episode, or a generative judge."""

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

    _parse = field_validator("parse")(_check_parse)

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


def _reward_shape(value: Any) -> str:
    # A mapping with `kind` is a served reward model, another mapping an endpoint judge;
    # anything else must be a reward's name or reference.
    if isinstance(value, dict):
        return "served" if "kind" in value else "endpoint"
    return "named"


RewardSpec = Annotated[
    Annotated[str, Tag("named")]
    | Annotated[EndpointReward, Tag("endpoint")]
    | Annotated[ServedReward, Tag("served")],
    Discriminator(_reward_shape),
]
"""One reward: a built-in's name, `package.module:function`, `path/to/file.py:function`, an
endpoint judge {url, model, prompt, parse, ...}, or a served reward model {model, kind, ...}."""


class _Weighted(Section):
    weight: float = Field(1.0, description="Its weight in the episode's reward (the weighted sum).")
    name: str | None = Field(
        None,
        description="Its metric, `reward/<name>` (null: the function's name, `judge` for an "
        "endpoint or a served judge, `reward_model` for a classifier); names are unique within "
        "task.rewards.",
    )

    @field_validator("name")
    @classmethod
    def _metric_name(cls, value: str | None) -> str | None:
        if value is None:
            return value
        if not METRIC_NAME.fullmatch(value):
            raise ValueError(f"name {value!r} is not a metric name: use letters, digits, _ - .")
        if value in RESERVED_REWARD_NAMES:
            raise ValueError(
                f"name {value!r} is reserved (mtprun logs reward/{value} itself); rename it"
            )
        return value


class FunctionRewardTerm(_Weighted):
    """A rule reward of task.rewards: a built-in or a Python function, weighted."""

    reward: str = Field(
        ...,
        description="A built-in reward (exact_answer, math, reasoning_gym, ...) or "
        "`package.module:function` / `path/to/file.py:function`.",
    )

    @property
    def label(self) -> str:
        return self.name or self.reward.rpartition(":")[2]

    @property
    def spec(self) -> str:
        return self.reward


class EndpointRewardTerm(EndpointReward, _Weighted):
    """An endpoint judge of task.rewards, weighted."""

    @property
    def label(self) -> str:
        return self.name or "judge"

    @property
    def spec(self) -> EndpointReward:
        return EndpointReward(**self.model_dump(exclude={"weight", "name"}))


class ServedRewardTerm(ServedReward, _Weighted):
    """A served reward model of task.rewards, weighted."""

    @property
    def label(self) -> str:
        return self.name or ("reward_model" if self.kind == "classifier" else "judge")

    @property
    def spec(self) -> ServedReward:
        return ServedReward(
            **self.model_dump(exclude={"weight", "name"}, exclude_unset=True),
        )


def _term_shape(value: Any) -> str:
    if isinstance(value, dict) and "kind" in value:
        return "served"
    return "endpoint" if isinstance(value, dict) and "url" in value else "function"


RewardTerm = Annotated[
    Annotated[FunctionRewardTerm, Tag("function")]
    | Annotated[EndpointRewardTerm, Tag("endpoint")]
    | Annotated[ServedRewardTerm, Tag("served")],
    Discriminator(_term_shape),
]
"""One entry of task.rewards: {reward: <name or reference>, weight, name}, an endpoint judge
{url, model, prompt, parse, ..., weight, name} or a served reward model {model, kind, ...,
weight, name}."""

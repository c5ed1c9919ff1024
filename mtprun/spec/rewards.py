"""What scores a task's episodes: `task.reward` (one reward) or `task.rewards` (several, by
weight).

A reward is a built-in's name or a Python function (`package.module:function`,
`path/to/file.py:function`), or an LLM judge behind an OpenAI-compatible endpoint
(`{url, model, prompt, parse}`). Each entry of `task.rewards` is one of those with a `weight`
and a `name` (its metric: `reward/<name>`).
"""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import Discriminator, Field, Tag, field_validator

from mtprun.spec.base import Section

RESERVED_REWARD_NAMES = ("mean", "std", "errors", "total")
"""`reward/<name>` metrics mtprun logs itself (and the combined reward's `total`)."""
METRIC_NAME = re.compile(r"[A-Za-z0-9_.-]+")
DEFAULT_PARSE = r"(-?\d+(?:\.\d+)?)"


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
    parse: str = Field(
        DEFAULT_PARSE,
        description="A regular expression whose first match in the judge's reply gives the "
        "score: its first group (or the whole match without groups), read as a number. A reply "
        "without a match counts in reward/errors.",
    )
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

    @field_validator("parse")
    @classmethod
    def _regex(cls, value: str) -> str:
        try:
            re.compile(value)
        except re.error as err:
            raise ValueError(f"parse {value!r} is not a regular expression: {err}") from None
        return value


def _reward_shape(value: Any) -> str:
    # A mapping is an endpoint judge; anything else must be a reward's name or reference.
    return "endpoint" if isinstance(value, dict) else "named"


RewardSpec = Annotated[
    Annotated[str, Tag("named")] | Annotated[EndpointReward, Tag("endpoint")],
    Discriminator(_reward_shape),
]
"""One reward: a built-in's name, `package.module:function`, `path/to/file.py:function`, or
an endpoint judge {url, model, prompt, parse, ...}."""


class _Weighted(Section):
    weight: float = Field(1.0, description="Its weight in the episode's reward (the weighted sum).")
    name: str | None = Field(
        None,
        description="Its metric, `reward/<name>` (null: the function's name, or `judge` for an "
        "endpoint); names are unique within task.rewards.",
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


def _term_shape(value: Any) -> str:
    return "endpoint" if isinstance(value, dict) and "url" in value else "function"


RewardTerm = Annotated[
    Annotated[FunctionRewardTerm, Tag("function")] | Annotated[EndpointRewardTerm, Tag("endpoint")],
    Discriminator(_term_shape),
]
"""One entry of task.rewards: {reward: <name or reference>, weight, name} or an endpoint
judge {url, model, prompt, parse, ..., weight, name}."""

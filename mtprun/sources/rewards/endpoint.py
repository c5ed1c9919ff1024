"""An LLM judge behind an OpenAI-compatible endpoint: `{type: endpoint, url, model, prompt,
parse}` (untagged: a mapping with `url`), one chat completion per episode.

Fulfils mtprun.spec.sources.RewardSource: preflight reads its prompt template and imports a
`parse` function; it scores from a pool of threads (mtprun.data.rewards.endpoint.EndpointJudge).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, field_validator

from mtprun.sources.scoring import InThreads
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

NAME = "endpoint"


class EndpointReward(Section):
    """An LLM judge behind an OpenAI-compatible endpoint: one chat completion per episode."""

    type: Literal["endpoint"] = Field(
        "endpoint", description="An LLM judge behind an endpoint (inferred from `url`)."
    )
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

    _parse = field_validator("parse")(check_parse)


class EndpointRewardTerm(EndpointReward, Weighted):
    """An endpoint judge of task.rewards, weighted."""

    @property
    def label(self) -> str:
        return self.name or label(self)

    @property
    def spec(self) -> EndpointReward:
        return EndpointReward(**self.model_dump(exclude={"weight", "name"}))

    @property
    def spec_path(self) -> tuple[str, ...]:
        return ()


CONFIG = EndpointReward
TERM = EndpointRewardTerm


def infer(value: Any) -> bool:
    return isinstance(value, dict) and "url" in value and "kind" not in value


def label(spec: EndpointReward) -> str:
    return "judge"


def describe(spec: EndpointReward) -> str:
    return f"judge {spec.model} at {spec.url}"


def actors(spec: EndpointReward) -> int:
    return 0


def check(spec: EndpointReward) -> Problems:
    from mtprun.data.rewards.endpoint import parse_problem, template_problem

    problem = template_problem(spec.prompt)
    if problem is not None:
        yield ("prompt",), problem
    if is_parse_function(spec.parse) and (problem := parse_problem(spec.parse)):
        yield ("parse",), problem


def scoring(spec: EndpointReward) -> InThreads:
    return InThreads(functools.partial(_judge, spec), spec.concurrency, describe(spec))


def _judge(spec: EndpointReward) -> Any:
    from mtprun.data.rewards.endpoint import EndpointJudge

    return EndpointJudge(spec)

"""Fields the reward sources share (mtprun/sources/rewards/): a judge's `parse`, and the
`weight` and `name` of an entry of task.rewards."""

from __future__ import annotations

import re

from pydantic import Field, field_validator

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


def check_parse(value: str) -> str:
    """A `parse` is a function reference or a regular expression (a field validator)."""
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


class Weighted(Section):
    """The fields an entry of task.rewards adds to its reward's."""

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

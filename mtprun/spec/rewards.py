"""What scores a task's episodes: `task.reward` (one reward) or `task.rewards` (several, by
weight).

A reward is a built-in's name or a Python function (`package.module:function`,
`path/to/file.py:function`), an LLM judge behind an OpenAI-compatible endpoint
(`{type: endpoint, url, model, prompt, parse}`), or a model the run serves itself on a vLLM
engine (`{type: served, model: <HF folder>, kind: classifier | judge}`; one engine per folder and
kind, shared by the rewards that serve it); an untagged
mapping's `type` is inferred from its fields (`url`: endpoint, `kind`: served). Each entry of
`task.rewards` is one of those with a `weight` and a `name` (its metric: `reward/<name>`).

Each kind is a reward source, one unit module under mtprun/sources/rewards/; the unions and
the dispatch are mtprun.spec.sources'. The names below are the units' configs, for the code
that builds them.
"""

from __future__ import annotations

from mtprun.spec.reward_fields import (
    DEFAULT_PARSE,
    METRIC_NAME,
    PARSE_DESCRIPTION,
    PARSE_FUNCTION,
    RESERVED_REWARD_NAMES,
    is_parse_function,
)
from mtprun.spec.sources import REWARD_SOURCES, RewardSpec, RewardTerm, reward_source

EndpointReward = REWARD_SOURCES["endpoint"].CONFIG
EndpointRewardTerm = REWARD_SOURCES["endpoint"].TERM
ServedReward = REWARD_SOURCES["served"].CONFIG
ServedRewardTerm = REWARD_SOURCES["served"].TERM
FunctionRewardTerm = REWARD_SOURCES["function"].TERM

__all__ = [
    "DEFAULT_PARSE",
    "METRIC_NAME",
    "PARSE_DESCRIPTION",
    "PARSE_FUNCTION",
    "RESERVED_REWARD_NAMES",
    "EndpointReward",
    "EndpointRewardTerm",
    "FunctionRewardTerm",
    "RewardSpec",
    "RewardTerm",
    "ServedReward",
    "ServedRewardTerm",
    "is_parse_function",
    "reward_source",
]

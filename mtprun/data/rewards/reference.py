"""A recipe's `task.reward`: a built-in name, or a function of the user's named by reference
(`package.module:function` or `path/to/file.py:function`, imported by mtprun.data.references).

References are imported where they run: by `mtprun validate` (to check them) and by each
reward worker process.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from mtprun.data.references import UnresolvedReference, load_reference, split_reference
from mtprun.data.rewards.call import REWARD_ARGUMENTS
from mtprun.data.rewards.registry import REWARDS
from mtprun.spec.errors import did_you_mean


class RewardReferenceError(UnresolvedReference):
    """A `task.reward` that names no usable reward function; the message says why."""


def is_reference(name: str) -> bool:
    """Whether `name` points at Python code (`target:function`) rather than a built-in."""
    return ":" in name


def load_reward(name: str) -> Callable[..., Any]:
    """The reward function `name` names, with its signature checked; raises
    UnresolvedReference (RewardReferenceError for an unknown built-in or a bad signature)."""
    if not is_reference(name):
        if name not in REWARDS:
            raise RewardReferenceError(_unknown_builtin(name))
        return REWARDS[name]
    fn = load_reference(name)
    check_signature(fn, split_reference(name)[1])
    return fn


def reward_problem(name: str) -> str | None:
    """What is wrong with reward `name` (importing it), or None when it is usable."""
    try:
        load_reward(name)
    except UnresolvedReference as err:
        return str(err)
    return None


def check_signature(fn: Any, label: str) -> None:
    """A reward takes its arguments by name, only ones mtprun passes."""
    if not callable(fn):
        raise RewardReferenceError(f"{label} is a {type(fn).__name__}, not a function")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError) as err:
        raise RewardReferenceError(f"cannot read the signature of {label}: {err}") from None
    allowed = ", ".join(REWARD_ARGUMENTS)
    for parameter in signature.parameters.values():
        if parameter.kind is parameter.POSITIONAL_ONLY:
            raise RewardReferenceError(
                f"reward {label}{signature}: parameter {parameter.name!r} is positional-only; "
                f"mtprun passes arguments by name ({allowed})"
            )
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            continue
        if parameter.name not in REWARD_ARGUMENTS and parameter.default is parameter.empty:
            raise RewardReferenceError(
                f"reward {label}{signature} takes {parameter.name!r}, which mtprun does not "
                f"pass; a reward takes any of {allowed} by name (or **kwargs)"
            )


def _unknown_builtin(name: str) -> str:
    return (
        f"unknown reward {name!r}{did_you_mean(name, REWARDS)}; built-in: "
        f"{', '.join(REWARDS)}; or a function of yours: `package.module:function` or "
        "`path/to/file.py:function`"
    )

"""A recipe's `task.reward`: a built-in name, `package.module:function` or `file.py:function`.

References are imported where they run: by `mtprun validate` (to check them) and by each
reward worker process. A file is imported as a module of its own, with its folder put on
`sys.path` so that it can import its neighbours.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mtprun.data.rewards.call import REWARD_ARGUMENTS
from mtprun.data.rewards.registry import REWARDS
from mtprun.spec.errors import did_you_mean


class RewardReferenceError(ValueError):
    """A `task.reward` that names no usable reward function; the message says why."""


def is_reference(name: str) -> bool:
    """Whether `name` points at Python code (`target:function`) rather than a built-in."""
    return ":" in name


def split_reference(name: str) -> tuple[str, str]:
    """(module or file, function) of a reference."""
    target, _, function = name.rpartition(":")
    return target, function


def load_reward(name: str) -> Callable[..., Any]:
    """The reward function `name` names, with its signature checked; raises
    RewardReferenceError."""
    if not is_reference(name):
        if name not in REWARDS:
            raise RewardReferenceError(_unknown_builtin(name))
        return REWARDS[name]
    target, function = split_reference(name)
    if not target or not function:
        raise RewardReferenceError(
            f"reward reference {name!r} needs both parts: `package.module:function` or "
            "`path/to/file.py:function`"
        )
    module = _import_file(Path(target)) if target.endswith(".py") else _import_module(target)
    fn = getattr(module, function, None)
    if fn is None:
        defined = [n for n, v in vars(module).items() if inspect.isfunction(v) and n[0] != "_"]
        hint = did_you_mean(function, defined)
        listing = f"; it defines {', '.join(defined)}" if defined else ""
        raise RewardReferenceError(
            f"{_described(target)} has no function {function!r}{hint}{listing}"
        )
    check_signature(fn, function)
    return fn


def reward_problem(name: str) -> str | None:
    """What is wrong with reward `name` (importing it), or None when it is usable."""
    try:
        load_reward(name)
    except RewardReferenceError as err:
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


def _import_module(target: str) -> Any:
    try:
        return importlib.import_module(target)
    except ModuleNotFoundError as err:
        if err.name is not None and target.startswith(err.name):
            raise RewardReferenceError(
                f"cannot import module {target!r}: no module named {err.name!r} on the Python "
                "path (use `path/to/file.py:function` for a file next to the recipe)"
            ) from None
        raise RewardReferenceError(_import_failure(target, err)) from None
    except Exception as err:
        raise RewardReferenceError(_import_failure(target, err)) from None


def _import_file(path: Path) -> Any:
    if not path.is_file():
        raise RewardReferenceError(f"reward file not found: {path}")
    path = path.resolve()
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:10]
    name = f"mtprun_reward_{path.stem}_{digest}"
    if name in sys.modules:
        return sys.modules[name]
    folder = str(path.parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # before running it: dataclasses and pickling look it up
    try:
        spec.loader.exec_module(module)
    except BaseException as err:
        del sys.modules[name]
        if not isinstance(err, Exception):
            raise
        raise RewardReferenceError(_import_failure(str(path), err)) from None
    return module


def _import_failure(target: str, err: Exception) -> str:
    # The innermost frame in user code says where the import broke.
    frames = [f for f in traceback.extract_tb(err.__traceback__) if "importlib" not in f.filename]
    where = f" ({frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    return f"importing {target} failed{where}: {type(err).__name__}: {err}"


def _described(target: str) -> str:
    return f"reward file {target}" if target.endswith(".py") else f"module {target!r}"


def _unknown_builtin(name: str) -> str:
    return (
        f"unknown reward {name!r}{did_you_mean(name, REWARDS)}; built-in: "
        f"{', '.join(REWARDS)}; or a function of yours: `package.module:function` or "
        "`path/to/file.py:function`"
    )

"""Python references in recipes: `package.module:Name` or `path/to/file.py:Name`.

A recipe names user code (task.environment's class, task.reward's function) by reference; the
loader has already made a file path absolute against the recipe that wrote it. A file is
imported once per process under a module name derived from its path, so validating a recipe
and running it import the same module object; its folder goes on `sys.path` first, so that it
can import its neighbours.
"""

from __future__ import annotations

import difflib
import hashlib
import importlib
import importlib.util
import os
import sys
import traceback
from types import ModuleType
from typing import Any

REFERENCE_FORMS = (
    "`package.module:Name` (importable) or `path/to/file.py:Name` (relative to the recipe)"
)


class UnresolvedReference(ValueError):
    """A reference that does not name an importable object; the message says why."""


def split_reference(reference: str) -> tuple[str, str]:
    """(module or file, attribute name) of `reference`."""
    target, sep, name = reference.rpartition(":")
    if not sep or not target or not name.isidentifier():
        raise UnresolvedReference(
            f"{reference!r} is not a Python reference: write {REFERENCE_FORMS}"
        )
    return target, name


def load_reference(reference: str) -> Any:
    """The object `reference` names; UnresolvedReference when the module or the name is missing,
    or the module fails to import (its own error is in the message)."""
    target, name = split_reference(reference)
    module = import_target(target)
    try:
        return getattr(module, name)
    except AttributeError:
        public = [n for n in vars(module) if not n.startswith("_")]
        close = difflib.get_close_matches(name, public, n=1, cutoff=0.6)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise UnresolvedReference(f"{target} has no attribute {name!r}{hint}") from None


def import_target(target: str) -> ModuleType:
    """The module a reference's first part names: a `.py` file or a dotted module name;
    UnresolvedReference as `load_reference` raises it."""
    return _import_file(target) if target.endswith(".py") else _import_module(target)


def _import_module(dotted: str) -> ModuleType:
    try:
        return importlib.import_module(dotted)
    except ModuleNotFoundError as err:
        if err.name is not None and dotted.startswith(err.name):
            raise UnresolvedReference(
                f"no module named {dotted!r}: write {REFERENCE_FORMS}, with the module on "
                "PYTHONPATH"
            ) from None
        raise UnresolvedReference(f"module {dotted!r} failed to import: {_describe(err)}") from err
    except Exception as err:
        raise UnresolvedReference(f"module {dotted!r} failed to import: {_describe(err)}") from err


def _import_file(path: str) -> ModuleType:
    path = os.path.abspath(path)
    if not os.path.isfile(path):
        raise UnresolvedReference(f"file not found: {path}")
    digest = hashlib.sha1(path.encode()).hexdigest()[:12]
    module_name = f"mtprun_user_{os.path.splitext(os.path.basename(path))[0]}_{digest}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise UnresolvedReference(f"cannot import {path} as a Python module")
    folder = os.path.dirname(path)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    module = importlib.util.module_from_spec(spec)
    # Registered before it runs, as `import` does: dataclasses and pickling look it up.
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as err:
        del sys.modules[module_name]
        raise UnresolvedReference(f"{path} failed to import: {_describe(err)}") from err
    return module


def _describe(err: BaseException) -> str:
    if isinstance(err, SyntaxError):
        return f"SyntaxError: {err.msg} (line {err.lineno})"
    # The innermost frame in the user's code says where the import broke.
    frames = [
        f
        for f in traceback.extract_tb(err.__traceback__)
        if "importlib" not in f.filename and f.filename != __file__
    ]
    where = f" ({frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    return f"{type(err).__name__}: {err}{where}"

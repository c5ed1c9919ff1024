"""Every extension point (`mtprun.units.Units`) and every unit registered on it.

The points are found, not listed: every module of the package whose source calls
`register_point` is imported, and `mtprun.units.REGISTRIES` then holds them all. Per point:
each unit satisfies the contract (every member present, the methods callable), names are
unique, and where the units are the modules of one folder, every module of that folder that
looks like a unit (defines the contract's first member) is registered, so none is forgotten.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import types
from pathlib import Path
from typing import Any, Union, get_args, get_origin, get_type_hints

import pytest

import mtprun
from mtprun.units import REGISTRIES, Units, _protocol_attrs

PACKAGE = Path(mtprun.__file__).parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _calls_register_point(path: Path) -> bool:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return any(
        isinstance(node, ast.Call)
        and (
            (isinstance(node.func, ast.Name) and node.func.id == "register_point")
            or (isinstance(node.func, ast.Attribute) and node.func.attr == "register_point")
        )
        for node in ast.walk(tree)
    )


REGISTRY_MODULES = sorted(
    _module_name(path)
    for path in PACKAGE.rglob("*.py")
    if path.name != "units.py" and _calls_register_point(path)
)

for _module in REGISTRY_MODULES:
    importlib.import_module(_module)

POINTS: dict[str, Units] = {}
for _units in REGISTRIES:
    assert _units.point not in POINTS, f"two extension points are named {_units.point!r}"
    POINTS[_units.point] = _units


def test_the_known_points_are_found() -> None:
    assert {"mtprun.losses.registry", "mtprun.cli"} <= set(REGISTRY_MODULES)
    assert {"loss kind", "command"} <= POINTS.keys()


@pytest.mark.parametrize("point", sorted(POINTS))
def test_units_satisfy_their_contract(point: str) -> None:
    units = POINTS[point]
    contract = units.contract
    members = _protocol_attrs(contract)
    assert members, f"{point}: its contract {contract.__name__} names no member"
    methods = {name for name in members if inspect.isfunction(getattr(contract, name, None))}
    assert len(set(units.modules)) == len(units.modules), f"{point}: a module is listed twice"
    loaded = units.units  # imports every unit; raises UnitError for a missing member
    assert len(loaded) == len(units.modules)
    for module in loaded:
        assert isinstance(module, contract)
        missing = sorted(name for name in members if not hasattr(module, name))
        assert missing == [], f"{module.__name__} lacks {missing}"
        uncallable = sorted(name for name in methods if not callable(getattr(module, name)))
        assert uncallable == [], f"{module.__name__}: {uncallable} are not callable"
        for name in sorted(methods):
            _assert_accepts(getattr(module, name), getattr(contract, name), module.__name__)
        for name, hint in _data_hints(contract).items():
            value = getattr(module, name)
            assert _fits(value, hint), f"{module.__name__}.{name} = {value!r} is not a {hint}"
    names = [units._name(module) for module in loaded]
    assert all(isinstance(name, str) and name for name in names), names
    assert len(set(names)) == len(names), f"{point}: two units share a name: {names}"
    assert units.names() == tuple(names)


def _assert_accepts(function: object, declared: object, unit: str) -> None:
    """`function` takes the arguments the contract's method declares (after self)."""
    params = list(inspect.signature(declared).parameters.values())[1:]
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    args = [object() for p in params if p.kind in positional]
    kwargs = {p.name: object() for p in params if p.kind == inspect.Parameter.KEYWORD_ONLY}
    try:
        inspect.signature(function).bind(*args, **kwargs)
    except TypeError as err:
        name = getattr(function, "__name__", function)
        raise AssertionError(
            f"{unit}.{name} does not take {inspect.signature(declared)}: {err}"
        ) from None


def _data_hints(contract: type) -> dict[str, object]:
    """The contract's data members and their types (those that resolve at run time)."""
    declared = vars(contract).get("__annotations__", {})
    try:
        hints = get_type_hints(contract)
    except NameError:  # a hint naming a type-checking-only import: members are checked alone
        return {}
    return {name: hints[name] for name in declared if name in hints}


def _fits(value: object, hint: object) -> bool:
    """Whether `value` is of `hint`, for the hints contracts use (a class, `X | None`,
    `type[X]`, a parametrised container by its origin); anything else passes."""
    if hint is Any:
        return True
    origin, args = get_origin(hint), get_args(hint)
    if origin in (Union, types.UnionType):
        return any(_fits(value, arg) for arg in args)
    if origin is type:
        return inspect.isclass(value) and (args[0] is Any or issubclass(value, args[0]))
    if origin is not None:
        return isinstance(value, origin)
    if hint is None or hint is type(None):
        return value is None
    return not inspect.isclass(hint) or isinstance(value, hint)


def _folder_units(units: Units) -> tuple[str, set[str]] | None:
    """Where all of a point's units are modules (or subpackages) of one package: that package
    and the modules of it that look like units (define the contract's first declared member:
    its first data attribute, else its first method)."""
    packages = {path.rpartition(".")[0] for path in units.modules}
    if len(packages) != 1:
        return None
    (package,) = packages
    folder = PACKAGE.parent.joinpath(*package.split("."))
    declared = vars(units.contract)
    first = next(iter(declared.get("__annotations__", {})), None) or next(
        name for name, value in declared.items() if inspect.isfunction(value)
    )
    found = set()
    for path in folder.iterdir():  # unit modules, and unit packages (their __init__.py)
        if path.is_dir():
            name, path = path.name, path / "__init__.py"
        else:
            name = path.stem
        if path.suffix != ".py" or name == "__init__" or not path.is_file():
            continue
        if _defines(ast.parse(path.read_text(encoding="utf-8")), first):
            found.add(f"{package}.{name}")
    return package, found


def _defines(tree: ast.Module, name: str) -> bool:
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.ClassDef) and node.name == name:
            return True
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == name for t in node.targets
        ):
            return True
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and node.target.id == name
        ):
            return True
    return False


@pytest.mark.parametrize("point", sorted(POINTS))
def test_every_unit_module_of_a_folder_is_registered(point: str) -> None:
    units = POINTS[point]
    folder = _folder_units(units)
    if folder is None:
        pytest.skip(f"{point}: its units span several packages")
    package, found = folder
    assert found == set(units.modules), (
        f"modules of {package} defining a {point}'s members vs those registered"
    )


def test_loss_kinds_derive_from_the_registry() -> None:
    from mtprun import losses
    from mtprun.losses.registry import TRITON_ROWS, UNITS

    assert UNITS.names() == losses.KINDS
    assert tuple(u.TRITON_ROW for u in UNITS if u.TRITON_ROW) == TRITON_ROWS


def test_commands_are_the_parser_choices() -> None:
    from mtprun.cli import COMMANDS, build_parser

    parser = build_parser()
    (subparsers,) = (a for a in parser._actions if a.dest == "command")
    assert tuple(subparsers.choices) == COMMANDS.names()

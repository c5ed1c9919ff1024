"""Extension points: one registration idiom for loss kinds, task / reward sources, model
families and CLI commands.

A *unit* is one module (or package) that holds everything of one kind of thing: a loss kind's
config and math, a source's config, check and factory, a family's shapes and mappings, a
command's parser. An *extension point* is a `Units`: the contract every unit satisfies (a
`typing.Protocol` naming the module attributes it must define) and the only list of its units,
as import paths in order. Adding a unit is its module plus one line in that list.

Units are imported when first asked for (`Units.units`), so a point whose units pull heavy
dependencies (the CLI's commands, sources importing datasets) costs nothing until used, and
`tests/test_units.py` checks every registered unit against its contract. This module imports
nothing of the package: every layer may use it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from functools import cached_property
from types import ModuleType
from typing import Generic, TypeVar

Unit = TypeVar("Unit")


class UnitError(TypeError):
    """A registered module does not satisfy its extension point's contract."""


class Units(Generic[Unit]):
    """The units of one extension point, loaded in registration order.

    point:    what the units are, for messages ("loss kind", "reward source").
    contract: a `typing.Protocol` (decorated `@runtime_checkable`) the unit modules satisfy.
    modules:  their import paths, the only list of them.
    name:     a unit's name, as recipes and commands spell it (defaults to `unit.NAME`).
    """

    def __init__(
        self,
        point: str,
        contract: type[Unit],
        modules: tuple[str, ...],
        name: Callable[[Unit], str] = lambda unit: unit.NAME,  # type: ignore[attr-defined]
    ) -> None:
        self.point = point
        self.contract = contract
        self.modules = modules
        self._name = name

    @cached_property
    def units(self) -> tuple[Unit, ...]:
        """Every unit, imported and checked against the contract, in registration order."""
        return tuple(self._load(path) for path in self.modules)

    def _load(self, path: str) -> Unit:
        module: ModuleType = importlib.import_module(path)
        if not isinstance(module, self.contract):  # type: ignore[misc]
            missing = sorted(
                attr for attr in _protocol_attrs(self.contract) if not hasattr(module, attr)
            )
            raise UnitError(f"{path} is registered as a {self.point} but lacks {missing}")
        return module  # type: ignore[return-value]

    @cached_property
    def by_name(self) -> dict[str, Unit]:
        """Each unit under its name; two units of one name are a registration error."""
        named: dict[str, Unit] = {}
        for unit in self.units:
            key = self._name(unit)
            if key in named:
                raise UnitError(f"two {self.point} units are named {key!r}")
            named[key] = unit
        return named

    def names(self) -> tuple[str, ...]:
        return tuple(self.by_name)

    def __getitem__(self, name: str) -> Unit:
        try:
            return self.by_name[name]
        except KeyError:
            known = ", ".join(self.names())
            raise KeyError(f"no {self.point} named {name!r}; known: {known}") from None

    def __iter__(self) -> Iterator[Unit]:
        return iter(self.units)


def _protocol_attrs(protocol: type) -> set[str]:
    """The attribute names a Protocol declares (its annotations and its methods)."""
    names: set[str] = set()
    for klass in protocol.__mro__:
        if klass is object or klass.__name__ in {"Protocol", "Generic"}:
            continue
        names |= set(getattr(klass, "__annotations__", {}))
        names |= {n for n, v in vars(klass).items() if callable(v) and not n.startswith("_")}
    return names


REGISTRIES: list[Units] = []
"""Every extension point, for the contract test (`register_point` appends)."""


def register_point(units: Units[Unit]) -> Units[Unit]:
    """Declare an extension point (call once, at the registry module's top level)."""
    REGISTRIES.append(units)
    return units

"""The package's layers, read from its source: every import statement of every module, those
inside functions (they run too, only later) and under `if TYPE_CHECKING:` included.

The recipe language (`mtprun.spec`, with the loss configs of `mtprun.losses` under it) is the
ground floor and the runner and the CLI are the top: nothing imports across them the wrong
way, and no two modules need each other.
"""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

import mtprun

PACKAGE = Path(mtprun.__file__).parent


def _modules() -> dict[str, Path]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


MODULES = _modules()


def _imported(module: str, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The package's modules that one import statement of `module` names."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:  # relative: from the module's package, `level - 1` packages up
            package = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]
            for _ in range(node.level - 1):
                package = package.rpartition(".")[0]
            base = f"{package}.{base}" if base else package
        # `from package import submodule` imports the submodule; anything else, the module.
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
    found = []
    for name in names:
        while name and name not in MODULES:
            name = name.rpartition(".")[0]
        if name and name != module:
            found.append(name)
    return found


def _imports(module: str) -> set[str]:
    """The package's modules that `module` imports anywhere in its source."""
    tree = ast.parse(MODULES[module].read_text(encoding="utf-8"))
    return {
        imported
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom)
        for imported in _imported(module, node)
    }


IMPORTS = {module: _imports(module) for module in MODULES}


def _in(module: str, *packages: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def test_the_module_list_is_the_package() -> None:
    assert {"mtprun.spec.recipe", "mtprun.preflight.rules", "mtprun.cli"} <= MODULES.keys()


def test_spec_imports_only_itself_and_the_loss_configs() -> None:
    # The recipe language is the ground floor: it reads no data, model or compiler, not even
    # inside a function or for type checking (the rules that need them live in
    # mtprun.preflight).
    up = {
        module: sorted(m for m in imports if not _in(m, "mtprun.spec", "mtprun.losses"))
        for module, imports in IMPORTS.items()
        if _in(module, "mtprun.spec")
    }
    assert {module: found for module, found in up.items() if found} == {}


def test_nothing_imports_the_runner_or_the_cli() -> None:
    for top, allowed in (("mtprun.runner", ("mtprun.runner", "mtprun.cli")), ("mtprun.cli", ())):
        users = {
            module
            for module, imports in IMPORTS.items()
            if not _in(module, top, *allowed) and any(_in(m, top) for m in imports)
        }
        assert users == set(), f"{top} is imported by {sorted(users)}"


def test_no_two_modules_import_each_other() -> None:
    # Type-only imports count too: a module whose annotations need another that needs it is
    # a circle all the same (the two cannot be read, or split, one without the other).
    try:
        graphlib.TopologicalSorter(IMPORTS).prepare()
    except graphlib.CycleError as err:
        raise AssertionError(f"import cycle: {' -> '.join(err.args[1])}") from None

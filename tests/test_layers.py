"""The package's layers, read from its source: every import statement of every module, those
inside functions (they run too, only later) and under `if TYPE_CHECKING:` included, and every
unit module an extension point (`mtprun.units.Units`) lists, which it imports by name.

The recipe language (`mtprun.spec`, with the loss configs of `mtprun.losses` under it) is the
ground floor and the runner and the CLI are the top: nothing imports across them the wrong
way (`LAYERS`), the runner's rooms keep their order (`RUNNER_ROOMS`), and no two modules need
each other. Sizes are bounded too: no module over `MAX_MODULE_LINES` lines, no function over
`MAX_FUNCTION_LINES` outside the kernels (a Triton kernel is one function by necessity).
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
"""Every import statement's modules: in functions, under TYPE_CHECKING, everywhere."""


def _named(node: ast.Call) -> list[str]:
    """The package's modules that a `Units(...)` or `import_module(...)` call names as strings."""
    func = node.func
    called = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
    if called not in {"Units", "import_module"}:
        return []
    return [
        const.value
        for arg in node.args
        for const in ast.walk(arg)
        if isinstance(const, ast.Constant) and const.value in MODULES
    ]


def _is_type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and (
        (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING")
        or (isinstance(node.test, ast.Attribute) and node.test.attr == "TYPE_CHECKING")
    )


def _loads(module: str) -> set[str]:
    """The package's modules that importing `module` loads: its import statements outside
    functions and `if TYPE_CHECKING:`, and the modules its extension points (`Units(...)`)
    or `import_module("...")` calls name, which the package imports when it reads them."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            return
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.update(_imported(module, node))
        elif isinstance(node, ast.Call):
            found.update(_named(node))
        children = node.orelse if _is_type_checking(node) else ast.iter_child_nodes(node)
        for child in children:
            visit(child)

    visit(ast.parse(MODULES[module].read_text(encoding="utf-8")))
    return found - {module}


LOADS = {module: _loads(module) for module in MODULES}
"""What importing each module runs: its import-time imports and the units it lists."""


def _in(module: str, *packages: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def test_the_module_list_is_the_package() -> None:
    assert {"mtprun.spec.recipe", "mtprun.preflight.rules", "mtprun.cli"} <= MODULES.keys()


def test_registered_units_are_loads() -> None:
    # The loss registry imports its units by name at import; a command's heavy imports wait
    # inside its function.
    assert "mtprun.losses.ce" in LOADS["mtprun.losses.registry"]
    assert "mtprun.cli.plan" in LOADS["mtprun.cli"]
    assert "mtprun.runner.run.launch" in IMPORTS["mtprun.cli.run"]
    assert "mtprun.runner.run.launch" not in LOADS["mtprun.cli.run"]


def test_spec_imports_only_itself_and_the_loss_configs() -> None:
    # The recipe language is the ground floor: it reads no data, model or compiler, not even
    # inside a function or for type checking (the rules that need them live in
    # mtprun.preflight). mtprun.units imports nothing of the package.
    up = {
        module: sorted(
            m for m in imports if not _in(m, "mtprun.spec", "mtprun.losses", "mtprun.units")
        )
        for module, imports in IMPORTS.items()
        if _in(module, "mtprun.spec")
    }
    assert {module: found for module, found in up.items() if found} == {}


LAYERS: tuple[tuple[str, ...], ...] = (
    ("mtprun.units",),
    ("mtprun.losses",),
    ("mtprun.spec",),
    ("mtprun.compiler",),
    ("mtprun.kernels",),
    ("mtprun.models",),
    ("mtprun.data",),
    ("mtprun.sources",),
    ("mtprun.preflight",),
    ("mtprun.runner",),
    ("mtprun.cli",),
)
"""The package's layers, ground floor first: a module imports its own layer and those below.

units (imports nothing of the package) < losses (the head terms: configs and row math) < spec
(the recipe, built from the loss configs) < compiler (recipe -> HeadPlan) < kernels (HeadPlan +
hidden states -> loss; they read only the plan and the loss rows) < models (families: shapes and
tensor mappings, read from the spec's model section) < data (rendering needs the family's
template) < sources (task / reward sources over data) < preflight (checks a recipe against
data, models and the plan) < runner < cli. The root package `mtprun` (a lazy facade) is none.
"""


def _layer(module: str) -> int | None:
    """The index of `module`'s layer in LAYERS (None: the root package)."""
    for index, packages in enumerate(LAYERS):
        if _in(module, *packages):
            return index
    return None


def test_every_subpackage_has_a_layer() -> None:
    unplaced = sorted(m for m in MODULES if m != "mtprun" and _layer(m) is None)
    assert unplaced == [], "add these to LAYERS"


def test_no_layer_imports_one_above_it() -> None:
    up = sorted(
        f"{module} -> {imported}"
        for module, imports in IMPORTS.items()
        if (layer := _layer(module)) is not None
        for imported in imports
        if (above := _layer(imported)) is not None and above > layer
    )
    assert up == []


def _closure(module: str) -> set[str]:
    """Every module that importing `module` loads, transitively (LOADS)."""
    seen, todo = {module}, [module]
    while todo:
        for loaded in LOADS[todo.pop()] - seen:
            seen.add(loaded)
            todo.append(loaded)
    return seen


def test_registries_load_nothing_above_their_layer() -> None:
    # An extension point imports its units by name when it is read; a unit may sit in a
    # package above the point's (the sources' configs are part of the recipe language, their
    # factories run on the data layer) as long as importing it loads nothing else from
    # above: what it needs from there it imports inside its functions.
    up = sorted(
        f"{registry} lists {unit}, which loads {loaded}"
        for registry, loads in LOADS.items()
        if (layer := _layer(registry)) is not None
        for unit in loads - IMPORTS[registry]  # named, not imported by a statement
        for loaded in _closure(unit)
        if (above := _layer(loaded)) is not None
        and above > layer
        and not _in(loaded, *LAYERS[_layer(unit)])
    )
    assert up == []


def test_importing_any_module_runs_no_circle() -> None:
    try:
        graphlib.TopologicalSorter(LOADS).prepare()
    except graphlib.CycleError as err:
        raise AssertionError(f"import cycle: {' -> '.join(reversed(err.args[1]))}") from None


RUNNER_ROOMS: dict[str, tuple[str, ...]] = {
    "shared": (),
    "trainer": ("shared",),
    "rollout": ("shared",),
    "tracking": ("shared",),
    "run": ("shared", "trainer", "rollout", "tracking"),
}
"""The rooms of mtprun.runner and the rooms each may import. `shared` is the runner's own
modules (mtprun/runner/*.py: the run folder, placement, actors, ports, weight transfer...);
trainer, rollout and tracking stand side by side on it, none importing another; run composes
them all (the driver, its stages and steps, checkpoints, export, evaluation)."""


def _room(module: str) -> str | None:
    if not _in(module, "mtprun.runner"):
        return None
    parts = module.split(".")
    if len(parts) > 3 or (MODULES[module].name == "__init__.py" and len(parts) == 3):
        return parts[2]
    return "shared"


def test_every_runner_module_is_in_a_room() -> None:
    assert {_room(m) for m in MODULES if _in(m, "mtprun.runner")} == set(RUNNER_ROOMS)


def test_runner_rooms_import_only_the_rooms_below() -> None:
    wrong = sorted(
        f"{module} -> {imported}"
        for module, imports in IMPORTS.items()
        if (room := _room(module)) is not None
        for imported in imports
        if (other := _room(imported)) is not None
        and other != room
        and other not in RUNNER_ROOMS[room]
    )
    assert wrong == []


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
        raise AssertionError(f"import cycle: {' -> '.join(reversed(err.args[1]))}") from None


MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80


def test_no_module_is_over_the_size_limit() -> None:
    long = {
        module: lines
        for module, path in MODULES.items()
        if (lines := len(path.read_text(encoding="utf-8").splitlines())) > MAX_MODULE_LINES
    }
    assert long == {}, f"split these modules (over {MAX_MODULE_LINES} lines) by concern"


def test_no_function_is_over_the_size_limit() -> None:
    # Outside the kernels: a Triton kernel is one function by necessity.
    long = {
        f"{module}:{node.lineno} {node.name}": node.end_lineno - node.lineno + 1
        for module, path in MODULES.items()
        if not _in(module, "mtprun.kernels")
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    }
    assert long == {}, f"split these functions (over {MAX_FUNCTION_LINES} lines)"

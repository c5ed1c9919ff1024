"""`mtprun validate FILES... [KEY=VALUE ...]`: check recipes (CI-friendly, exit 2 on errors)."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table

from mtprun.cli.diagnostics import EXIT_INVALID, print_diagnostics, split_overrides

if TYPE_CHECKING:
    from mtprun.spec import RecipeCheck


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "validate",
        help="Check recipe files; all errors as file:line:col, exit 2 on any.",
        description="Check every recipe (schema and cross-field rules) and print a summary. "
        "KEY=VALUE overrides apply to every file.",
    )
    parser.add_argument("args", nargs="+", metavar="FILE|KEY=VALUE")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    files, overrides = split_overrides(args.args)
    if not files:
        print("mtprun validate: no recipe file given (only KEY=VALUE overrides)", file=sys.stderr)
        return EXIT_INVALID
    from mtprun.preflight import check_recipe

    checks = {file: check_recipe(file, overrides) for file in files}
    for check in checks.values():
        print_diagnostics(check.diagnostics)
    Console().print(_summary(checks))
    return EXIT_INVALID if any(c.errors for c in checks.values()) else 0


def _summary(checks: dict[str, RecipeCheck]) -> Table:
    from mtprun.spec.actors import ActorDemand

    table = Table(title="mtprun validate")
    table.add_column("recipe", overflow="fold")
    for column in ("status", "name", "stage", "losses"):
        table.add_column(column)
    for file, check in checks.items():
        recipe = check.recipe
        n_errors = len(check.errors)
        status = f"[red]{n_errors} error(s)[/red]" if n_errors else "[green]ok[/green]"
        if check.warnings:
            status += f" [yellow]{len(check.warnings)} warning(s)[/yellow]"
        if recipe is None:
            table.add_row(file, status, "", "", "")
            continue
        stage = ("SFT -> RL" if recipe.warmstart else "RL") if recipe.is_rl else "SFT"
        demand = ActorDemand.of(recipe)
        if served := demand.reward_models:  # actors beside the engines: the run's CPUs
            stage += (
                f", {served} served reward model{'s' if served > 1 else ''} "
                f"({demand.need('CPU'):g} CPUs, {demand.need('GPU'):g} GPUs for all actors)"
            )
        losses = ", ".join(t.kind for t in recipe.losses)
        table.add_row(file, status, recipe.name, stage, losses)
    return table

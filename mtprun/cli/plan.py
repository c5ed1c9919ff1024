"""`mtprun plan RECIPE [KEY=VALUE ...] [--json]`: the fused head-loss plan of a recipe."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table

from mtprun.cli.diagnostics import EXIT_INVALID, print_diagnostics
from mtprun.spec import check_recipe

if TYPE_CHECKING:
    from mtprun.compiler import HeadPlan


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "plan",
        help="Show the fused head-loss plan compiled from a recipe.",
        description="Compile the recipe's loss terms into one head-kernel plan and show it.",
    )
    parser.add_argument("recipe", help="Recipe YAML file.")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    parser.add_argument("--json", action="store_true", help="Print the HeadPlan as JSON.")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    check = check_recipe(args.recipe, args.overrides)
    print_diagnostics(check.diagnostics)
    if check.recipe is None:
        return EXIT_INVALID
    from mtprun.compiler import compile_recipe  # imports torch: only when needed

    plan = compile_recipe(check.recipe)
    if args.json:
        print(plan.to_json())
    else:
        Console().print(_terms_table(plan))
    return 0


def _terms_table(plan: HeadPlan) -> Table:
    table = Table(title=f"HeadPlan {plan.hash}")
    table.add_column("term")
    table.add_column("weight", justify="right")
    table.add_column("settings")
    for term in plan.terms:
        settings = term.model_dump(exclude={"kind", "weight", "coef"})
        table.add_row(
            term.kind, f"{term.weight:g}", ", ".join(f"{k}={v}" for k, v in settings.items())
        )
    return table

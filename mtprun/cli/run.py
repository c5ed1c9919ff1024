"""`mtprun run`: placeholder until the runner lands."""

from __future__ import annotations

import argparse
import sys


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("run", help="Run a recipe (not available yet).")
    parser.add_argument("recipe", help="Recipe YAML file.")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    print(
        "mtprun run: running recipes is not available yet in this version; "
        f"check it with `mtprun validate {args.recipe}` or `mtprun plan {args.recipe}`.",
        file=sys.stderr,
    )
    return 2

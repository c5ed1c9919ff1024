"""`mtprun schema [-o FILE]`: the recipe JSON Schema, for editors."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from mtprun.cli.diagnostics import EXIT_INVALID


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "schema",
        help="Print the recipe JSON Schema (or write it with -o).",
        description="Recipes point editors at it with a first line such as "
        "`# yaml-language-server: $schema=schema.json`.",
    )
    parser.add_argument("-o", "--output", type=Path, help="Write to this file instead of stdout.")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from mtprun.spec.schema import recipe_json_schema

    text = json.dumps(recipe_json_schema(), indent=2) + "\n"
    if args.output is None:
        print(text, end="")
        return 0
    try:
        args.output.write_text(text, encoding="utf-8")
    except OSError as exc:
        print(f"mtprun schema: cannot write {args.output}: {exc.strerror}", file=sys.stderr)
        return EXIT_INVALID
    return 0

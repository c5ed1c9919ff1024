"""`mtprun` command line: one module per command, each exposing `add_parser(subparsers)`."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

COMMANDS: tuple[str, ...] = (
    "validate",
    "plan",
    "schema",
    "run",
    "resume",
    "export",
    "eval",
    "ui",
    "inspect_data",
    "sync",
)
"""Modules of `mtprun.cli`, in help order. Each sets `func(args) -> int` via set_defaults and
imports heavy dependencies (torch, ray, vllm) inside `func`, so every command starts fast."""

_RECIPE_SUFFIXES = (".yaml", ".yml")


class CommandParser(argparse.ArgumentParser):
    """A command's parser: its options and its positionals (a recipe, KEY=VALUE overrides, a
    run folder) in any order, so `mtprun inspect-data r.yaml -n 1 trainer.lr=1e-4` works.
    Plain argparse gives every positional to the first run of them and rejects the overrides
    after an option; an argument it does not know is reported by the command, with its usage."""

    _intermixing = False

    def parse_known_args(
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        # The subcommand action calls this; argparse's intermixed parsing calls it again for
        # its two passes (options, then positionals), which must be plain ones.
        if self._intermixing:
            return super().parse_known_args(args, namespace)
        self._intermixing = True
        try:
            namespace, extras = self.parse_known_intermixed_args(args, namespace)
        finally:
            self._intermixing = False
        if extras:
            # An unknown option also strands the positionals after it: name the option alone.
            unknown = [arg for arg in extras if arg.startswith("-")] or extras
            self.error(f"unrecognized arguments: {' '.join(unknown)}")
        return namespace, extras


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mtprun",
        description="Declarative LLM post-training. "
        "`mtprun RECIPE.yaml [KEY=VALUE ...]` runs a recipe.",
    )
    subparsers = parser.add_subparsers(
        dest="command", metavar="COMMAND", required=True, parser_class=CommandParser
    )
    for name in COMMANDS:
        importlib.import_module(f"mtprun.cli.{name}").add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0].endswith(
        _RECIPE_SUFFIXES
    ):  # `mtprun recipe.yaml` = `mtprun run recipe.yaml`
        argv = ["run", *argv]
    args = build_parser().parse_args(argv)
    return args.func(args)

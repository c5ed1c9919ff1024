"""`mtprun` command line: one module per command (a `CommandUnit`), listed in `COMMANDS`.

A new command is its module plus its line in `COMMANDS`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from mtprun.runner.usage_reporting import disable_usage_reporting
from mtprun.units import Units, register_point


@runtime_checkable
class CommandUnit(Protocol):
    """A command module of `mtprun.cli`, named by its module (`inspect_data` is
    `mtprun inspect-data`).

    `add_parser` adds the command's parser under that name (a `CommandParser`) and sets
    `func(args) -> int` on it via `set_defaults`; `func` imports heavy dependencies (torch,
    ray, vllm) inside itself, so every command starts fast.
    """

    def add_parser(self, subparsers: argparse._SubParsersAction) -> None: ...


def command_name(unit: CommandUnit) -> str:
    """The command a unit module adds: its module name, `_` spelled `-`."""
    return unit.__name__.rpartition(".")[2].replace("_", "-")  # type: ignore[attr-defined]


COMMANDS: Units[CommandUnit] = register_point(
    Units(
        "command",
        CommandUnit,
        (
            "mtprun.cli.validate",
            "mtprun.cli.plan",
            "mtprun.cli.schema",
            "mtprun.cli.run",
            "mtprun.cli.resume",
            "mtprun.cli.export",
            "mtprun.cli.eval",
            "mtprun.cli.ui",
            "mtprun.cli.inspect_data",
            "mtprun.cli.sync",
        ),
        name=command_name,
    )
)
"""The commands, in help order."""

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
    for command in COMMANDS:
        command.add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0].endswith(
        _RECIPE_SUFFIXES
    ):  # `mtprun recipe.yaml` = `mtprun run recipe.yaml`
        argv = ["run", *argv]
    args = build_parser().parse_args(argv)
    disable_usage_reporting()  # before any command imports MLflow, Ray or vLLM
    return args.func(args)

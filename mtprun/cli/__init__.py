"""`mtprun` command line: one module per command, each exposing `add_parser(subparsers)`."""

from __future__ import annotations

import argparse
import importlib
import sys

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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mtprun",
        description="Declarative LLM post-training. "
        "`mtprun RECIPE.yaml [KEY=VALUE ...]` runs a recipe.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
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

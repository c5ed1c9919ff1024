"""`mtprun resume RUN_DIR`: continue a stopped or failed run into the same MLflow run."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mtprun.cli.diagnostics import EXIT_INVALID
from mtprun.cli.run import add_ray_address


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "resume",
        help="Continue a run from its newest checkpoint (same run folder, same MLflow run).",
        description="Continue the run in RUN_DIR from its newest checkpoint with the recipe "
        "it was started with; steps after that checkpoint run again.",
    )
    parser.add_argument("run_dir", type=Path, metavar="RUN_DIR")
    add_ray_address(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from mtprun.runner.run.launch import RunFolderError, resume_run

    try:
        return resume_run(args.run_dir, args.ray_address, Console())
    except (FileNotFoundError, RunFolderError) as err:
        print(f"mtprun resume: {err}", file=sys.stderr)
        return EXIT_INVALID

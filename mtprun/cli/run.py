"""`mtprun run RECIPE [KEY=VALUE ...]` (also `mtprun RECIPE ...`): run a recipe end to end."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mtprun.cli.diagnostics import EXIT_INVALID, print_diagnostics


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "run",
        help="Run a recipe: SFT, or RL with rollouts, tracked in MLflow.",
        description="Run a recipe on a local Ray instance (or a cluster with --ray-address). "
        "Everything the run writes lands in its run folder (run_dir, default runs/<name>).",
    )
    parser.add_argument("recipe", help="Recipe YAML file.")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    add_ray_address(parser)
    parser.add_argument(
        "--resume",
        action="store_true",
        help="If the run folder already holds this run, continue it from its newest checkpoint.",
    )
    parser.set_defaults(func=run)


def add_ray_address(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--ray-address",
        metavar="HOST:PORT",
        help="Join this Ray cluster (overrides resources.ray_address) instead of starting a "
        "local Ray instance.",
    )


def run(args: argparse.Namespace) -> int:
    from mtprun.preflight import check_recipe

    check = check_recipe(args.recipe, args.overrides)
    print_diagnostics(check.diagnostics)
    if check.recipe is None:
        return EXIT_INVALID
    from rich.console import Console

    from mtprun.runner.run.launch import RunFolderError, resume_run, start_run
    from mtprun.runner.run_dir import RunDir
    from mtprun.runner.tracking.tracker import TrackingUnavailable

    recipe = check.recipe
    text = Path(args.recipe).read_text()
    if args.overrides:
        text += "\n# command-line overrides: " + " ".join(args.overrides) + "\n"
    try:
        if args.resume and RunDir(Path(recipe.run_dir)).has_run():
            return resume_run(Path(recipe.run_dir), args.ray_address, Console())
        return start_run(recipe, text, args.ray_address, Console())
    except RunFolderError as err:  # also RunFolderLocked: another process owns the folder
        print(f"mtprun run: {err}", file=sys.stderr)
        return EXIT_INVALID
    except TrackingUnavailable as err:  # a new run needs its MLflow run created
        print(f"mtprun run: {err}", file=sys.stderr)
        return 1

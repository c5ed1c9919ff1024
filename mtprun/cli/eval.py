"""`mtprun eval RUN_DIR [--step N]`: evaluate a saved checkpoint with the recipe's `eval:`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mtprun.cli.diagnostics import EXIT_INVALID
from mtprun.cli.run import add_ray_address


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "eval",
        help="Evaluate a checkpoint on the held-out prompts (eval/* metrics).",
        description="Serve checkpoint --step (default: the newest) of the run in RUN_DIR with "
        "the recipe's rollout engines, score the recipe's evaluation prompts with its reward, "
        "print the eval/* metrics, write them to RUN_DIR/eval/step_N.json and log them to the "
        "run's MLflow run at step N.",
    )
    parser.add_argument("run_dir", type=Path, metavar="RUN_DIR")
    parser.add_argument("--step", type=int, help="Checkpoint step (default: the newest).")
    add_ray_address(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from mtprun.runner.run.evaluate_checkpoint import evaluate_checkpoint
    from mtprun.runner.run.lock import RunFolderError

    try:
        step, metrics = evaluate_checkpoint(args.run_dir, args.step, args.ray_address)
    except (FileNotFoundError, ValueError, RunFolderError) as err:
        print(f"mtprun eval: {err}", file=sys.stderr)
        return EXIT_INVALID
    print(f"evaluation of step {step}:")
    for key, value in sorted(metrics.items()):
        print(f"  {key:<28} {value:.4g}")
    return 0

"""`mtprun sync RUN_DIR`: upload the tracking records a run could not send to its server."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mtprun.cli.diagnostics import EXIT_INVALID

EXIT_LEFT = 1  # the server was not reachable long enough: records remain


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "sync",
        help="Upload a run's spooled tracking records (metrics, params, tags, artifacts, "
        "status) to its MLflow server.",
        description="Upload what RUN_DIR/tracking/ holds: the records a run spooled while its "
        "MLflow server was unreachable and could not upload before it ended. Each record "
        "reaches MLflow once, in order. Exit 0 when the spool is empty, 1 when records remain "
        "(run it again later), 2 when the folder is not a run or a live run owns it.",
    )
    parser.add_argument("run_dir", type=Path, metavar="RUN_DIR")
    parser.add_argument(
        "--timeout",
        type=float,
        default=60.0,
        metavar="S",
        help="Give up after this many seconds without an empty spool (default 60).",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from mtprun.runner.run.lock import RunFolderError, RunLock
    from mtprun.runner.run.progress import close_logging, setup_logging
    from mtprun.runner.tracking.tracker import sync_spool

    try:
        with RunLock(_run_folder(args.run_dir)).acquire("mtprun sync"):
            setup_logging(args.run_dir / "log.txt", Console(stderr=True))
            try:
                uploaded, left = sync_spool(args.run_dir, args.timeout)
            finally:
                close_logging()
    except (FileNotFoundError, RunFolderError) as err:
        print(f"mtprun sync: {err}", file=sys.stderr)
        return EXIT_INVALID
    print(f"uploaded {uploaded} tracking record(s) of {args.run_dir}")
    if left:
        print(
            f"mtprun sync: {left} record(s) remain in {args.run_dir / 'tracking'}: the MLflow "
            "server did not take them (see the warning above); run `mtprun sync` again later",
            file=sys.stderr,
        )
        return EXIT_LEFT
    return 0


def _run_folder(path: Path) -> Path:
    """`path` when it holds a run (checked before the lock file is created in it)."""
    from mtprun.runner.run_dir import RunDir

    RunDir(path).read_state()
    return path

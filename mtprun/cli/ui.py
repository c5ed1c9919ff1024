"""`mtprun ui [RUN_DIR]`: the MLflow UI on a run's tracking store; prints the address of the
training runs of the run's experiment and of the run's own page."""

from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path

from mtprun.cli.diagnostics import EXIT_INVALID
from mtprun.runner.net import PortUnavailable
from mtprun.runner.tracking.server import MlflowServer

_RUNS = Path("runs")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "ui",
        help="Start the MLflow UI on a run's tracking store and print its address.",
        description="Serve the MLflow UI for the tracking store of RUN_DIR (default: the most "
        "recent run under ./runs) until Ctrl-C.",
    )
    parser.add_argument("run_dir", type=Path, nargs="?", metavar="RUN_DIR")
    parser.add_argument("--host", default="127.0.0.1", help="Interface to listen on.")
    parser.add_argument("--port", type=int, default=5000, help="Port to listen on.")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    run_dir = args.run_dir or _newest_run(_RUNS)
    state_file = run_dir / "state.json" if run_dir else None
    if state_file is None or not state_file.exists():
        where = run_dir or _RUNS.resolve()
        print(
            f"mtprun ui: no mtprun run in {where}; pass a run folder (the run_dir of a recipe "
            "that has been run)",
            file=sys.stderr,
        )
        return EXIT_INVALID
    state = json.loads(state_file.read_text())
    uri = state["tracking_uri"]
    if not uri.startswith(("sqlite:", "file:")) and "://" in uri:
        print(f"the run is tracked on the MLflow server {uri}: open it there", file=sys.stderr)
        return EXIT_INVALID
    experiment_id = _experiment_of(uri, state["run_id"])
    if experiment_id is None:
        print(f"mtprun ui: the run {state['run_id']} is not in its store {uri}", file=sys.stderr)
        return EXIT_INVALID
    server = MlflowServer(uri, args.host, args.port)
    print(f"MLflow UI for {run_dir}: {server.runs_view(experiment_id)}", flush=True)
    print(f"run {state['run_id']}: {server.run_page(experiment_id, state['run_id'])}", flush=True)
    # SIGTERM too ends the server (it runs in a process group of its own).
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        server.start()
        return server.wait()
    except PortUnavailable as err:
        print(f"mtprun ui: {err}; choose another with --port (or --host)", file=sys.stderr)
        return 1
    except RuntimeError as err:  # it exited or never answered (a bad store)
        print(f"mtprun ui: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        server.stop()
        signal.signal(signal.SIGTERM, previous)


def _experiment_of(uri: str, run_id: str) -> str | None:
    """The id of the experiment (the recipe's `tracking.experiment`) that the store files the
    run under; None when the store does not hold the run."""
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    try:
        return MlflowClient(uri).get_run(run_id).info.experiment_id
    except MlflowException:
        return None


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _newest_run(root: Path) -> Path | None:
    states = sorted(root.glob("*/state.json"), key=lambda p: p.stat().st_mtime)
    return states[-1].parent if states else None

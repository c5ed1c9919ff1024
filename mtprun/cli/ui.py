"""`mtprun ui [RUN_DIR]`: the MLflow UI on a run's tracking store; prints the run's address."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from mtprun.cli.diagnostics import EXIT_INVALID

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
    address = f"http://{args.host}:{args.port}"
    command = [
        sys.executable,
        "-m",
        "mlflow",
        "server",
        "--backend-store-uri",
        uri,
        "--host",
        args.host,
        "--port",
        str(args.port),
        "--workers",
        "1",
    ]
    print(f"MLflow UI for {run_dir}: {address}", flush=True)
    run_page = f"{address}/#/experiments/{state['experiment_id']}/runs/{state['run_id']}"
    print(f"run {state['run_id']}: {run_page}", flush=True)
    server = subprocess.Popen(command)
    try:
        return server.wait()
    except KeyboardInterrupt:
        server.terminate()
        server.wait(timeout=30)
        return 0


def _newest_run(root: Path) -> Path | None:
    states = sorted(root.glob("*/state.json"), key=lambda p: p.stat().st_mtime)
    return states[-1].parent if states else None

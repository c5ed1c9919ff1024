"""Chaos soak (issue 17): the quickstart, tracked by a real `mlflow server`, while faults are
injected at random steps, then the run's record is checked.

Faults, one each, at seeded random steps of the GRPO stage (at least `--spacing` apart):
- engine_kill: SIGKILL of a vLLM engine actor (Ray restarts it, the step retries its share);
- trainer_kill: SIGKILL of the trainer rank (the driver restarts it from the newest checkpoint);
- tracking_outage: the MLflow server stopped for `--outage-s` seconds (the spool holds);
- sigterm_resume: SIGTERM to `mtprun` (checkpoint, exit), then `mtprun resume`;
- disk_full: the checkpoint folder, a size-limited tmpfs, filled up (the next checkpoint
  fails with CheckpointWriteError), then emptied and `mtprun resume`.
The tmpfs needs a mount namespace: the script re-runs itself under `unshare -rm` (no root);
where that is refused, disk_full is left out and said so.

Checks at the end: the run finished every step; each metric key has exactly one point per
step it was logged at, with no gap inside its stage's span (train/loss: 1..N); the reward of
the last 10 steps reaches `--min-reward`; no actor process is left; every checkpoint's trainer
states and HF folder load. Prints a JSON report (also `--json`).

    python bench/chaos_soak.py                      # the full quickstart, ~30-60 min on 2 cores
    python bench/chaos_soak.py --steps 200 --min-reward 0  # a shorter drill
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from mtprun.runner.tracking.server import MlflowServer

FAULTS = ("engine_kill", "trainer_kill", "tracking_outage", "sigterm_resume", "disk_full")
WARMSTART_STEPS = 40  # recipes/quickstart.yaml's warm start, before the GRPO stage
QUICKSTART = Path(__file__).resolve().parents[1] / "recipes" / "quickstart.yaml"
MTPRUN = [str(Path(sys.executable).with_name("mtprun"))]  # the installed console script
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "RAY_AUTH_MODE": "disabled", "PYTHONUNBUFFERED": "1"}
STEP_LINE = re.compile(r"step (\d+) \|")
PIDS = re.compile(r"(trainer|engines) ready: (?:\d+ rank\(s\), )?pids \[([\d, ]+)\]|new pid (\d+)")


class Soak:
    def __init__(self, args: argparse.Namespace, root: Path, with_disk: bool) -> None:
        self.args, self.root = args, root
        self.run_dir = root / "run"
        self.log_file = self.run_dir / "log.txt"
        self.server = MlflowServer(
            f"sqlite:///{root / 'mlflow.db'}", artifacts=root / "artifacts", log=root / "server.log"
        )
        self.proc: subprocess.Popen | None = None
        self.events: list[dict] = []
        self.with_disk = with_disk
        self.total = WARMSTART_STEPS + args.steps

    # -- the run ---------------------------------------------------------------------------
    def launch(self, *argv: str) -> None:
        out = open(self.root / "mtprun.out", "ab")  # noqa: SIM115 (the process's lifetime)
        self.proc = subprocess.Popen(
            [*MTPRUN, *argv], cwd=self.root, env=ENV, stdout=out, stderr=out, start_new_session=True
        )

    def start_run(self) -> None:
        self.launch(
            str(QUICKSTART),
            f"run_dir={self.run_dir}",
            f"tracking.uri={self.server.uri}",
            f"trainer.steps={self.args.steps}",
            f"trainer.checkpoint_every={self.args.checkpoint_every}",
        )

    def resume(self) -> None:
        self.launch("resume", str(self.run_dir))

    def step(self) -> int:
        text = self.log_file.read_text() if self.log_file.exists() else ""
        found = STEP_LINE.findall(text)
        return int(found[-1]) if found else 0

    def latest_pid(self, kind: str) -> int:
        """The newest pid the log gives for `kind` (trainer / engines); restarts log 'new pid'
        for engines."""
        pid = None
        for match in PIDS.finditer(self.log_file.read_text()):
            if match.group(1) == kind:
                pid = int(match.group(2).split(",")[0])
            elif match.group(3) and kind == "engines":
                pid = int(match.group(3))
        if pid is None:
            raise RuntimeError(f"no {kind} pid in the log")
        return pid

    # -- faults ------------------------------------------------------------------------------
    def inject(self, fault: str) -> None:
        at = self.step()
        self.events.append({"fault": fault, "step": at, "t": round(time.monotonic(), 1)})
        print(f"[soak] step {at}: {fault}", flush=True)
        if fault in ("engine_kill", "trainer_kill"):
            os.kill(self.latest_pid("engines" if fault == "engine_kill" else "trainer"), 9)
        elif fault == "tracking_outage":
            self.server.stop()
            threading.Timer(self.args.outage_s, self.server.start).start()
        elif fault == "sigterm_resume":
            self.proc.send_signal(signal.SIGTERM)
            self.events[-1]["exit"] = self.proc.wait(timeout=900)
            self.resume()
        elif fault == "disk_full":
            self.fill_disk()

    def fill_disk(self) -> None:
        filler = self.run_dir / "checkpoints" / "filler"
        with open(filler, "wb") as out:
            try:
                while True:
                    out.write(b"\0" * (1 << 20))
                    out.flush()
            except OSError:
                pass
        code = self.proc.wait(timeout=3600)  # the next checkpoint cannot be written
        out = (self.root / "mtprun.out").read_text()
        self.events[-1].update(
            exit=code, refused="could not be written" in out, failed_at=self.step()
        )
        filler.unlink()
        self.resume()

    def drive(self, schedule: dict[int, str]) -> int:
        pending = dict(schedule)
        while True:
            if self.proc.poll() is not None:
                return self.proc.returncode
            now = self.step()
            due = [s for s in pending if now >= s]
            for at in sorted(due):
                self.inject(pending.pop(at))
            time.sleep(1)

    # -- checks ------------------------------------------------------------------------------
    def check(self) -> dict:
        from mlflow import MlflowClient

        state = json.loads((self.run_dir / "state.json").read_text())
        client = MlflowClient(self.server.uri)
        sync = [*MTPRUN, "sync", str(self.run_dir)]
        subprocess.run(sync, check=False, capture_output=True, env=ENV)
        keys = client.get_run(state["run_id"]).data.metrics
        duplicated, missing = {}, {}
        for key in keys:
            steps = [m.step for m in client.get_metric_history(state["run_id"], key)]
            twice = sorted({s for s in steps if steps.count(s) > 1})
            if twice:
                duplicated[key] = twice[:10]
            # Every key is logged at every step of the stages that produce it (the warm start's
            # and the GRPO stage's keys differ): no gap inside its span, and train/loss spans
            # the whole run.
            span = (
                range(1, self.total + 1)
                if key == "train/loss"
                else range(min(steps), max(steps) + 1)
            )
            gaps = sorted(set(span) - set(steps))
            if gaps:
                missing[key] = gaps[:10]
        rewards = sorted(
            client.get_metric_history(state["run_id"], "reward/mean"), key=lambda m: m.step
        )
        last10 = sum(m.value for m in rewards[-10:]) / max(1, len(rewards[-10:]))
        return {
            "steps": self.step(),
            "duplicated_points": duplicated,
            "missing_points": missing,
            "reward_last10": round(last10, 3),
            "processes_left": self.processes_left(),
            "checkpoints": self.load_checkpoints(),
        }

    def processes_left(self) -> list[int]:
        """Actor processes the log named (every attempt, every restart) still alive."""
        pids = set()
        for match in PIDS.finditer(self.log_file.read_text()):
            pids.update(int(p) for p in (match.group(2) or match.group(3)).split(", "))
        time.sleep(10)  # exiting processes get a moment
        return sorted(pid for pid in pids if Path(f"/proc/{pid}").exists())

    def load_checkpoints(self) -> dict[str, str]:
        import torch
        from transformers import AutoModelForCausalLM

        loaded = {}
        for folder in sorted((self.run_dir / "checkpoints").glob("step_*")):
            try:
                for state in folder.glob("trainer_rank*.pt"):
                    torch.load(state, map_location="cpu", weights_only=False)
                AutoModelForCausalLM.from_pretrained(folder / "hf")
                loaded[folder.name] = "ok"
            except Exception as error:  # report every checkpoint
                loaded[folder.name] = f"{type(error).__name__}: {error}"[:200]
        return loaded


def schedule_faults(args: argparse.Namespace, faults: list[str]) -> dict[int, str]:
    """Fault -> global step, at least `spacing` apart, inside the GRPO stage."""
    rng = random.Random(args.seed)
    first, last = WARMSTART_STEPS + args.spacing, WARMSTART_STEPS + args.steps - args.spacing
    slots = list(range(first, last, args.spacing))
    if len(slots) < len(faults):
        raise SystemExit(f"--steps {args.steps} leaves too few slots of {args.spacing} steps")
    steps = sorted(rng.sample(slots, len(faults)))
    order = rng.sample(faults, len(faults))
    return {s + rng.randrange(args.spacing // 2): f for s, f in zip(steps, order, strict=True)}


def inner(args: argparse.Namespace, with_disk: bool) -> dict:
    root = Path(tempfile.mkdtemp(prefix="soak", dir="/tmp"))  # short: Ray's sockets
    soak = Soak(args, root, with_disk)
    checkpoints = soak.run_dir / "checkpoints"
    checkpoints.mkdir(parents=True)
    if with_disk:
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={args.tmpfs_mib}m", "tmpfs", str(checkpoints)],
            check=True,
        )
    faults = [f for f in FAULTS if with_disk or f != "disk_full"]
    schedule = schedule_faults(args, faults)
    print(f"[soak] {root}: faults at {schedule}", flush=True)
    soak.server.start()
    started = time.monotonic()
    try:
        soak.start_run()
        code = soak.drive(schedule)
        report = {"exit": code, "faults": soak.events, "wall_s": round(time.monotonic() - started)}
        report.update(soak.check())
    finally:
        soak.server.stop()
    report["ok"] = (
        code == 0
        and len(soak.events) == len(faults)
        and not report["duplicated_points"]
        and not report["missing_points"]
        and report["reward_last10"] >= args.min_reward
        and not report["processes_left"]
        and all(v == "ok" for v in report["checkpoints"].values())
    )
    if not with_disk:
        report["left_out"] = "disk_full: no user/mount namespace for a tmpfs here"
    if args.keep:
        report["folder"] = str(root)
    else:
        shutil.rmtree(root, ignore_errors=True)
    return report


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=700, help="GRPO steps (quickstart: 700)")
    parser.add_argument("--seed", type=int, default=0, help="where the faults fall")
    parser.add_argument("--spacing", type=int, default=60, help="least steps between faults")
    parser.add_argument("--checkpoint-every", type=int, default=25)
    parser.add_argument("--outage-s", type=float, default=120.0)
    parser.add_argument("--tmpfs-mib", type=int, default=256)
    parser.add_argument("--min-reward", type=float, default=0.75)
    parser.add_argument("--keep", action="store_true", help="keep the soak's folder")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--in-namespace", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    namespaced = args.in_namespace
    if not namespaced and shutil.which("unshare"):
        probe = subprocess.run(["unshare", "-rm", "true"], capture_output=True)
        if probe.returncode == 0:
            os.execvp("unshare", ["unshare", "-rm", sys.executable, *sys.argv, "--in-namespace"])
    report = inner(args, with_disk=namespaced)
    text = json.dumps(report, indent=1)
    print(text)
    if args.json:
        args.json.write_text(text)
    sys.exit(0 if report["ok"] else 1)


if __name__ == "__main__":
    main()

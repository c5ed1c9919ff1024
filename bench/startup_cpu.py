"""Time to the first RL step: how long a `mtprun` run takes from its start to its first GRPO
step, split by its log's landmarks (the run folder's log.txt, millisecond timestamps).

Runs `mtprun RECIPE trainer.steps=N [KEY=VALUE ...]` in a fresh run folder --repeat times and
prints one JSON row a run: seconds from the process start to the first stage (Ray up), to the
trainer ready, to the RL stage's start, to its engines ready, to its first step, and the whole
run. --tree runs another checkout's mtprun (its folder put first on PYTHONPATH), so two trees
alternate on one machine:

    python bench/startup_cpu.py --label new --repeat 3
    python bench/startup_cpu.py --label old --tree /tmp/old --repeat 3
    python bench/startup_cpu.py --label new -- warmstart=null   # RL from the start
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MTPRUN = Path(sys.executable).with_name("mtprun")

# Log landmarks, first occurrence each (the RL stage's are those after "stage grpo").
LANDMARKS = {
    "first_stage": r"^stage ",  # logged once Ray is up
    "trainer_ready": r"^trainer ready",
    "rl_stage": r"^stage grpo",
    "engines_ready": r"^rollout engines ready",
}
STEP = re.compile(r"^step (\d+) \| reward")
LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) \w+ (.*)$")


def parse_log(log: Path, started: float) -> dict[str, float]:
    """Seconds after `started` (the process start, epoch seconds) of each landmark."""
    seen: dict[str, float] = {}
    for line in log.read_text().splitlines():
        match = LINE.match(line)
        if not match:
            continue
        at = datetime.strptime(match[1], "%Y-%m-%d %H:%M:%S,%f").timestamp() - started
        message = match[2]
        for name, pattern in LANDMARKS.items():
            if name not in seen and re.search(pattern, message):
                seen[name] = round(at, 2)
        if "first_rl_step" not in seen and STEP.match(message):
            seen["first_rl_step"] = round(at, 2)
    return seen


def run_once(recipe: Path, steps: int, overrides: list[str], tree: Path | None) -> dict:
    env = dict(os.environ)
    if tree is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(tree), env.get("PYTHONPATH", "")])
    with tempfile.TemporaryDirectory(prefix="startup") as root:
        run_dir = Path(root) / "run"
        command = [str(MTPRUN), str(recipe), f"run_dir={run_dir}", f"trainer.steps={steps}"]
        started = time.time()
        done = subprocess.run(
            [*command, *overrides], cwd=root, env=env, capture_output=True, text=True
        )
        total = time.time() - started
        if done.returncode != 0:
            raise SystemExit(f"the run failed ({done.returncode}):\n{done.stderr[-3000:]}")
        return {**parse_log(run_dir / "log.txt", started), "total": round(total, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", type=Path, default=REPO / "recipes" / "quickstart.yaml")
    parser.add_argument("--steps", type=int, default=2, help="trainer.steps of the RL stage")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--tree", type=Path, help="a checkout whose mtprun runs instead")
    parser.add_argument("--label", default="")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    args = parser.parse_args()
    for _ in range(args.repeat):
        row = run_once(args.recipe, args.steps, args.overrides, args.tree)
        print(json.dumps({"label": args.label, **row}), flush=True)


if __name__ == "__main__":
    main()

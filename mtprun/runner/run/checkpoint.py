"""Checkpoint folders: written under a temporary name, published by one atomic rename.

    checkpoints/step_000012/
      trainer_rank0.pt ...   each trainer rank's state_dict (model, optimizer, schedule, step)
      hf/                    the policy as an HF folder (what `mtprun export` hands out;
                             with LoRA its merged weights, `mtprun export --merge`)
      adapter/               with LoRA: the adapters as a PEFT adapter folder (`mtprun export`)
      driver.json            the loop's own position (step, stage) and the metrics of the step
    checkpoints/latest       the step number of the newest complete checkpoint

A crash while writing leaves only a `.partial` folder, which is ignored and replaced. A write
the filesystem refuses (no space, quota) removes its partial folder and fails the run with
`CheckpointWriteError`; the newest complete checkpoint stays loadable for `mtprun resume`.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

from mtprun.runner.run_dir import write_json_atomic

_PREFIX = "step_"


def step_dir(root: Path, step: int) -> Path:
    return root / f"{_PREFIX}{step:06d}"


class CheckpointWriteError(RuntimeError):
    """A checkpoint the filesystem would not take; the message says what to do."""


def write(root: Path, step: int, fill: Callable[[Path], None], driver_state: dict) -> Path:
    """Checkpoint `step`: `fill(folder)` writes the state into a partial folder, which is then
    published. A failure on the way removes the partial folder; an OSError, or any error while
    the filesystem is full (torch.save reports ENOSPC as a RuntimeError; Ray re-raises a
    trainer actor's error as a subclass of its type), becomes CheckpointWriteError."""
    partial = begin(root, step)
    try:
        fill(partial)
        return publish(partial, driver_state)
    except Exception as error:
        free_mib = shutil.disk_usage(root).free / 2**20  # before the partial folder goes
        shutil.rmtree(partial, ignore_errors=True)
        full = free_mib < _FULL_MIB
        if isinstance(error, OSError) or full:
            raise CheckpointWriteError(_refused(root, step, error, free_mib, full)) from error
        raise


_FULL_MIB = 64  # less free space than this after a failed write: the filesystem was full


def _refused(root: Path, step: int, error: Exception, free_mib: float, full: bool) -> str:
    cause = getattr(error, "cause", None) or error  # Ray's task error carries the original
    reason = getattr(cause, "strerror", None) or str(cause).splitlines()[-1]
    if full:
        reason = f"no space left on the filesystem ({reason})"
    newest = latest(root)
    kept = (
        f"checkpoint {newest} is intact"
        if newest is not None
        else "no earlier checkpoint exists, so a resume starts over"
    )
    return (
        f"checkpoint of step {step} could not be written under {root}: {reason}, "
        f"{free_mib:.0f} MiB free there; {kept}. Free space there (or keep fewer: "
        f"trainer.keep_checkpoints) and continue with `mtprun resume {root.parent}`"
    )


def begin(root: Path, step: int) -> Path:
    """A fresh, empty folder to write checkpoint `step` into."""
    partial = step_dir(root, step).with_suffix(".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    return partial


def publish(partial: Path, driver_state: dict) -> Path:
    """Make a fully written `partial` folder the checkpoint of its step."""
    step = int(driver_state["step"])
    write_json_atomic(partial / "driver.json", driver_state)
    final = step_dir(partial.parent, step)
    if final.exists():  # re-saving the same step (e.g. a stop right after a periodic save)
        shutil.rmtree(final)
    os.replace(partial, final)
    latest = partial.parent / "latest"
    latest.with_suffix(".tmp").write_text(str(step))
    os.replace(latest.with_suffix(".tmp"), latest)
    return final


def prune(root: Path, keep: int, protected: set[int]) -> list[int]:
    """Delete all but the newest `keep` complete checkpoints, never one in `protected`;
    returns the deleted steps. The newest stays whatever `protected` says."""
    done = steps(root)
    deleted = [step for step in done[:-keep] if step not in protected]
    for step in deleted:
        shutil.rmtree(step_dir(root, step))
    return deleted


def steps(root: Path) -> list[int]:
    """Steps of the complete checkpoints under `root`, ascending."""
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        name = path.name
        if name.startswith(_PREFIX) and name[len(_PREFIX) :].isdigit() and path.is_dir():
            found.append(int(name[len(_PREFIX) :]))
    return sorted(found)


def latest(root: Path) -> int | None:
    """Step of the newest complete checkpoint, or None."""
    pointer = root / "latest"
    if pointer.exists():
        step = int(pointer.read_text())
        if step_dir(root, step).is_dir():
            return step
    done = steps(root)
    return done[-1] if done else None


def resolve(root: Path, step: int | None) -> Path:
    """Folder of checkpoint `step` (None = the newest), with a clear error when missing."""
    available = steps(root)
    if not available:
        raise FileNotFoundError(f"no checkpoint under {root}: the run saved none yet")
    if step is None:
        step = latest(root)
    if step not in available:
        raise FileNotFoundError(
            f"no checkpoint for step {step} under {root}; available steps: "
            + ", ".join(map(str, available))
        )
    return step_dir(root, step)

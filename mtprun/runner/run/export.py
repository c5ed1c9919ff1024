"""`mtprun export`: a checkpoint's policy folder (mtprun.runner.policy_folder) copied out."""

from __future__ import annotations

import shutil
from pathlib import Path

from mtprun.runner.policy_folder import ADAPTER_FOLDER, HF_FOLDER
from mtprun.runner.run import checkpoint


def export_checkpoint(
    checkpoints: Path, step: int | None, out_dir: Path, merged: bool = False
) -> Path:
    """Copy the policy of checkpoint `step` (None = newest) to `out_dir`: a LoRA checkpoint's
    PEFT adapter folder, or with `merged` its HF folder of merged weights; a full fine-tune's
    HF folder (`merged` is then a ValueError: there is nothing to merge)."""
    folder = checkpoint.resolve(checkpoints, step)
    lora = (folder / ADAPTER_FOLDER).is_dir()
    if merged and not lora:
        raise ValueError(
            f"{folder} trained every weight (no model.lora): its export is a full HF folder "
            "already, there are no adapters to merge; leave out --merge"
        )
    source = folder / (ADAPTER_FOLDER if lora and not merged else HF_FOLDER)
    if not source.is_dir():
        raise FileNotFoundError(f"{source} is missing: the checkpoint was written incompletely")
    if out_dir.exists():
        shutil.rmtree(out_dir)
    shutil.copytree(source, out_dir)
    return out_dir

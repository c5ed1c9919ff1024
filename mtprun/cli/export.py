"""`mtprun export RUN_DIR [--step N] [--out DIR] [--merge]`: a checkpoint's policy as an HF
folder, or a LoRA run's adapters as a PEFT adapter folder (`--merge`: its merged HF folder)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mtprun.cli.diagnostics import EXIT_INVALID


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "export",
        help="Write a checkpoint's policy as an HF folder, or a LoRA run's PEFT adapter folder "
        "(both load in transformers/peft and vLLM).",
        description="Copy the policy of checkpoint --step (default: the newest) of the run in "
        "RUN_DIR to an HF model folder: config, tokenizer and model.safetensors. A LoRA run "
        "(model.lora) exports its adapters as a PEFT adapter folder (adapter_config.json, "
        "adapter_model.safetensors), or with --merge the HF folder of the merged weights.",
    )
    parser.add_argument("run_dir", type=Path, metavar="RUN_DIR")
    parser.add_argument("--step", type=int, help="Checkpoint step (default: the newest).")
    parser.add_argument(
        "--out", type=Path, help="Output folder (default: RUN_DIR/export/step_<N>)."
    )
    parser.add_argument(
        "--merge",
        action="store_true",
        help="LoRA runs: the HF folder of the merged weights (W + alpha / r B A) instead of "
        "the adapter folder.",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from mtprun.runner.run import checkpoint
    from mtprun.runner.run.export import export_checkpoint
    from mtprun.runner.run_dir import RunDir

    run_dir = RunDir(args.run_dir)
    try:
        run_dir.read_state()
        step = args.step if args.step is not None else checkpoint.latest(run_dir.checkpoints)
        if step is None:
            raise FileNotFoundError(f"no checkpoint under {run_dir.checkpoints} yet")
        out = args.out or run_dir.exports / f"step_{step}"
        export_checkpoint(run_dir.checkpoints, step, out, merged=args.merge)
    except (FileNotFoundError, ValueError) as err:
        print(f"mtprun export: {err}", file=sys.stderr)
        return EXIT_INVALID
    print(f"exported step {step} to {out}")
    return 0

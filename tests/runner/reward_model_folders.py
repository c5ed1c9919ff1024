"""Tiny reward-model folders built locally: a random-init Qwen2 sequence classifier (the
shape of the runner tests' tiny policy, a one-label `score` head) with the chatml character
tokenizer and its chat template."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForSequenceClassification, PreTrainedTokenizerBase

from mtprun.models.tiny import tiny_config
from mtprun.spec.model import TinyModel

from .conftest import TINY


def build_tiny_classifier(tokenizer: PreTrainedTokenizerBase, out_dir: Path, seed: int) -> Path:
    """A random-init `Qwen2ForSequenceClassification` folder (float32) in `out_dir`."""
    config = tiny_config(TinyModel(architecture="qwen2", **TINY), tokenizer)
    config.num_labels = 1
    config.architectures = ["Qwen2ForSequenceClassification"]
    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_config(config)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return Path(out_dir)

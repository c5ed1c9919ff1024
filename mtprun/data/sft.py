"""SFT data end to end: a recipe's `data:` section -> conversations -> packed batches."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from mtprun.data.batch import PackedBatch
from mtprun.data.dataset_files import Records
from mtprun.data.mask import MaskPolicy
from mtprun.data.messages import Conversation
from mtprun.data.packing import pack
from mtprun.data.prompts import read_conversations
from mtprun.data.render import Renderer
from mtprun.data.tasks import TASKS, get_task

if TYPE_CHECKING:
    from mtprun.spec.data import DataSection


def load_conversations(
    data: DataSection, seed: int, cache_dir: str | Path | None = None
) -> Records[Conversation]:
    """`data.num_samples` demonstrations of the synthetic task named by `data.source`, or
    every good conversation of the dataset it names (bad rows in `.errors`)."""
    from mtprun.spec.data import DatasetSpec

    source = data.source
    if isinstance(source, str) and source in TASKS:
        return Records(get_task(source).sft_examples(data.num_samples, seed))
    spec = source if isinstance(source, DatasetSpec) else DatasetSpec(path=source)
    return read_conversations(spec, cache_dir)


def sft_batches(
    conversations: Sequence[Conversation],
    renderer: Renderer,
    mask: MaskPolicy,
    packing_length: int,
) -> list[PackedBatch]:
    """Render every conversation and pack them in order."""
    sequences = [renderer.render(c) for c in conversations]
    return pack(sequences, mask, packing_length, pad_id=renderer.tokenizer.pad_token_id)

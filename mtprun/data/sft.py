"""SFT data end to end: a recipe's `data:` section -> conversations -> packed batches."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from mtprun.data.batch import PackedBatch
from mtprun.data.jsonl import Records, read_conversations
from mtprun.data.mask import MaskPolicy
from mtprun.data.messages import Conversation
from mtprun.data.packing import pack
from mtprun.data.render import Renderer
from mtprun.data.tasks import TASKS, get_task

if TYPE_CHECKING:
    from mtprun.spec.data import DataSection


def load_conversations(data: DataSection, seed: int) -> Records[Conversation]:
    """`data.num_samples` demonstrations of the synthetic task named by `data.source`, or
    every good record of the `.jsonl` file it names (bad lines in `.errors`)."""
    if data.source in TASKS:
        return Records(get_task(data.source).sft_examples(data.num_samples, seed))
    return read_conversations(data.source)


def sft_batches(
    conversations: Sequence[Conversation],
    renderer: Renderer,
    mask: MaskPolicy,
    packing_length: int,
) -> list[PackedBatch]:
    """Render every conversation and pack them in order."""
    sequences = [renderer.render(c) for c in conversations]
    return pack(sequences, mask, packing_length, pad_id=renderer.tokenizer.pad_token_id)

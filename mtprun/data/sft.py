"""SFT data end to end: a recipe's `data:` section -> conversations -> packed rows.

`PackedSft` keeps what packing needs and no tokens: one token count per conversation, found
by rendering each once (with its row's tool specs, which the chat template prints), and
where each packed row starts. A row is rendered and packed again
when a step asks for it, so a dataset of a million conversations costs a few arrays of a
million integers, not its tokens.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from mtprun.data.batch import PackedBatch
from mtprun.data.mask import MaskPolicy
from mtprun.data.messages import Conversation
from mtprun.data.packing import bins, pack
from mtprun.data.prompts import ConversationDataset
from mtprun.data.render import RenderedSequence, Renderer
from mtprun.data.tasks import TASKS, get_task

if TYPE_CHECKING:
    from mtprun.data.dataset_files import RecordError
    from mtprun.spec.data import DataSection

log = logging.getLogger(__name__)


def load_conversations(
    data: DataSection, seed: int, cache_dir: str | Path | None = None
) -> Sequence[Conversation]:
    """`data.num_samples` demonstrations of the synthetic task named by `data.source`, or
    the good conversations of the dataset it names (a `ConversationDataset`, bad rows in its
    `.errors`)."""
    from mtprun.spec.data import DatasetSpec

    source = data.source
    if isinstance(source, str) and source in TASKS:
        return get_task(source).sft_examples(data.num_samples, seed)
    spec = source if isinstance(source, DatasetSpec) else DatasetSpec(path=source)
    return ConversationDataset(spec, cache_dir)


class PackedSft(Sequence[PackedBatch]):
    """`conversations` rendered and packed in order into rows of at most `packing_length`
    tokens (the same rows as `pack` over all of them), each row built when it is indexed.

    A dataset conversation longer than a row is a bad row: logged with its file and row
    (`.errors`) and left out. A synthetic task's is an error of the recipe (ValueError).
    """

    def __init__(
        self,
        conversations: Sequence[Conversation],
        renderer: Renderer,
        mask: MaskPolicy,
        packing_length: int,
        cache_dir: Path | None = None,
    ) -> None:
        """`cache_dir`: where a dataset's token counts are kept, so that the next start on
        the same files and tokenizer (a resume) does not render every conversation again."""
        self._conversations, self._renderer = conversations, renderer
        self._mask, self._packing_length = mask, packing_length
        if cache_dir is not None and isinstance(conversations, ConversationDataset):
            lengths = _cached_token_counts(conversations, renderer, cache_dir)
        else:
            lengths = _token_counts(conversations, renderer)
        fits = lengths <= packing_length
        self.errors = [self._too_long(int(i), int(lengths[i])) for i in np.flatnonzero(~fits)]
        self._kept = np.flatnonzero(fits)
        if not len(self._kept):
            raise ValueError(
                f"no conversation fits data.packing_length={packing_length} tokens "
                f"(the shortest has {lengths.min()} tokens); raise data.packing_length"
            )
        ranges = bins(lengths[self._kept].tolist(), packing_length)
        self._starts = np.array([start for start, _ in ranges] + [len(self._kept)])

    def __len__(self) -> int:
        return len(self._starts) - 1

    def __getitem__(self, row: int) -> PackedBatch:  # type: ignore[override]
        if not -len(self) <= row < len(self):
            raise IndexError(f"packed row {row} of {len(self)}")
        row %= len(self)
        members = self._kept[self._starts[row] : self._starts[row + 1]]
        sequences = [
            sequence
            for i in members
            for sequence in training_sequences(self._conversations, int(i), self._renderer)
        ]
        pad = self._renderer.tokenizer.pad_token_id
        (batch,) = pack(sequences, self._mask, self._packing_length, pad_id=pad)
        return batch

    @property
    def conversation_count(self) -> int:
        """How many conversations the rows hold."""
        return len(self._kept)

    def _too_long(self, index: int, tokens: int) -> RecordError:
        longer = f"{tokens} tokens, longer than data.packing_length={self._packing_length}"
        if not isinstance(self._conversations, ConversationDataset):
            raise ValueError(f"SFT example {index} has {longer}; raise data.packing_length")
        error = self._conversations.where(
            index, f"{longer}: left out (raise data.packing_length to train on it)"
        )
        log.warning("skipping bad record %s", error)
        return error


def training_sequences(
    conversations: Sequence[Conversation], index: int, renderer: Renderer
) -> list[RenderedSequence]:
    """What SFT trains on conversation `index` (`Renderer.render_training`), a dataset row's
    tool specs printed before it."""
    if isinstance(conversations, ConversationDataset):
        conversation, tools = conversations.example(index)
        return renderer.render_training(conversation, tools)
    return renderer.render_training(conversations[index])


_PROGRESS_EVERY_S = 15.0


def _cached_token_counts(
    dataset: ConversationDataset, renderer: Renderer, cache_dir: Path
) -> np.ndarray:
    """`_token_counts`, read from `cache_dir` when an earlier start counted the same
    conversations (same files, column mapping and tokenizer) with the same renderer."""
    key = hashlib.sha256(f"{dataset.fingerprint} {renderer.fingerprint}".encode()).hexdigest()
    path = cache_dir / f"sft-token-counts-{key[:24]}.npy"
    if path.is_file():
        counts = np.load(path)
        if len(counts) == len(dataset):
            log.info("SFT data: token counts of %d conversations from %s", len(counts), path)
            return counts
    counts = _token_counts(dataset, renderer)
    cache_dir.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.stem}.{os.getpid()}.partial.npy")
    np.save(partial, counts)
    partial.replace(path)  # atomic: a killed run leaves no half-written counts
    return counts


def _token_counts(conversations: Sequence[Conversation], renderer: Renderer) -> np.ndarray:
    """Each conversation's rendered length (all its training sequences); a log line every
    15 s while a large dataset is counted (a million conversations take minutes)."""
    counts = np.empty(len(conversations), dtype=np.int64)
    last = time.monotonic()
    for i in range(len(conversations)):
        counts[i] = sum(len(s) for s in training_sequences(conversations, i, renderer))
        if time.monotonic() - last > _PROGRESS_EVERY_S:
            done = f"{i + 1} of {len(conversations)}"
            log.info("SFT data: %s conversations rendered to count their tokens", done)
            last = time.monotonic()
    return counts

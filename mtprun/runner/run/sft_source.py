"""SFT batches for the trainer: one packed row of the stage's data per data-parallel replica
and step (`PackedSft`: the packing is planned once, a row is built when its step comes).

Step s (1-based) trains rows (s-1) dp .. s dp - 1 of the row stream, replica d the d-th of
them (`TrainerGroup.train_step` hands micro batch d to replica d); with dp = 1 that is one row
a step. The stream is a pure function of the seed: epoch e visits every row once in an order
drawn from seed + e. A resumed run therefore trains on exactly the rows it would have trained
on without the interruption, with no data-loader state in the checkpoint.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from mtprun.data.batch import PackedBatch
from mtprun.data.render import folder_renderer
from mtprun.data.sft import PackedSft, load_conversations
from mtprun.spec import Recipe

log = logging.getLogger("mtprun")


class SftSource:
    def __init__(self, recipe: Recipe, model_dir: Path) -> None:
        data = recipe.data
        if data is None:
            raise ValueError("an SFT stage needs a `data:` section")
        # Both log the bad rows they skip.
        cache = Path(recipe.run_dir) / "datasets"
        conversations = load_conversations(data, recipe.seed, cache)
        renderer = folder_renderer(model_dir, data.renderer)
        self.rows = PackedSft(conversations, renderer, recipe.mask, data.packing_length, cache)
        self.seed = recipe.seed
        self.rows_per_step = recipe.parallel.dp  # one packed row per data-parallel replica
        log.info(
            "SFT data %s: %d conversations in %d packed rows of <= %d tokens",
            data.source if isinstance(data.source, str) else data.source.path,
            self.rows.conversation_count,
            len(self.rows),
            data.packing_length,
        )

    def batches(self, step: int) -> list[PackedBatch]:
        """The micro batches of stage step `step` (1-based): `rows_per_step` packed rows, the
        next ones of the row stream."""
        first = (step - 1) * self.rows_per_step
        return [self._row(n) for n in range(first, first + self.rows_per_step)]

    def _row(self, n: int) -> PackedBatch:
        """Row n (0-based) of the stream: epoch n // len(rows), in that epoch's order."""
        epoch, index = divmod(n, len(self.rows))
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        order = torch.randperm(len(self.rows), generator=generator)
        return self.rows[int(order[index])]

"""A micro batch's two halves through the decoder layers on two CUDA streams, so that under
expert parallelism one half's token exchange runs while the other half computes.

Run whole, each MoE layer's all-to-alls (dispatch, combine and their backwards) sit on the
critical path: the layer's experts wait for the dispatch, the next layer's attention for the
combine. Cut at a sequence boundary (attention stays within a sequence and the experts take
tokens one at a time, so the halves never meet), each layer runs half A on stream A, then half
B on stream B. A collective blocks only the stream that issued it, so while A waits in NCCL
the GPU runs B's attention, router or experts, and the other way round. The host issues A's
layer before B's and waits once a layer for each half (the dispatcher reads its split sizes
back); by then the other half's work is queued, so the GPU stays busy. The backward needs no
schedule of its own: autograd runs each node on the stream its forward ran on, in the reverse
of the order the forward made them, so the halves alternate layer by layer there too.

What crosses the streams:
- the halves are `split` views of the layers' input on the caller's stream, which both
  streams wait for; the caller's stream waits for both before `cat` joins their outputs, and
  runs nothing between the two, so none of its memory is reused while a half reads it;
- both halves add into the same weights' main gradients in backward: those adds run one at a
  time on the stream autograd accumulates gradients on (`mtprun.kernels.main_grad`).

The halves compute exactly what the whole micro batch does (tested against one pass, forward
and gradients) where `mtprun.preflight.exchange_overlap.halves_blocker` lets the trainer halve
it: not, for one, under the router's load-balancing loss, which is no sum over tokens (each
half's routing would be balanced on its own).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from itertools import accumulate

import torch

from mtprun.runner.trainer.attention import PackedRows


def halves_cut(lengths: Sequence[int]) -> int | None:
    """How many of a packed row's sequences (`lengths`, in order) go to the first half: the
    boundary nearest half the row's tokens. None for a row of one sequence."""
    if len(lengths) < 2:
        return None
    total = sum(lengths)
    ends = list(accumulate(lengths))[:-1]
    return 1 + min(range(len(ends)), key=lambda i: abs(2 * ends[i] - total))


class HalfBatchStreams:
    """The two side streams of one device, and the layers run over two halves on them (on a
    CPU, where there are no streams, one half after the other: what the tests compare)."""

    def __init__(self, device: torch.device) -> None:
        cuda = torch.device(device).type == "cuda"
        self.streams = (torch.cuda.Stream(device), torch.cuda.Stream(device)) if cuda else None

    def run_layers(
        self, layers: Sequence[torch.nn.Module], hidden: torch.Tensor, halves: Sequence[PackedRows]
    ) -> torch.Tensor:
        """hidden [T, 1, H], the halves' rows (their tokens in order, summing to T) -> the
        layers' output [T, 1, H] on the caller's stream."""
        parts = list(hidden.split([rows.cos.shape[0] for rows in halves]))
        caller = torch.cuda.current_stream(hidden.device) if self.streams else None
        for stream in self.streams or ():
            stream.wait_stream(caller)
        for layer in layers:
            for i, rows in enumerate(halves):
                with self._on(i):
                    parts[i], _ = layer(hidden_states=parts[i], attention_mask=rows)
        for stream in self.streams or ():
            caller.wait_stream(stream)
        return torch.cat(parts)

    def _on(self, half: int) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(self.streams[half]) if self.streams else contextlib.nullcontext()

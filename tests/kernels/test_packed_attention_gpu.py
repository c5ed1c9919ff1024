"""Packed attention on a CUDA GPU (one process): the row's sequences in length groups
(`LengthGroups`, one causal SDPA per group of like lengths), bf16, against a float32
per-sequence reference and against FlexAttention over the whole row: output and q/k/v
gradients, for a long-tailed RL row, a row of many short sequences and a row of equal ones.
Also its time against FlexAttention's (printed with `-s`). Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from mtprun.runner.trainer.attention import _flex, packed_attention_mask, packed_block_mask
from mtprun.runner.trainer.context_parallel import TokenShard
from mtprun.runner.trainer.length_groups import LengthGroups, grouped_attention

from .attention_reference import (
    milliseconds,
    output_and_grads,
    per_sequence_reference,
    row_boundaries,
)
from .gated_delta_reference import relative_error

pytestmark = pytest.mark.gpu

HEADS, GROUPS, DIM = 16, 8, 128
# Micro batches of up to 16384 tokens: a long-tailed draw's two long sequences among short ones
# (first, between and last), one long sequence in the middle, many short sequences of unlike
# lengths, and equal sequences (the row itself is the batch).
CASES = {
    "two_long": [900, 7000, 300, 1200, 5000, 1000, 984],
    "one_long": [512, 256, 9000, 2000, 3000, 1616],
    "many_short": [37 + (i * 977) % 600 for i in range(41)],
    "equal": [2048] * 8,
}
TOLERANCE = 2e-2  # relative to the largest reference entry: bf16 rounding


def _inputs(tokens: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator("cuda").manual_seed(seed)
    shapes = [(tokens, 1, HEADS, DIM), (tokens, 1, GROUPS, DIM), (tokens, 1, GROUPS, DIM)]
    leaves = [torch.randn(*s, device="cuda", generator=g).bfloat16() for s in shapes]
    grad = torch.randn(tokens, 1, HEADS * DIM, device="cuda", generator=g).bfloat16()
    return [*leaves, grad]


@pytest.mark.parametrize("case", CASES)
def test_length_groups_match_the_reference_as_flex_does(case):
    lengths = CASES[case]
    cu_seqlens, shard = row_boundaries(lengths).cuda(), TokenShard(0, 1, sum(lengths))
    groups = packed_attention_mask(cu_seqlens, lengths, shard, "cuda")
    assert isinstance(groups, LengthGroups)
    # Sequences of a few thousand tokens each alone on the row, equal ones one batch (the row
    # itself either way); many short ones gathered into a few padded groups.
    assert (groups.gather is None) == (case != "many_short")
    assert len(groups.shapes) == {"many_short": 5, "equal": 1}.get(case, len(lengths))
    q, k, v, grad = _inputs(sum(lengths), seed=len(lengths))
    want = output_and_grads(lambda *t: per_sequence_reference(*t, lengths), q, k, v, grad)
    ours = output_and_grads(lambda *t: grouped_attention(*t, groups), q, k, v, grad)
    whole = packed_block_mask(cu_seqlens, shard, "cuda")
    flex = output_and_grads(lambda *t: _flex(*t, whole), q, k, v, grad)
    for name, a, b, c in zip(("out", "dq", "dk", "dv"), ours, want, flex, strict=True):
        error, flex_error = relative_error(a, b), relative_error(c, b)
        print(f"{case} {name}: length groups {error:.1e}, flex {flex_error:.1e}")
        assert torch.isfinite(a).all(), name
        assert error < max(TOLERANCE, 2 * flex_error), name

    def forward_backward(attend):
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        return lambda: torch.autograd.grad(attend(*leaves), leaves, grad)

    ours_ms = milliseconds(forward_backward(lambda *t: grouped_attention(*t, groups)))
    flex_ms = milliseconds(forward_backward(lambda *t: _flex(*t, whole)))
    print(
        f"{case}: {len(groups.shapes)} groups, forward+backward ms: length groups "
        f"{ours_ms:.2f}, flex {flex_ms:.2f}"
    )

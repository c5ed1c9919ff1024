"""Packed attention on a CUDA GPU for a long-tailed row (one process): sequences of at least
LONG_SEQUENCE tokens through SDPA on their spans, the others through FlexAttention under a
mask that leaves those out (`SequenceSpans` with `rest`), bf16, against a float32
per-sequence reference and against FlexAttention over the whole row: output and q/k/v
gradients. Also its time against FlexAttention's (printed with `-s`). Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from mtprun.runner.trainer.attention import (
    LONG_SEQUENCE,
    SequenceSpans,
    _flex,
    _sdpa_spans,
    packed_attention_mask,
    packed_block_mask,
)
from mtprun.runner.trainer.context_parallel import TokenShard

from .attention_reference import (
    milliseconds,
    output_and_grads,
    per_sequence_reference,
    row_boundaries,
)
from .gated_delta_reference import relative_error

pytestmark = pytest.mark.gpu

HEADS, GROUPS, DIM = 16, 8, 128
# A 16384-token micro batch of a long-tailed draw: two long sequences among short ones
# (first, between and last), and one with a single long sequence in the middle.
CASES = {
    "two_long": [900, 7000, 300, 1200, 5000, 1000, 984],
    "one_long": [512, 256, 9000, 2000, 3000, 1616],
}
TOLERANCE = 2e-2  # relative to the largest reference entry: bf16 rounding


def _inputs(tokens: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator("cuda").manual_seed(seed)
    shapes = [(tokens, 1, HEADS, DIM), (tokens, 1, GROUPS, DIM), (tokens, 1, GROUPS, DIM)]
    leaves = [torch.randn(*s, device="cuda", generator=g).bfloat16() for s in shapes]
    grad = torch.randn(tokens, 1, HEADS * DIM, device="cuda", generator=g).bfloat16()
    return [*leaves, grad]


@pytest.mark.parametrize("case", CASES)
def test_long_sequences_by_sdpa_and_the_rest_by_flex(case):
    lengths = CASES[case]
    cu_seqlens, shard = row_boundaries(lengths).cuda(), TokenShard(0, 1, sum(lengths))
    spans = packed_attention_mask(cu_seqlens, lengths, shard, "cuda")
    assert isinstance(spans, SequenceSpans) and spans.rest is not None
    assert len(spans.spans) == sum(n >= LONG_SEQUENCE for n in lengths)
    q, k, v, grad = _inputs(sum(lengths), seed=len(lengths))
    want = output_and_grads(lambda *t: per_sequence_reference(*t, lengths), q, k, v, grad)
    ours = output_and_grads(lambda *t: _sdpa_spans(*t, spans), q, k, v, grad)
    whole = packed_block_mask(cu_seqlens, shard, "cuda")
    flex = output_and_grads(lambda *t: _flex(*t, whole), q, k, v, grad)
    for name, a, b, c in zip(("out", "dq", "dk", "dv"), ours, want, flex, strict=True):
        error, flex_error = relative_error(a, b), relative_error(c, b)
        print(f"{case} {name}: spans + flex {error:.1e}, flex alone {flex_error:.1e}")
        assert torch.isfinite(a).all(), name
        assert error < max(TOLERANCE, 2 * flex_error), name

    def forward_backward(attend):
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        return lambda: torch.autograd.grad(attend(*leaves), leaves, grad)

    ours_ms = milliseconds(forward_backward(lambda *t: _sdpa_spans(*t, spans)))
    flex_ms = milliseconds(forward_backward(lambda *t: _flex(*t, whole)))
    print(f"{case}: forward+backward ms, spans + flex {ours_ms:.2f}, flex alone {flex_ms:.2f}")

"""Packed attention on a CUDA GPU for a long-tailed row (one process): sequences of at least
LONG_SEQUENCE tokens through SDPA on their spans, the others through FlexAttention under a
mask that leaves those out (`SequenceSpans` with `rest`), bf16, against a float32
per-sequence reference and against FlexAttention over the whole row: output and q/k/v
gradients. Also its time against FlexAttention's (printed with `-s`). Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

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

pytestmark = pytest.mark.gpu

HEADS, GROUPS, DIM = 16, 8, 128
# A 16384-token micro batch of a long-tailed draw: two long sequences among short ones
# (first, between and last), and one with a single long sequence in the middle.
CASES = {
    "two_long": [900, 7000, 300, 1200, 5000, 1000, 984],
    "one_long": [512, 256, 9000, 2000, 3000, 1616],
}
TOLERANCE = 2e-2  # relative to the largest reference entry: bf16 rounding


def _cu_seqlens(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32).cuda()


def _inputs(tokens: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator("cuda").manual_seed(seed)
    shapes = [(tokens, 1, HEADS, DIM), (tokens, 1, GROUPS, DIM), (tokens, 1, GROUPS, DIM)]
    leaves = [torch.randn(*s, device="cuda", generator=g).bfloat16() for s in shapes]
    grad = torch.randn(tokens, 1, HEADS * DIM, device="cuda", generator=g).bfloat16()
    return [*leaves, grad]


def _reference(q, k, v, lengths):
    """float32 causal SDPA per sequence, keys repeated per query head."""
    q, k, v = (t.squeeze(1).transpose(0, 1).float() for t in (q, k, v))
    k, v = (t.repeat_interleave(HEADS // GROUPS, 0) for t in (k, v))
    outs, start = [], 0
    for n in lengths:
        s = slice(start, start + n)
        outs.append(
            F.scaled_dot_product_attention(
                q[None, :, s], k[None, :, s], v[None, :, s], is_causal=True
            )[0]
        )
        start += n
    return torch.cat(outs, 1).transpose(0, 1).flatten(1).unsqueeze(1)


def _output_and_grads(attend, q, k, v, grad):
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = attend(*leaves)
    return [out.detach(), *torch.autograd.grad(out, leaves, grad.to(out.dtype))]


def _relative(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


@pytest.mark.parametrize("case", CASES)
def test_long_sequences_by_sdpa_and_the_rest_by_flex(case):
    lengths = CASES[case]
    cu_seqlens, shard = _cu_seqlens(lengths), TokenShard(0, 1, sum(lengths))
    spans = packed_attention_mask(cu_seqlens, lengths, shard, "cuda")
    assert isinstance(spans, SequenceSpans) and spans.rest is not None
    assert len(spans.spans) == sum(n >= LONG_SEQUENCE for n in lengths)
    q, k, v, grad = _inputs(sum(lengths), seed=len(lengths))
    want = _output_and_grads(lambda *t: _reference(*t, lengths), q, k, v, grad)
    ours = _output_and_grads(lambda *t: _sdpa_spans(*t, spans), q, k, v, grad)
    whole = packed_block_mask(cu_seqlens, shard, "cuda")
    flex = _output_and_grads(lambda *t: _flex(*t, whole), q, k, v, grad)
    for name, a, b, c in zip(("out", "dq", "dk", "dv"), ours, want, flex, strict=True):
        error, flex_error = _relative(a, b), _relative(c, b)
        print(f"{case} {name}: spans + flex {error:.1e}, flex alone {flex_error:.1e}")
        assert torch.isfinite(a).all(), name
        assert error < max(TOLERANCE, 2 * flex_error), name

    def milliseconds(attend) -> float:
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        step = lambda: torch.autograd.grad(attend(*leaves), leaves, grad)  # noqa: E731
        step()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(5):
            step()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 5

    ours_ms = milliseconds(lambda *t: _sdpa_spans(*t, spans))
    flex_ms = milliseconds(lambda *t: _flex(*t, whole))
    print(f"{case}: forward+backward ms, spans + flex {ours_ms:.2f}, flex alone {flex_ms:.2f}")

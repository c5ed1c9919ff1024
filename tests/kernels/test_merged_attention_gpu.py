"""Context-parallel attention on a CUDA GPU through cuDNN blocks merged by log-sum-exp
(`SequencePieces`, `mtprun.kernels.merged_attention`): every rank of a simulated cp=2 group
(keys gathered by hand, as `gather_keys` lays them out) on an 8192-token row, bf16, 16 query
heads over 8 key heads of dim 128, against a float32 per-sequence reference and against
FlexAttention on the same rows: output and q/k/v gradients. Also which block kernel ran
(cuDNN with grouped heads by the kernel or repeated), when the pieces are taken, and their
time against FlexAttention's. Skipped without a GPU; errors and times print with `-s`."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from torch.nn.attention.flex_attention import BlockMask

from mtprun.kernels.merged_attention import block_kernel
from mtprun.runner.trainer.attention import (
    SPAN_LIMIT,
    SequencePieces,
    _flex,
    _merged_pieces,
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

TOKENS, HEADS, GROUPS, DIM, CP = 8192, 16, 8, 128, 2
CASES = {"one": [8192], "two": [3000, 5192], "three": [1000, 2500, 4692]}
# Relative to the largest reference entry: bf16 inputs and outputs round at 4e-3, and a
# merged piece rounds its blocks' outputs once more before the merge (bf16 on the CPU's
# flash kernel at 512 tokens: 1e-3 to 9e-3). Or twice FlexAttention's error, if larger.
TOLERANCE = 2e-2


def _inputs(seed: int) -> tuple[torch.Tensor, ...]:
    """Whole-row q [T, 1, H, d], k and v [T, 1, G, d], bf16, and an output gradient."""
    g = torch.Generator("cuda").manual_seed(seed)

    def draw(*shape):
        return torch.randn(*shape, device="cuda", generator=g).to(torch.bfloat16)

    q = draw(TOKENS, 1, HEADS, DIM)
    k, v = draw(TOKENS, 1, GROUPS, DIM), draw(TOKENS, 1, GROUPS, DIM)
    return q, k, v, draw(TOKENS, 1, HEADS * DIM)


def _row_attention(q, k, v, lengths, attend):
    """Whole-row q/k/v -> [T, 1, H * d]: each rank's queries through `attend(local q,
    gathered k, gathered v, shard)`, the keys of every rank gathered rank by rank (each
    padded to the width), each rank's output put back at its tokens."""
    shards = [TokenShard(rank, CP, TOKENS) for rank in range(CP)]

    def gathered(x):
        width = shards[0].width
        parts = [
            torch.cat([x[s.index], x.new_zeros(width - len(s.index), *x.shape[1:])]) for s in shards
        ]
        return torch.cat(parts)

    out = q.new_zeros(TOKENS, 1, HEADS * DIM)
    for shard in shards:
        index = shard.index.cuda()
        out = out.index_add(0, index, attend(q[index], gathered(k), gathered(v), shard))
    return out


def _pieces(lengths):
    cu_seqlens = row_boundaries(lengths).cuda()

    def attend(q, k, v, shard):
        pieces = SequencePieces.of(cu_seqlens, lengths, shard, "cuda")
        k, v = (t.index_select(0, pieces.key_order) for t in (k, v))  # as gather_keys does
        return _merged_pieces(q, k, v, pieces)

    return attend


def _flex_attend(lengths):
    cu_seqlens = row_boundaries(lengths).cuda()

    def attend(q, k, v, shard):
        return _flex(q, k, v, packed_block_mask(cu_seqlens, shard, "cuda"))

    return attend


def test_block_kernel_is_cudnn():
    kernel = block_kernel("cuda", torch.bfloat16)
    print(
        f"{torch.__version__} on {torch.cuda.get_device_name()}: block kernel {kernel.name}, "
        f"grouped heads {'by the kernel' if kernel.grouped else 'repeated'}"
    )
    assert kernel.name == "cudnn"
    assert block_kernel("cuda", torch.float32) is None


def test_pieces_are_taken_for_a_few_sequences_under_context_parallelism():
    shard = TokenShard(0, CP, TOKENS)
    few = CASES["three"]
    assert isinstance(
        packed_attention_mask(row_boundaries(few).cuda(), few, shard, "cuda"), SequencePieces
    )
    many = [TOKENS // (SPAN_LIMIT + 1)] * SPAN_LIMIT
    many.append(TOKENS - sum(many))
    assert isinstance(
        packed_attention_mask(row_boundaries(many).cuda(), many, shard, "cuda"), BlockMask
    )


@pytest.mark.parametrize("case", CASES)
def test_matches_float32_reference_and_flex_attention(case):
    lengths = CASES[case]
    q, k, v, grad = _inputs(seed=len(lengths))
    names = ("out", "dq", "dk", "dv")
    want = output_and_grads(lambda *t: per_sequence_reference(*t, lengths), q, k, v, grad)
    ours = output_and_grads(lambda *t: _row_attention(*t, lengths, _pieces(lengths)), q, k, v, grad)
    flex = output_and_grads(
        lambda *t: _row_attention(*t, lengths, _flex_attend(lengths)), q, k, v, grad
    )
    errors = {n: relative_error(a, b) for n, a, b in zip(names, ours, want, strict=True)}
    flex_errors = {n: relative_error(a, b) for n, a, b in zip(names, flex, want, strict=True)}
    print(f"pieces {case}: ", {n: f"{e:.1e}" for n, e in errors.items()})
    print(f"flex   {case}: ", {n: f"{e:.1e}" for n, e in flex_errors.items()})
    for name in names:
        assert errors[name] < max(TOLERANCE, 2 * flex_errors[name]), (name, flex_errors[name])


@pytest.mark.parametrize("case", ["one", "two"])
def test_time_against_flex_attention(case):
    """Forward and backward of rank 0's attention over the gathered keys, each mask built
    once beforehand as the trainer does per micro batch (printed only)."""
    lengths = CASES[case]
    cu_seqlens = row_boundaries(lengths).cuda()
    q, k, v, grad = _inputs(seed=7)
    shards = [TokenShard(rank, CP, TOKENS) for rank in range(CP)]
    assert len({len(s.index) for s in shards}) == 1  # no padding: gathered = concatenated
    index = shards[0].index.cuda()
    q_local, grad_local = q[index].requires_grad_(), grad[index]
    k_all, v_all = (torch.cat([t[s.index.cuda()] for s in shards]).requires_grad_() for t in (k, v))
    pieces = SequencePieces.of(cu_seqlens, lengths, shards[0], "cuda")
    mask = packed_block_mask(cu_seqlens, shards[0], "cuda")
    runs = {
        "pieces": lambda: _merged_pieces(
            q_local, k_all[pieces.key_order], v_all[pieces.key_order], pieces
        ),
        "flex": lambda: _flex(q_local, k_all, v_all, mask),
    }
    times = {}
    for name, attend in runs.items():

        def step(attend=attend):
            torch.autograd.grad(attend(), (q_local, k_all, v_all), grad_local)

        times[name] = milliseconds(step)
    print(
        f"rank 0 of cp={CP}, {case} {lengths}: forward+backward ms",
        {n: f"{t:.2f}" for n, t in times.items()},
    )

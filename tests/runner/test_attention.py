"""Packed attention: the FlexAttention block mask against the dense packed causal mask, its
output and the length groups' SDPA path's against a float64 reference (GQA, context-parallel
shares), the context-parallel pieces' merged attention for every rank of a simulated group
against the whole row's, how sequences are grouped, and recomputation modes against none."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from torch.nn.attention.flex_attention import flex_attention

from mtprun.models import ModelShape
from mtprun.runner.trainer.attention import (
    BLOCK,
    SequencePieces,
    _merged_pieces,
    packed_block_mask,
    packed_causal_mask,
)
from mtprun.runner.trainer.context_parallel import TokenShard
from mtprun.runner.trainer.length_groups import LengthGroups, grouped_attention
from mtprun.runner.trainer.model import load_policy_model

from .conftest import random_packed_batch


def _random_cu_seqlens(tokens: int, pieces: int, g: torch.Generator) -> torch.Tensor:
    cuts = torch.randperm(tokens - 1, generator=g)[: pieces - 1] + 1
    return torch.tensor([0, *sorted(cuts.tolist()), tokens], dtype=torch.int32)


def _block_mask_elements(mask) -> torch.Tensor:
    """[T, S] bool: what the BlockMask lets each query see, block class by block class (full
    blocks whole, partial ones through mask_mod, the rest nothing)."""
    tokens, keys = mask.seq_lengths
    rows, cols = -(-tokens // BLOCK), -(-keys // BLOCK)
    q = torch.arange(rows * BLOCK)[:, None]
    k = torch.arange(cols * BLOCK)[None, :]
    by_mod = mask.mask_mod(0, 0, q.clamp(max=tokens - 1), k.clamp(max=keys - 1))

    def classes(num, idx):
        out = torch.zeros(rows, cols, dtype=torch.bool)
        for r in range(rows):
            out[r, idx[0, 0, r, : num[0, 0, r]].long()] = True
        return out.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)

    full = classes(mask.full_kv_num_blocks, mask.full_kv_indices)
    partial = classes(mask.kv_num_blocks, mask.kv_indices)
    return (full | (partial & by_mod))[:tokens, :keys]


@pytest.mark.parametrize(
    ("tokens", "pieces", "cp"), [(700, 5, 1), (1000, 3, 2), (513, 9, 3), (300, 1, 2)]
)
def test_block_mask_sees_exactly_what_the_dense_mask_sees(tokens, pieces, cp):
    g = torch.Generator().manual_seed(tokens)
    cu_seqlens = _random_cu_seqlens(tokens, pieces, g)
    for rank in range(cp):
        shard = TokenShard(rank, cp, tokens)
        dense = ~packed_causal_mask(cu_seqlens, shard, "cpu")[0, 0]
        mask = packed_block_mask(cu_seqlens, shard, "cpu")
        assert mask.seq_lengths == tuple(dense.shape)
        assert torch.equal(_block_mask_elements(mask), dense)


def test_one_sequence_evaluates_the_mask_on_the_diagonal_blocks_only():
    blocks = 6
    tokens = blocks * BLOCK
    cu_seqlens = torch.tensor([0, tokens], dtype=torch.int32)
    mask = packed_block_mask(cu_seqlens, TokenShard(0, 1, tokens), "cpu")
    assert mask.kv_num_blocks.flatten().tolist() == [1] * blocks
    assert mask.full_kv_num_blocks.flatten().tolist() == list(range(blocks))


@pytest.mark.parametrize("cp", [1, 2])
def test_flex_attention_under_the_block_mask_matches_float64_masked_softmax(cp):
    g = torch.Generator().manual_seed(cp)
    tokens, heads, groups, dim = 600, 4, 2, 16
    cu_seqlens = _random_cu_seqlens(tokens, 4, g)
    for rank in range(cp):
        shard = TokenShard(rank, cp, tokens)
        visible = ~packed_causal_mask(cu_seqlens, shard, "cpu")[0, 0]
        q = torch.randn(1, heads, visible.shape[0], dim, generator=g, dtype=torch.float64)
        k, v = (
            torch.randn(1, groups, visible.shape[1], dim, generator=g, dtype=torch.float64)
            for _ in range(2)
        )
        out = flex_attention(
            q, k, v, block_mask=packed_block_mask(cu_seqlens, shard, "cpu"), enable_gqa=True
        )
        repeat = heads // groups
        scores = q @ k.repeat_interleave(repeat, 1).transpose(-1, -2) / dim**0.5
        want = scores.masked_fill(~visible, float("-inf")).softmax(-1) @ v.repeat_interleave(
            repeat, 1
        )
        torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)


def _float64_packed_attention(q, k, v, cu_seqlens):
    """q [T, heads, d], k/v [T, groups, d] float64 -> [T, heads * d] under the dense mask."""
    visible = ~packed_causal_mask(cu_seqlens, TokenShard(0, 1, q.shape[0]), "cpu")[0, 0]
    repeat = q.shape[1] // k.shape[1]
    qh, kh, vh = (
        q.transpose(0, 1),
        *(t.repeat_interleave(repeat, 1).transpose(0, 1) for t in (k, v)),
    )
    scores = qh @ kh.transpose(-1, -2) / q.shape[-1] ** 0.5
    out = scores.masked_fill(~visible, float("-inf")).softmax(-1) @ vh
    return out.transpose(0, 1).flatten(1)


def _assert_matches_float64_masked_softmax(
    attend, lengths: list[int], seed: int, grads: bool = True
) -> None:
    """`attend(q, k, v)` ([T, 1, heads|groups, d] -> [T, 1, heads * d]) against float64
    per-sequence causal attention, output and (with `grads`) gradients, on fresh random
    inputs."""
    g = torch.Generator().manual_seed(seed)
    heads, groups, dim = 6, 2, 16
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    tokens = sum(lengths)
    q = torch.randn(tokens, 1, heads, dim, generator=g, dtype=torch.float64, requires_grad=grads)
    k, v = (
        torch.randn(tokens, 1, groups, dim, generator=g, dtype=torch.float64, requires_grad=grads)
        for _ in range(2)
    )
    out = attend(q, k, v)[:, 0]
    want = _float64_packed_attention(q[:, 0], k[:, 0], v[:, 0], cu_seqlens)
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)
    if not grads:
        return
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    expected = torch.autograd.grad(want, (q, k, v), grad)
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize(
    "lengths",
    [
        [64, 64, 64],
        [50, 64, 37, 60],
        [1, 8, 8],
        [64],
        [1, 90, 8],
        [300, 40, 7, 90, 200, 5],
        [5, 0, 30, 0],  # empty sequences: in no group
    ],
)
@pytest.mark.parametrize("limit", [None, 0.0, 1.5, 100.0])
def test_length_groups_match_float64_masked_softmax(lengths, limit):
    # None: the estimate's pick; 0: every sequence alone; 100: the row one padded batch.
    groups = LengthGroups.of(lengths, "cpu", limit)
    attend = partial(grouped_attention, groups=groups)
    _assert_matches_float64_masked_softmax(attend, lengths, seed=sum(lengths) + int(limit or 7))


def _simulated_context_parallel(q, k, v, cu_seqlens, cp):
    """q [T, 1, heads, d], k/v [T, 1, groups, d] of the whole row -> [T, 1, heads * d]: every
    rank of a cp group of `cp` attends its queries over the keys and values of all ranks,
    gathered by hand as `gather_keys` does (rank by rank, each padded to the width, then
    taken at the pieces' key order); each rank's output put back at its tokens' row
    positions."""
    tokens = q.shape[0]
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    shards = [TokenShard(rank, cp, tokens) for rank in range(cp)]

    def gathered(x):
        width = shards[0].width
        return torch.cat(
            [
                torch.cat([x[s.index], x.new_zeros(width - len(s.index), *x.shape[1:])])
                for s in shards
            ]
        )

    out = q.new_zeros(tokens, 1, q.shape[2] * v.shape[-1])
    for shard in shards:
        pieces = SequencePieces.of(cu_seqlens, lengths, shard, "cpu")
        k_row, v_row = (gathered(t).index_select(0, pieces.key_order) for t in (k, v))
        local = _merged_pieces(q[shard.index], k_row, v_row, pieces)
        out = out.index_add(0, shard.index, local)
    return out


@pytest.mark.parametrize(
    ("lengths", "cp"),
    [
        ([64], 2),  # one sequence
        ([40, 40], 2),  # a boundary on a chunk edge
        ([30, 51, 17], 3),  # boundaries inside chunks
        ([5, 90, 2], 4),  # sequences shorter than a chunk, one across four chunks
        ([3, 1, 4, 9], 2),  # chunks of several sequences
    ],
)
def test_context_parallel_pieces_give_the_whole_rows_attention(lengths, cp):
    attend = partial(
        _simulated_context_parallel,
        cu_seqlens=torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()]),
        cp=cp,
    )
    _assert_matches_float64_masked_softmax(attend, lengths, seed=sum(lengths) + cp)


def test_sequence_pieces_cut_the_local_chunks_at_sequence_starts():
    # 20 tokens, cp=2: chunks [0, 5) [5, 10) [10, 15) [15, 20); rank 1 holds [5, 10) and
    # [10, 15), local queries 0-4 and 5-9. Sequences [0, 7), [7, 12), [12, 20).
    cu_seqlens = torch.tensor([0, 7, 12, 20])
    pieces = SequencePieces.of(cu_seqlens, [7, 5, 8], TokenShard(1, 2, 20), "cpu")
    assert pieces.pieces == ((0, 2, 0, 7), (2, 5, 7, 10), (5, 7, 7, 12), (7, 10, 12, 15))
    assert pieces.width == 10
    # Gathered keys rank by rank: rank 0 holds [0, 5) and [15, 20), rank 1 [5, 15).
    assert pieces.key_order.tolist() == [*range(5), *range(10, 20), *range(5, 10)]
    assert pieces.block_mask.seq_lengths == (10, 20)
    with pytest.raises(ValueError, match=r"cu_seqlens covers 19 tokens but the batch has 20"):
        SequencePieces.of(cu_seqlens, [7, 5, 7], TokenShard(1, 2, 20), "cpu")


def test_sequences_group_by_length_within_the_padded_work_limit():
    # Longest first; a sequence joins the open group while count * longest^2 stays within
    # the limit of the group's sum(L^2). 16384 and 15004 pad to 2 * 16384^2 <= 1.5 * their
    # work; 4000 would not, nor would 300 join 4000 and 3900.
    groups = LengthGroups.of([300, 16384, 4000, 15004, 3900, 280], "cpu", limit=1.5)
    assert groups.shapes == ((2, 300), (2, 16384), (2, 4000))
    assert groups.gather.numel() == 2 * 300 + 2 * 16384 + 2 * 4000  # a row position a slot
    # Slots: the 300, 280 (+20 padding) group first (row order of first members), then 16384
    # and 15004 (+1380 padding), then 4000 and 3900 (+100 padding).
    gather, scatter = groups.gather.tolist(), groups.scatter.tolist()
    assert gather[:300] == list(range(300))
    assert gather[300:600] == [*range(39588, 39868), *[0] * 20]
    assert scatter[300] == 600 and scatter[20684] == 600 + 16384
    assert all(gather[slot] == token for token, slot in enumerate(scatter))


def test_equal_or_lone_sequences_in_row_order_are_the_row_itself():
    assert LengthGroups.of([2048] * 4, "cpu") == LengthGroups(((4, 2048),), None, None)
    lone = LengthGroups.of([4096, 64, 2048], "cpu", limit=0.0)
    assert lone == LengthGroups(((1, 4096), (1, 64), (1, 2048)), None, None)
    # Grouped out of row order, or padded: the slots are gathered.
    assert LengthGroups.of([2048, 64, 2048], "cpu", limit=1.5).gather is not None
    assert LengthGroups.of([2000, 2048, 1900], "cpu", limit=1.5).shapes == ((3, 2048),)


def test_the_grouping_of_least_estimated_work_is_taken():
    # A long-tailed RL row: sequences of a few thousand tokens run alone on the row (a gather
    # and padding would cost more than the calls they save).
    long_tailed = [4626, 159, 561, 8177, 2768]
    assert LengthGroups.of(long_tailed, "cpu").shapes == tuple((1, n) for n in long_tailed)
    # Many short sequences: a few padded groups, gathered, not 160 calls.
    short = [40 + (i * 37) % 120 for i in range(160)]
    grouped = LengthGroups.of(short, "cpu")
    assert len(grouped.shapes) <= 3 and grouped.gather is not None
    assert sum(count for count, _ in grouped.shapes) == 160
    # A long sequence and equal short ones after it: two groups, still the row itself.
    assert LengthGroups.of([8000] + [150] * 50, "cpu") == LengthGroups(
        ((1, 8000), (50, 150)), None, None
    )


def _grads(model_dir, recompute, batch):
    # The trainer's device: without a GPU Megatron runs on the CPU shims, which a machine
    # with one does not apply (its core attention then needs CUDA tensors).
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dims = ModelShape.from_model_dir(model_dir)
    model = load_policy_model(model_dir, dims, device, 0, 1, recompute=recompute)
    ids, positions, cu = (
        t.to(device) for t in (batch.input_ids, batch.position_ids, batch.cu_seqlens)
    )
    hidden, _ = model.hidden_states(ids, positions, cu)
    (hidden.pow(2).mean() + hidden[:, 0].sum()).backward()
    return {n: p.grad.cpu() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_recomputation_gives_the_gradients_of_none(megatron_tp1, tiny_qwen2_dir, recompute):
    dims = ModelShape.from_model_dir(tiny_qwen2_dir)
    batch = random_packed_batch(dims.vocab, [9, 14, 6], seed=3)
    want = _grads(tiny_qwen2_dir, "none", batch)
    got = _grads(tiny_qwen2_dir, recompute, batch)
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=name)

"""Packed attention: the FlexAttention block mask against the dense packed causal mask, its
output against a float64 reference (GQA, context-parallel shares), and recomputation modes
against none."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention.flex_attention import flex_attention

from mtprun.models import ModelDims
from mtprun.runner.trainer.attention import BLOCK, packed_block_mask, packed_causal_mask
from mtprun.runner.trainer.context_parallel import TokenShard
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


def _grads(model_dir, recompute, batch):
    dims = ModelDims.from_model_dir(model_dir)
    model = load_policy_model(model_dir, dims, torch.device("cpu"), 0, 1, recompute=recompute)
    hidden, _ = model.hidden_states(batch.input_ids, batch.position_ids, batch.cu_seqlens)
    (hidden.pow(2).mean() + hidden[:, 0].sum()).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_recomputation_gives_the_gradients_of_none(megatron_tp1, tiny_qwen2_dir, recompute):
    dims = ModelDims.from_model_dir(tiny_qwen2_dir)
    batch = random_packed_batch(dims.vocab, [9, 14, 6], seed=3)
    want = _grads(tiny_qwen2_dir, "none", batch)
    got = _grads(tiny_qwen2_dir, recompute, batch)
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=name)

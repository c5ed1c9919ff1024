"""How context parallelism splits a packed row (the two-process training run against one
process is in test_trainer.py), and which data-parallel replica each trainer rank serves."""

import itertools

import pytest
import torch
from megatron.core.parallel_state import RankGenerator

from mtprun.data.batch import PackedBatch
from mtprun.runner.trainer.attention import packed_causal_mask
from mtprun.runner.trainer.context_parallel import TokenShard
from mtprun.runner.trainer.parallel import data_parallel_replica
from mtprun.spec.parallel import ParallelSection


@pytest.mark.parametrize(("tokens", "cp"), [(37, 2), (64, 4), (8, 4), (100, 3)])
def test_ranks_hold_every_token_once_one_early_and_one_late_chunk(tokens, cp):
    shards = [TokenShard(r, cp, tokens) for r in range(cp)]
    held = torch.cat([s.index for s in shards])
    assert sorted(held.tolist()) == list(range(tokens))
    sizes = [len(s.index) for s in shards]
    assert max(sizes) - min(sizes) <= 2  # balanced to a token per chunk
    assert shards[0].index[0] == 0 and shards[0].index[-1] == tokens - 1
    for s in shards:
        assert s.width == max(sizes)
        keys = s.key_positions()
        assert keys.numel() == cp * s.width
        assert sorted(keys[keys >= 0].tolist()) == list(range(tokens))


def test_a_rank_sees_exactly_the_keys_the_whole_row_lets_its_queries_see():
    cu_seqlens = torch.tensor([0, 5, 6, 19, 30], dtype=torch.int32)
    whole = packed_causal_mask(cu_seqlens, TokenShard(0, 1, 30), "cpu")[0, 0]
    for rank in range(4):
        shard = TokenShard(rank, 4, 30)
        local = packed_causal_mask(cu_seqlens, shard, "cpu")[0, 0]
        keys = shard.key_positions()
        assert local.shape == (len(shard.index), keys.numel())
        assert local[:, keys < 0].all()  # padding is never seen
        expected = whole[shard.index][:, keys[keys >= 0]]
        assert torch.equal(local[:, keys >= 0], expected)


def test_take_keeps_the_rank_tokens_of_every_per_token_field():
    tokens = 12
    batch = PackedBatch(
        input_ids=torch.randint(0, 50, (tokens,)),
        targets=torch.randint(0, 50, (tokens,)),
        loss_mask=torch.rand(tokens) > 0.5,
        position_ids=torch.arange(tokens),
        cu_seqlens=torch.tensor([0, 7, 12], dtype=torch.int32),
        advantages=torch.randn(tokens),
        old_logprobs=None,
        ref_logprobs=-torch.rand(tokens),
    )
    shard = TokenShard(1, 2, tokens)
    local = shard.take(batch)
    for name in ("input_ids", "targets", "loss_mask", "position_ids", "advantages", "ref_logprobs"):
        assert torch.equal(getattr(local, name), getattr(batch, name)[shard.index]), name
    assert local.old_logprobs is None
    assert local.cu_seqlens.tolist() == [0, len(shard.index)]
    assert TokenShard(0, 1, tokens).take(batch) is batch


def test_bad_shards_are_refused():
    with pytest.raises(ValueError, match=r"context-parallel rank 2 is outside 0\.\.1"):
        TokenShard(2, 2, 16)
    with pytest.raises(ValueError, match=r"3 tokens is too short for parallel\.cp=2"):
        TokenShard(0, 2, 3)


def test_data_parallel_replicas_follow_megatron_rank_order():
    for tp, cp, dp, pp in itertools.product((1, 2), (1, 2), (1, 2, 3), (1, 2)):
        layout = ParallelSection(tp=tp, cp=cp, dp=dp, pp=pp)
        groups = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order="tp-cp-ep-dp-pp")
        for group in groups.get_ranks("dp"):
            # The ranks of one data-parallel group hold replicas 0..dp-1, in order.
            assert [data_parallel_replica(rank, layout) for rank in group] == list(range(dp))

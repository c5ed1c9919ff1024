from __future__ import annotations

import random

import pytest
import torch

from mtprun.data.mask import token_mask
from mtprun.data.packing import pack
from mtprun.data.render import RenderedSequence


def random_sequence(length: int, rl: bool = False) -> RenderedSequence:
    return RenderedSequence(
        token_ids=torch.randint(1, 100, (length,)),
        roles=torch.randint(0, 4, (length,), dtype=torch.int8),
        is_sampled=torch.rand(length) < 0.5,
        logprobs=-torch.rand(length) if rl else None,
    )


def reference_rows(sequence: RenderedSequence, policy) -> list[tuple[int, int, bool, int]]:
    """(input, target, trained, position) per row, one sequence at a time, in plain Python."""
    ids, mask = sequence.token_ids.tolist(), token_mask(sequence, policy).tolist()
    rows = []
    for t in range(len(ids)):
        last = t == len(ids) - 1
        rows.append((ids[t], 0 if last else ids[t + 1], False if last else mask[t + 1], t))
    return rows


@pytest.mark.parametrize("policy", ["sampled", "all", {"assistant": True}])
def test_packing_matches_a_per_sequence_reference(policy) -> None:
    rng = random.Random()
    sequences = [random_sequence(rng.randint(1, 40)) for _ in range(25)]
    batches = pack(sequences, policy, packing_length=64)

    expected = [row for s in sequences for row in reference_rows(s, policy)]
    got = [
        row
        for b in batches
        for row in zip(
            b.input_ids.tolist(),
            b.targets.tolist(),
            b.loss_mask.tolist(),
            b.position_ids.tolist(),
            strict=True,
        )
    ]
    assert got == expected
    assert sum(b.num_sequences for b in batches) == len(sequences)
    for batch in batches:
        assert batch.num_tokens <= 64
        assert batch.cu_seqlens[0] == 0 and batch.cu_seqlens[-1] == batch.num_tokens
        assert batch.cu_seqlens.dtype == torch.int32
        starts = batch.cu_seqlens[:-1].long()
        assert (batch.position_ids[starts] == 0).all()
        assert not batch.loss_mask[batch.cu_seqlens[1:].long() - 1].any()


def test_bins_close_when_the_next_sequence_does_not_fit() -> None:
    sequences = [random_sequence(n) for n in (5, 5, 3, 8, 2)]
    batches = pack(sequences, "all", packing_length=10)
    assert [b.cu_seqlens.tolist() for b in batches] == [[0, 5, 10], [0, 3], [0, 8, 10]]


def test_rl_fields_follow_the_target_token() -> None:
    sequences = [random_sequence(n, rl=True) for n in (4, 6, 3)]
    advantages = [0.5, -1.0, 2.0]
    (batch,) = pack(sequences, "sampled", packing_length=16, advantages=advantages)
    expected_logprobs = torch.cat([torch.cat([s.logprobs[1:], torch.zeros(1)]) for s in sequences])
    assert torch.equal(batch.old_logprobs, expected_logprobs)
    assert batch.advantages.tolist() == [0.5] * 4 + [-1.0] * 6 + [2.0] * 3


def test_too_long_sequence_is_a_clear_error() -> None:
    sequence = random_sequence(20)
    with pytest.raises(ValueError, match=r"sequence 0 has 20 tokens.*packing_length=16"):
        pack([sequence], "sampled", packing_length=16)


def test_rl_packing_checks_its_inputs() -> None:
    sequence = random_sequence(5)
    with pytest.raises(ValueError, match="2 advantages for 1 sequences"):
        pack([sequence], "sampled", 8, advantages=[1.0, 2.0])
    with pytest.raises(ValueError, match="needs the sampling logprobs"):
        pack([sequence], "sampled", 8, advantages=[1.0])

"""Per-tile statistics merged over any split of the vocab equal the whole-vocab statistics
(the property that lets one merge fold both tiles and tensor-parallel shards)."""

from __future__ import annotations

import itertools

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mtprun.kernels.online_stats import PartialStats, StatsSpec, finalize, merge, tile_stats


@st.composite
def problems(draw):
    rows = draw(st.integers(1, 6))
    vocab = draw(st.integers(2, 40))
    cuts = sorted(draw(st.sets(st.integers(1, vocab - 1), max_size=5)))
    topk = draw(st.integers(0, min(vocab, 4)))
    scale = draw(st.sampled_from([0.1, 3.0, 30.0]))  # large logits stress the rescaling
    seed = draw(st.integers(0, 2**31 - 1))
    return rows, vocab, [0, *cuts, vocab], topk, scale, seed


@settings(max_examples=60, deadline=None)
@given(problems())
def test_merged_tiles_equal_the_whole_vocab(problem):
    rows, vocab, bounds, topk, scale, seed = problem
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(rows, vocab, generator=gen, dtype=torch.float64) * scale
    t = torch.randn(rows, vocab, generator=gen, dtype=torch.float64) * scale
    targets = torch.randint(0, vocab, (rows,), generator=gen)
    spec = StatsSpec(teacher=True, teacher_dense=True, topk=topk)

    merged = None
    for start, stop in itertools.pairwise(bounds):
        tile, _ = tile_stats(
            z[:, start:stop].float().clone(), targets, start, t[:, start:stop].float().clone(), spec
        )
        tile = PartialStats.unpack(tile.pack(), spec)  # what crosses the wire under TP
        merged = tile if merged is None else merge(merged, tile)
    stats = finalize(merged)

    p, q = z.softmax(-1), t.softmax(-1)
    expected = {
        "lse": z.logsumexp(-1),
        "entropy": -(p * z.log_softmax(-1)).sum(-1),
        "target_logit": z.gather(1, targets[:, None]).squeeze(1),
        "teacher_lse": t.logsumexp(-1),
        "teacher_cross": (q * z).sum(-1) - z.max(-1).values,
    }
    for name, want in expected.items():
        got = getattr(stats, name).double()
        tol = 1e-5 * (1 + want.abs().max())
        assert (got - want).abs().max() <= tol, f"{name}: {got} vs {want}"
    assert torch.equal(stats.argmax, z.argmax(-1))
    assert torch.equal(stats.teacher_argmax, t.argmax(-1))
    if topk:
        values, ids = t.topk(topk, dim=-1)
        assert torch.equal(stats.topk_ids.sort(-1).values, ids.sort(-1).values)
        order = stats.topk_ids.argsort(-1)
        torch.testing.assert_close(
            stats.topk_probs.gather(1, order).double(),
            values.softmax(-1).gather(1, ids.argsort(-1)),
            atol=1e-6,
            rtol=1e-5,
        )
        torch.testing.assert_close(
            stats.topk_logits.double(), z.gather(1, stats.topk_ids), atol=1e-5, rtol=1e-6
        )

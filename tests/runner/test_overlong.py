"""DAPO's over-long handling: the reward shaping at the boundaries of its buffer, and the
filtering of responses cut at max_tokens off the loss mask (still counted as truncated)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from mtprun.data.render import ROLE_IDS, RenderedSequence
from mtprun.runner.rollout.episodes import EpisodeCollector, Episodes
from mtprun.runner.rollout.rewards import RewardOutcome
from mtprun.spec.data import OverlongBuffer

L, B, P = 64, 16, 0.5  # rollout.max_tokens, overlong_buffer.tokens, overlong_buffer.penalty


@pytest.mark.parametrize(
    ("n", "cut", "shaping"),
    [
        (1, False, 0.0),
        (L - B, False, 0.0),  # the buffer's edge: no penalty yet
        (L - B + 1, False, -P / B),  # one token into the buffer
        (L - B + B // 2, False, -P / 2),
        (L, False, -P),  # a response that ended by itself at L
        (L, True, -P),  # cut at L
        (5, True, -P),  # a multi-turn episode whose short last turn was cut
        (3 * L, False, -P),  # a multi-turn episode past L in all: the ramp stops at -P
    ],
)
def test_the_shaping_formula_at_the_boundaries(n: int, cut: bool, shaping: float) -> None:
    assert OverlongBuffer(tokens=B, penalty=P).shaping(n, L, cut) == pytest.approx(shaping)


def _sequence(prompt: int, sampled: int) -> RenderedSequence:
    n = prompt + sampled
    roles = torch.full((n,), ROLE_IDS["assistant"], dtype=torch.int8)
    roles[:prompt] = ROLE_IDS["user"]
    is_sampled = torch.zeros(n, dtype=torch.bool)
    is_sampled[prompt:] = True
    return RenderedSequence(
        torch.arange(n) % 7, roles, is_sampled, torch.where(is_sampled, -0.5, 0.0)
    )


def _episodes(lengths: list[int], cut: list[bool], rewards: list[list[float]]) -> Episodes:
    flat = [r for group in rewards for r in group]
    return Episodes(
        prompts=[f"p{g}" for g in range(len(rewards))],
        conversations=[()] * len(flat),
        trajectories=[_sequence(3, n) for n in lengths],
        rewards=torch.tensor(rewards, dtype=torch.float32),
        sampled_tokens=lengths,
        truncated=list(cut),
        tool_turns=[0] * len(flat),
        versions=[0] * len(flat),
        reward_outcomes=[RewardOutcome({"total": r}) for r in flat],
        cut=cut,
    )


def test_shaping_is_added_to_the_rewards_and_logged() -> None:
    episodes = _episodes([L - B, L - B + 1, L, 10], [False, False, True, False], [[1, 0], [1, 1]])
    shaped = episodes.shape_overlong(OverlongBuffer(tokens=B, penalty=P), L)
    assert shaped.rewards.flatten().tolist() == pytest.approx([1.0, -P / B, 1.0 - P, 1.0])
    assert shaped.overlong == pytest.approx([0.0, -P / B, -P, 0.0])
    metrics = shaped.metrics(rollout_seconds=1.0)
    assert metrics["reward/overlong"] == pytest.approx((-P / B - P) / 4)
    assert metrics["rollout/truncated_frac"] == 0.25
    assert "reward/overlong" not in episodes.metrics(rollout_seconds=1.0)
    # Dynamic sampling's selections keep each episode's shaping with it.
    kept = shaped.groups([1]) + shaped.groups([0])
    assert kept.overlong == pytest.approx([-P, 0.0, 0.0, -P / B])
    assert kept.cut == [True, False, False, False]


def _collector(mask_truncated: bool, overlong: OverlongBuffer | None = None) -> EpisodeCollector:
    """An EpisodeCollector without engines: `run` hands out `made`'s episodes."""
    collector = object.__new__(EpisodeCollector)
    collector.task_section = SimpleNamespace(
        prompts_per_step=2,
        samples_per_prompt=2,
        drop_uniform_groups=False,
        overlong_buffer=overlong,
    )
    collector.max_tokens, collector.seed = L, 0
    collector.mask_truncated = mask_truncated
    collector.max_offpolicy = None  # no partial rollouts
    collector.renderer = SimpleNamespace(tokenizer=SimpleNamespace(pad_token_id=0))
    collector.task = SimpleNamespace(
        step_prompts=lambda n, seed, step, sampling_round: ["p0", "p1"],
        step_metrics=lambda: {"search/calls": 3.0},
    )
    return collector


def test_a_step_is_shaped_only_with_an_overlong_buffer() -> None:
    made = _episodes([L - B + 4, 8, L, 8], [False, False, True, False], [[1, 0], [0, 1]])
    for overlong, expected in (
        (None, [1, 0, 0, 1]),
        (OverlongBuffer(tokens=B, penalty=P), [1 - P / 4, 0, -P, 1]),
    ):
        collector = _collector(False, overlong)
        collector.run = lambda prompts, n, **options: made
        episodes = collector.collect(step=1)
        assert episodes.rewards.flatten().tolist() == pytest.approx(expected)
        assert episodes.metrics(1.0)["search/calls"] == 3.0  # the task's own counters


def test_filtering_takes_cut_responses_off_the_loss_mask() -> None:
    episodes = _episodes([5, 6, 7, 4], [False, True, False, True], [[1, 0], [0, 1]])
    kept = _collector(False).pack(episodes, "sampled", 1024)
    filtered = _collector(True).pack(episodes, "sampled", 1024)
    [all_rows], [rows] = kept, filtered
    assert int(all_rows.loss_mask.sum()) == 5 + 6 + 7 + 4
    assert int(rows.loss_mask.sum()) == 5 + 7  # the cut episodes' 6 and 4 tokens are gone
    assert torch.equal(rows.input_ids, all_rows.input_ids)  # they still ride along
    # A roles table trains only sampled tokens too: the cut ones stay off.
    [roles] = _collector(True).pack(episodes, {"assistant": True}, 1024)
    assert torch.equal(roles.loss_mask, rows.loss_mask)
    # Still counted as truncated.
    assert episodes.metrics(1.0)["response/truncated_frac"] == 0.5
    assert episodes.metrics(1.0)["rollout/truncated_frac"] == 0.5
